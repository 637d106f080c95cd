#!/bin/bash
# session 10, lease 4 (H100): per-head Muon on the unrolled layout; the benchmark at k3jax-train's batch (16, 4 micro-batches)
source benchmarks/env/gpu_env.sh >/dev/null
s=$(date +%s)
timeout -s INT 150 python3 -m benchmarks.step.optimizer_step --variants adamw,muon_head --ns --ranks 8 --json $OUT/opt_unrolled.json model.scan_layers=false > $OUT/opt_unrolled.log 2>&1
echo "opt_unrolled rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
s=$(date +%s)
timeout -s INT 200 python3 -m benchmarks.step.train_step --model k3-small --steps 13 mesh.num_devices=1 train.batch_size=16 train.micro_batches=4 model.scan_layers=false --json $OUT/bench16.json > $OUT/bench16.log 2>&1
echo "bench16 rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
