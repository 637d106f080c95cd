#!/usr/bin/env bash
# Issue 23's standing figures in one lease: the default k3-small step with where its first compile
# goes, per-head Muon beside it, XLA flag variants, and k3jax-train on real text as a user runs it.
# One command, at most ~9.5 minutes, at most eight files under $OUT.
#   OUT=out bash benchmarks/step_muon_train_session.sh
#   VARIANTS="name:override NAME=value;..." as in ab_session.sh (default: dynamic-slice fusion on)
#   TRAIN_STEPS=40: k3jax-train's steps (16 x 4096 in two micro-batches, configs/k3-small.yaml)
#   1. "new": k3-small 8 x 4096, one micro-batch, AdamW, 13 timed steps, on an empty compilation
#      cache (a new user's first compile), with XLA's pass log: compile_passes.txt says where the
#      compile went (benchmarks/compile_passes.py)
#   2. "muon": the same with per-head Muon (optimizer.name=muon optimizer.muon_per_head=true)
#   3. each of $VARIANTS
#   4. k3jax-train, real text, the config's 16 x 4096 in two micro-batches: metrics.jsonl (tokens/s,
#      MFU, peak device memory per logged step)
source "$(dirname "$0")/gpu_env.sh"
session_start 570
export JAX_COMPILATION_CACHE_DIR=/tmp/k3jax-cold-cache  # empty: the first compile is a cold one
rm -rf "$JAX_COMPILATION_CACHE_DIR"
k3_small_step new "$PWD" TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1,hlo_pass_pipeline=1
timeout 60 python3 benchmarks/compile_passes.py /tmp/step_new.log --top 30 > "$OUT/compile_passes.txt" 2>&1
k3_small_step muon "$PWD" optimizer.name=muon optimizer.muon_per_head=true
IFS=';' read -ra vs <<< "${VARIANTS-dsf:XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true}"
for v in "${vs[@]}"; do
  read -ra ov <<< "${v#*:}"
  k3_small_step "${v%%:*}" "$PWD" "${ov[@]}"
done
LEFT=$(left)
echo "train: $LEFT s left at $((SECONDS - T0)) s" >> "$S"
if [[ $LEFT -gt 120 ]]; then
  timeout $LEFT python3 -m train --config configs/k3-small.yaml train.steps=${TRAIN_STEPS:-40} logging.every=10 \
    logging.eval_every=${TRAIN_STEPS:-40} checkpoint.every=1000 run_dir=/tmp/run > /tmp/train.log 2>&1
  echo "train rc $? at $((SECONDS - T0)) s" >> "$S"
  grep -v "^WARNING\|^W[0-9]\|^I[0-9]" /tmp/train.log | tail -16 >> "$S"
  cp /tmp/run/metrics.jsonl "$OUT/" 2>/dev/null
fi
cat "$S"
