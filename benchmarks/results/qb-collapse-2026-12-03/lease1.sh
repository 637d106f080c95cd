#!/usr/bin/env bash
# Lease 1 (2026-12-03): k3-small with its defaults, 300 steps, every step logged (the "before" run, with
# the router-health metrics), then the drift decomposition of QB's violation over the first 30 steps.
source benchmarks/gpu_env.sh
R=benchmarks/results/qb-collapse-2026-12-03
timeout 330 python3 -m train --config configs/k3-small.yaml run_dir=/tmp/before train.steps=300 logging.every=1 \
  checkpoint.every=100000 logging.progress=false > $OUT/before.log 2>&1
echo "before rc $?" >> $OUT/summary.txt
cp /tmp/before/metrics.jsonl $OUT/before_metrics.jsonl
rm -rf /tmp/before/checkpoints
DECOMP_OUT=$OUT/drift_decomposition.jsonl timeout 220 python3 $R/drift_decomposition.py configs/k3-small.yaml 30 \
  train.batch_size=8 train.micro_batches=2 logging.eval_every=0 > $OUT/drift_decomposition.log 2>&1
echo "decomposition rc $?" >> $OUT/summary.txt
