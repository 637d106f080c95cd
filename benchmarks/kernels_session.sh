#!/usr/bin/env bash
# Issue 23, the kernels written on 2026-12-02 without a GPU: one command, at most ~9.5 minutes,
# eight files under $OUT (the device tool's limit).
#   OUT=out bash benchmarks/kernels_session.sh
#   1. benchmarks/short_conv.py: KDA's short-conv backward, XLA against the Pallas kernel (checked)
#   2. benchmarks/glu_grad.py: the experts' GLU backward, XLA against the Pallas kernel (checked)
#   3. the k3-small step (8 x 4096, one micro-batch, AdamW, 13 steps with every loss) as it is, with
#      model.kda.conv_impl=auto, with model.moe.glu_grad=auto, and with both, in one lease
source "$(dirname "$0")/gpu_env.sh"
BUDGET=${BUDGET:-560}
T0=$SECONDS
S=$OUT/summary.txt
left() { echo $((BUDGET - (SECONDS - T0))); }
timeout 100 python3 benchmarks/short_conv.py --json "$OUT/short_conv.json" 2>&1 | grep -v "^W\|^I0" | tail -8 >> "$S"
timeout 60 python3 benchmarks/glu_grad.py --json "$OUT/glu_grad.json" 2>&1 | grep -v "^W\|^I0" | tail -2 >> "$S"
for run in "as_is:" "conv:model.kda.conv_impl=auto" "glu:model.moe.glu_grad=auto" \
           "both:model.kda.conv_impl=auto model.moe.glu_grad=auto"; do
  name=${run%%:*}
  read -ra ov <<< "${run#*:}"
  if [[ $(left) -lt 100 ]]; then echo "skipped $name ($(left) s left)" >> "$S"; continue; fi
  timeout $(( $(left) < 140 ? $(left) : 140 )) python3 benchmarks/train_step.py --model k3-small --steps 13 \
    --json "$OUT/step_$name.json" mesh.num_devices=1 train.batch_size=8 "${ov[@]}" > "/tmp/step_$name.log" 2>&1
  echo "$name rc $? at $((SECONDS - T0)) s: $(tail -1 "/tmp/step_$name.log" | cut -c1-300)" >> "$S"
done
cat "$S"
