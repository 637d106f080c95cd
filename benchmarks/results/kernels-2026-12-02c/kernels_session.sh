#!/usr/bin/env bash
# Issue 23, the short-conv backward kernel (the default on GPU since 2026-12-02) and the opt-in GLU
# backward kernel: one command, at most ~9.5 minutes, eight files under $OUT (the device tool's
# limit). Run first on 2026-12-02 evening (lease 1 of benchmarks/results/kernels-2026-12-02c), then
# again after the changes it prompted.
#   OUT=out bash benchmarks/kernels_session.sh
#   1. benchmarks/short_conv.py: KDA's short-conv backward, XLA against the Pallas kernel (checked)
#   2. benchmarks/glu_grad.py: the experts' GLU backward, XLA against the Pallas kernel (checked)
#   3. the k3-small step (8 x 4096, one micro-batch, AdamW, 13 steps with every loss) as it is,
#      with XLA's conv backward (model.kda.conv_impl=xla) and with the GLU kernel, in one lease
source "$(dirname "$0")/gpu_env.sh"
BUDGET=${BUDGET:-560}
T0=$SECONDS
S=$OUT/summary.txt
left() { echo $((BUDGET - (SECONDS - T0))); }
timeout 100 python3 benchmarks/short_conv.py --json "$OUT/short_conv.json" \
  --sweep "${CONV_SWEEP:-32,64,4,4;32,64,4,8,2;32,64,4,16,2;16,64,4,8;32,64,8,8,2}" 2>&1 | grep -v "^W\|^I0" | tail -10 >> "$S"
timeout 60 python3 benchmarks/glu_grad.py --json "$OUT/glu_grad.json" 2>&1 | grep -v "^W\|^I0" | tail -2 >> "$S"
# (the conv kernel is the default since lease 3 of 2026-12-02: xla_conv is the step without it)
for run in "as_is:" "xla_conv:model.kda.conv_impl=xla" "glu:model.moe.glu_grad=auto"; do
  name=${run%%:*}
  read -ra ov <<< "${run#*:}"
  if [[ $(left) -lt 100 ]]; then echo "skipped $name ($(left) s left)" >> "$S"; continue; fi
  timeout $(( $(left) < 140 ? $(left) : 140 )) python3 benchmarks/train_step.py --model k3-small --steps 13 \
    --json "$OUT/step_$name.json" mesh.num_devices=1 train.batch_size=8 "${ov[@]}" > "/tmp/step_$name.log" 2>&1
  echo "$name rc $? at $((SECONDS - T0)) s" >> "$S"
  python3 -c "import json; d = json.load(open('$OUT/step_$name.json')); print({k: d[k] for k in
    ('step_ms', 'tokens_per_s', 'mfu', 'compile_s', 'peak_gb', 'loss')})" >> "$S" 2>&1
done
cat "$S"
