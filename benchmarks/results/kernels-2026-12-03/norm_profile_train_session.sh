#!/usr/bin/env bash
# Issue 23, after the conv + l2-norm backward kernel became the default: its launch settings, where
# the default step's time goes, and the default in a real run. One command, at most ~9.5 minutes,
# at most eight files under $OUT.
#   OUT=out bash benchmarks/norm_profile_train_session.sh
#   1. benchmarks/short_conv.py: the normalised conv backward, XLA against the kernel's settings
#   2. the k3-small step (8 x 4096, defaults), command buffers off, times by source line
#   3. k3jax-train on k3-small (real text, 16 x 4096 in two micro-batches) for 100 steps, or as many
#      as the time left allows (metrics.jsonl comes back either way)
source "$(dirname "$0")/gpu_env.sh"
session_start 575
timeout 230 python3 benchmarks/short_conv.py --json "$OUT/short_conv.json" --sweep "" 2>&1 \
  | grep -v "^W\|^I0" | tail -12 >> "$S"
echo "micro done at $((SECONDS - T0)) s" >> "$S"
# with the optimized HLO the profile ran (step.hlo.gz: where the 2026-12-02 night's 12 extra
# ragged-dot launches were found, XLA's dynamic-slice fusion; train/xla_flags.py)
profile_default_step 200
LEFT=$(left)
echo "train: $LEFT s left at $((SECONDS - T0)) s" >> "$S"
timeout $LEFT python3 -m train.cli --config configs/k3-small.yaml train.steps=100 logging.eval_every=50 \
  checkpoint.every=1000 run_dir=/tmp/run > /tmp/train.log 2>&1
echo "train rc $? at $((SECONDS - T0)) s" >> "$S"
grep -v "^WARNING\|^W[0-9]\|^I[0-9]" /tmp/train.log | tail -20 >> "$S"
cp /tmp/run/metrics.jsonl "$OUT/" 2>/dev/null
cat "$S"
