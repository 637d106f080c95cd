#!/usr/bin/env bash
# Call B (2026-12-06; the same warm H100, EXTRA=train.micro_batches=4 TRAIN_S=520): the tree at 4bc07ef (lr 3e-3 / 20 warmup,
# linear-bin histogram) on the same command, 300 steps, built with
# `python benchmarks/run.py --prepare-base 4bc07ef .device/base`; then issue 48's GPU checks
# in the time left (the rest in call C).
source benchmarks/env/gpu_env.sh
cat $OUT/gpu.txt > $OUT/summary.txt; rm -f $OUT/gpu.txt
( cd .device/base && PYTHONPATH=/tmp/site:$PWD timeout ${TRAIN_S:-480} python3 -m train --config configs/k3-small.yaml \
    run_dir=/dev/shm/before train.steps=300 checkpoint.every=100000 logging.progress=false ${EXTRA:-} > $OUT/before.log 2>&1
  echo "before rc $? at $SECONDS s" >> $OUT/summary.txt )
cp /dev/shm/before/metrics.jsonl $OUT/before_metrics.jsonl
rm -rf /dev/shm/before
ls -d /dev/shm/after/checkpoints/300 >> $OUT/summary.txt 2>&1
python3 -m benchmarks.checks.all --out $OUT/checks --budget-s $((585 - SECONDS)) >> $OUT/summary.txt 2>&1
echo "checks rc $? at $SECONDS s" >> $OUT/summary.txt
