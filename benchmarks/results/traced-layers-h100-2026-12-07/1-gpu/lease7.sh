#!/bin/bash
# session 11, call 1 (issue 42): the per-kind layer traces (this tree) against f7ad188 (.device/base),
# the step benchmark at k3jax-train's batch (16 x 4096, 4 micro-batches, unrolled, the config's
# data), each from its own empty compilation cache; then k3jax-train 60 steps from an emptied cache
# (the 3 % goal against this tree's benchmark, and its compile); on an H200, the headline 8 x 4096
T0=$(date +%s)
source benchmarks/env/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=uuid --format=csv,noheader > $OUT/lease.txt 2>&1
B="--model k3-small --steps 13 mesh.num_devices=1 train.batch_size=16 train.micro_batches=4 model.scan_layers=false --data config"
s=$(date +%s)
JAX_COMPILATION_CACHE_DIR=/tmp/c-new timeout -s INT 170 python3 -m benchmarks.step.train_step $B --json $OUT/bench16_new.json > $OUT/bench16_new.log 2>&1
echo "bench16_new rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
s=$(date +%s)
(cd .device/base && JAX_COMPILATION_CACHE_DIR=/tmp/c-base PYTHONPATH=/tmp/site:$PWD timeout -s INT 170 python3 -m benchmarks.step.train_step $B --json $OUT/bench16_base.json > $OUT/bench16_base.log 2>&1)
echo "bench16_base rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
s=$(date +%s)
JAX_COMPILATION_CACHE_DIR=/tmp/empty-train timeout -s INT 220 python3 -m train.cli --config configs/k3-small.yaml run_dir=/tmp/run train.steps=60 train.micro_batches=4 model.scan_layers=false > $OUT/train.log 2>&1
echo "train rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
cp /tmp/run/metrics.jsonl $OUT/train_metrics.jsonl 2>/dev/null; rm -rf /tmp/run
left=$(( 580 - ($(date +%s) - T0) ))
echo "left: $left s" >> $OUT/plan.txt
if grep -q H200 $OUT/gpu.txt && [ $left -gt 100 ]; then
  s=$(date +%s)
  timeout -s INT $left python3 -m benchmarks.step.train_step --model k3-small --steps 13 mesh.num_devices=1 train.batch_size=8 --json $OUT/bench8_h200.json > $OUT/bench8_h200.log 2>&1
  echo "bench8 rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
fi
