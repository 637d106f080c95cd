#!/usr/bin/env bash
# Issue 23, after kernels_session.sh found neither opt-in kernel moving the step: where their time
# goes, kernel by kernel. One command, at most ~9.5 minutes, eight files under $OUT.
#   OUT=out bash benchmarks/kernels_profile_session.sh
#   1. benchmarks/short_conv.py --profile: per-kernel times of the conv backward (XLA, Pallas), and
#      of forward + backward (XLA, Pallas)
#   2. benchmarks/glu_grad.py --profile: the GLU backward, XLA against the kernel
#   3. the k3-small step, command buffers off, times by source line: with both kernels on (as run on
#      2026-12-02, whose files were named step_both_profiled.json and profile_both_nocb.txt), or with
#      the overrides in $STEP_OVERRIDES ("" for the defaults)
source "$(dirname "$0")/gpu_env.sh"
T0=$SECONDS
S=$OUT/summary.txt
summ() { timeout 60 python3 benchmarks/profile_summary.py "$@" 2>&1 | grep -v "^W\|^I0"; }
timeout 150 python3 benchmarks/short_conv.py --json "$OUT/short_conv.json" --profile /tmp/conv \
  --sweep "16,64,4" 2>&1 | grep -v "^W\|^I0" | tail -8 >> "$S"
for d in /tmp/conv/*; do echo "== $(basename $d)"; summ "$d" --steps 3 --top 25; done > "$OUT/conv_profiles.txt"
timeout 90 python3 benchmarks/glu_grad.py --json "$OUT/glu_grad.json" --profile /tmp/glu 2>&1 \
  | grep -v "^W\|^I0" | tail -2 >> "$S"
for d in /tmp/glu/*; do echo "== $(basename $d)"; summ "$d" --steps 3 --top 25; done > "$OUT/glu_profiles.txt"
echo "micro done at $((SECONDS - T0)) s" >> "$S"
LEFT=$((560 - (SECONDS - T0)))
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout $((LEFT - 70)) python3 benchmarks/train_step.py --model k3-small \
  --steps 5 --profile /tmp/trace --hlo /tmp/step.hlo --json "$OUT/step_profiled.json" mesh.num_devices=1 \
  train.batch_size=8 ${STEP_OVERRIDES-model.kda.conv_impl=auto model.moe.glu_grad=auto} > /tmp/prof.log 2>&1
echo "step rc $? at $((SECONDS - T0)) s" >> "$S"
summ /tmp/trace --top 60 --hlo /tmp/step.hlo > "$OUT/profile_nocb.txt"
echo "done at $((SECONDS - T0)) s" >> "$S"
cat "$S"
