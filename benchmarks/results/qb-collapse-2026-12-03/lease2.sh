#!/usr/bin/env bash
# Lease 2 (2026-12-03): k3-small, 150 steps each, with the asinh-binned histogram of biased margins:
# at today's lr (3e-3), at 1e-3, at 5e-4; then the kernel path's routing statistics against the XLA forms'.
source benchmarks/gpu_env.sh
R=benchmarks/results/qb-collapse-2026-12-03
for v in "lr3e-3 optimizer.lr=3e-3" "lr1e-3 optimizer.lr=1e-3" "lr5e-4 optimizer.lr=5e-4"; do
  set -- $v
  timeout 200 python3 -m train --config configs/k3-small.yaml run_dir=/dev/shm/$1 train.steps=150 logging.every=5 \
    logging.eval_every=50 checkpoint.every=100000 logging.progress=false $2 > $OUT/$1.log 2>&1
  echo "$1 rc $? at $SECONDS s" >> $OUT/summary.txt
  cp /dev/shm/$1/metrics.jsonl $OUT/$1_metrics.jsonl
  [[ $1 != lr3e-3 ]] && rm -rf /dev/shm/$1
done
timeout $((590 - SECONDS)) python3 $R/stats_kernel_vs_xla.py /dev/shm/lr3e-3 $OUT/stats_kernel_vs_xla.json > $OUT/stats.log 2>&1
echo "stats rc $? at $SECONDS s" >> $OUT/summary.txt
