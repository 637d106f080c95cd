#!/usr/bin/env bash
# Call A (2026-12-06; run on one H100 with EXTRA=train.micro_batches=4 TRAIN_S=570, as no H200 came): issue 47's acceptance run, k3-small with the defaults of this tree
# (lr 1e-3 / 100 warmup, asinh-bin histogram), 300 steps; then issue 40's k3jax-generate on its
# step-300 checkpoint at batch 1 and 8. Outputs as they come, under $OUT.
source benchmarks/env/gpu_env.sh
cat $OUT/gpu.txt > $OUT/summary.txt; rm -f $OUT/gpu.txt
timeout ${TRAIN_S:-510} python3 -m train --config configs/k3-small.yaml run_dir=/dev/shm/after train.steps=300 \
  checkpoint.every=300 logging.progress=false ${EXTRA:-} > $OUT/after.log 2>&1
echo "after rc $? at $SECONDS s" >> $OUT/summary.txt
cp /dev/shm/after/metrics.jsonl $OUT/after_metrics.jsonl
[[ $SECONDS -lt 540 ]] && for b in 1 8; do
  timeout $((585 - SECONDS)) python3 -m train.generate /dev/shm/after --prompt "import " \
    --max-new-tokens 256 --batch $b ${EXTRA_GEN:-} > $OUT/generate_b$b.log 2>&1
  echo "generate batch $b rc $? at $SECONDS s" >> $OUT/summary.txt
done
