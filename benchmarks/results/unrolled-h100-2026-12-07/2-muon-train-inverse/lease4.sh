#!/bin/bash
# session 10, lease 2 (H100): Muon at --ranks 8; k3jax-train unrolled first launch; the KDA inverse tune
source benchmarks/env/gpu_env.sh >/dev/null
cp $OUT/gpu.txt $OUT/gpu_env.txt 2>/dev/null
s=$(date +%s)
timeout -s INT 170 python3 -m benchmarks.step.optimizer_step --variants adamw,muon_head --ns --ranks 8 --json $OUT/opt.json > $OUT/opt.log 2>&1
echo "opt rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
s=$(date +%s)
JAX_COMPILATION_CACHE_DIR=/tmp/empty-train timeout -s INT 210 python3 -m train.cli --config configs/k3-small.yaml run_dir=$OUT/run train.steps=60 train.micro_batches=4 model.scan_layers=false > $OUT/train.log 2>&1
echo "train rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
s=$(date +%s)
timeout -s INT 170 python3 -m benchmarks.ops.kda_op --shapes 8x4096x16x128,2x16384x16x128,1x65536x16x128 --impl pallas --tune ';intra_inverse=1' --json $OUT/inverse.json > $OUT/inverse.log 2>&1
echo "inverse rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
rm -rf $OUT/run/checkpoints
