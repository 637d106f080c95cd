#!/usr/bin/env bash
# Call D (2026-12-06, session 3): issue 47's acceptance run with this tree's defaults, 300 steps,
# logging every step (so a spike names its step), one checkpoint at the end; then the routing
# statistics of the GPU kernel path against the XLA forms on that checkpoint
# (../qb-collapse-2026-12-03/stats_kernel_vs_xla.py). EXTRA: config overrides (H100: train.micro_batches=4).
source benchmarks/env/gpu_env.sh >/dev/null
cat $OUT/gpu.txt > $OUT/summary.txt; rm -f $OUT/gpu.txt
timeout ${TRAIN_S:-480} python3 -m train --config configs/k3-small.yaml run_dir=/dev/shm/run train.steps=300 \
    checkpoint.every=300 logging.progress=false logging.every=1 ${EXTRA:-} > $OUT/train.log 2>&1
echo "train rc $? at $SECONDS s" >> $OUT/summary.txt
cp /dev/shm/run/metrics.jsonl $OUT/metrics.jsonl
ls /dev/shm/run/checkpoints >> $OUT/summary.txt 2>&1
timeout $((585 - SECONDS)) python3 benchmarks/results/qb-collapse-2026-12-03/stats_kernel_vs_xla.py /dev/shm/run \
    $OUT/stats_kernel_vs_xla.json > $OUT/stats_kernel_vs_xla.log 2>&1
echo "stats rc $? at $SECONDS s" >> $OUT/summary.txt
