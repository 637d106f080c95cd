#!/usr/bin/env bash
# Issue 47, session 4 (2026-12-06). PART=train: k3-small with this tree's defaults and EXTRA, 300
# steps, logging every 10, checkpoints at steps 190 and 300. Run on one H100 with
# EXTRA="train.micro_batches=4 model.moe.qb_update_rate=0.5" (8 rows a micro-batch need an H200).
# PART=replay: the kernel path's routing statistics against
# the XLA forms on the step-300 checkpoint (../qb-collapse-2026-12-03/stats_kernel_vs_xla.py); then the run's
# training batches 1-300 replayed through the frozen step-190 and step-300 checkpoints with QB
# running, at rate 1 (Su's rule) and, on step 300's, 0.5 (replay_frozen.py).
source benchmarks/env/gpu_env.sh >/dev/null
HERE=benchmarks/results/qb-replay-2026-12-06
case ${PART:-train} in
train)
  cat $OUT/gpu.txt > $OUT/summary.txt; rm -f $OUT/gpu.txt
  timeout ${TRAIN_S:-560} python3 -m train --config configs/k3-small.yaml run_dir=/dev/shm/run train.steps=300 \
      checkpoint.every=190 logging.progress=false ${EXTRA:-} > $OUT/train.log 2>&1
  echo "train rc $? at $SECONDS s" >> $OUT/summary.txt
  cp /dev/shm/run/metrics.jsonl $OUT/metrics.jsonl
  ls /dev/shm/run/checkpoints >> $OUT/summary.txt 2>&1 ;;
replay)
  cat $OUT/gpu.txt > $OUT/summary_replay.txt; rm -f $OUT/gpu.txt
  timeout 150 python3 benchmarks/results/qb-collapse-2026-12-03/stats_kernel_vs_xla.py /dev/shm/run \
      $OUT/stats_kernel_vs_xla.json > $OUT/stats_kernel_vs_xla.log 2>&1
  echo "stats rc $? at $SECONDS s" >> $OUT/summary_replay.txt
  timeout $((590 - SECONDS)) python3 $HERE/replay_frozen.py /dev/shm/run $OUT/replay.jsonl \
      --replays ${REPLAYS:-190:1,300:1,300:0.5} > $OUT/replay.log 2>&1
  echo "replay rc $? at $SECONDS s" >> $OUT/summary_replay.txt ;;
esac
