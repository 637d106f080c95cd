#!/bin/bash
# lease 1 (2026-12-07 session 9): issue 42 scan A/B, then optimizer --ranks
source benchmarks/env/gpu_env.sh >/dev/null
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits|head -1); mb=1; [ "$mem" -lt 100000 ] && mb=2
echo "mem=$mem mb=$mb" > $OUT/plan.txt
cp $OUT/gpu.txt $OUT/gpu_env.txt 2>/dev/null
for o in true false; do
  s=$(date +%s)
  JAX_COMPILATION_CACHE_DIR=/tmp/empty-$o timeout -s INT ${T:-150} python3 -m benchmarks.step.train_step --model k3-small --steps 13 mesh.num_devices=1 train.batch_size=8 train.micro_batches=$mb model.scan_layers=$o --json $OUT/scan_$o.json > $OUT/scan_$o.log 2>&1
  echo "scan=$o rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
done
