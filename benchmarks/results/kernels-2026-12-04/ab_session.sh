#!/usr/bin/env bash
# Issue 23: this checkout's k3-small step against an earlier tree's, in one lease, with a
# micro-benchmark first. One command, at most ~9.5 minutes, at most eight files under $OUT.
#   git archive <commit> | tar -x -C .device/prev      # the earlier tree (carried with .device)
#   OUT=out VARIANTS="glu:model.moe.glu_grad=auto" bash benchmarks/ab_session.sh
#   OUT=out VARIANTS="dsf:XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true" CONV_S=0 HLO=1 bash ...
#   1. benchmarks/short_conv.py: the conv backward's launch settings, and KDA's q/k form (the conv
#      and the l2 norm under one backward) against the two layers one after the other
#   2. the k3-small step (8 x 4096, one micro-batch, AdamW, 13 timed steps) of this checkout
#      ("new"), of .device/prev ("prev"), then of this checkout with each of $VARIANTS
#      ("name:override override;name:..."; a word NAME=value is set in the step's environment
#      instead, e.g. XLA_FLAGS=...: train/xla_flags.py adds only the flags it does not name);
#      PREV=0 skips prev; CONV_S=0 skips step 1; HLO=1 brings back the new step's optimized HLO (step_new.hlo.gz);
#      TREES="name:.device/dir;..." runs the step of each further tree, after prev
source "$(dirname "$0")/gpu_env.sh"
session_start 570
# CONV_ARGS: short_conv.py's arguments (default: one extra setting, --sweep 32,64,4,4)
[[ ${CONV_S:-150} != 0 ]] && timeout ${CONV_S:-150} python3 benchmarks/short_conv.py --json "$OUT/short_conv.json" \
  ${CONV_ARGS:---sweep 32,64,4,4} 2>&1 | grep -v "^W\|^I0" | tail -14 >> "$S"
STEP_TIMEOUT=150
step() { k3_small_step "$@"; }  # name dir words... (gpu_env.sh)
if [[ ${HLO:-0} == 1 ]]; then step new "$PWD" --hlo /tmp/step_new.hlo; gzip -c /tmp/step_new.hlo > "$OUT/step_new.hlo.gz"
else step new "$PWD"; fi
[[ -d .device/prev && ${PREV:-1} != 0 ]] && step prev "$PWD/.device/prev"
# TREES="name:dir;...": further trees carried under .device (git archive + a patch), each a step
IFS=';' read -ra trees <<< "${TREES:-}"
for t in "${trees[@]}"; do step "${t%%:*}" "$PWD/${t#*:}"; done
IFS=';' read -ra vs <<< "${VARIANTS:-}"
for v in "${vs[@]}"; do
  read -ra ov <<< "${v#*:}"
  step "${v%%:*}" "$PWD" "${ov[@]}"
done
cat "$S"
