# lease 3 of 2026-12-02 (afternoon): the unmasked kernel inputs (this checkout) against the masked ones
# (.device/prev), same lease; a profile with command buffers off (kernels named by source line);
# then k3jax-train on k3-small (real text, 16 x 4096, two micro-batches) with the Pallas dw default
source benchmarks/gpu_env.sh
T0=$SECONDS
S=$OUT/summary.txt
STEP=(benchmarks/train_step.py --model k3-small --steps 13)
B8=(mesh.num_devices=1 train.batch_size=8)
timeout 150 python3 "${STEP[@]}" --json $OUT/new.json "${B8[@]}" > /tmp/new.log 2>&1
echo "new rc $? at $((SECONDS-T0)) s" >> $S; tail -1 /tmp/new.log | cut -c1-400 >> $S
(cd .device/prev && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 "${STEP[@]}" --json $OUT/prev.json "${B8[@]}") > /tmp/prev.log 2>&1
echo "prev rc $? at $((SECONDS-T0)) s" >> $S; tail -1 /tmp/prev.log | cut -c1-400 >> $S
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 170 python3 benchmarks/train_step.py --model k3-small --steps 5 \
  --profile /tmp/trace --hlo /tmp/step.hlo --json $OUT/profiled.json "${B8[@]}" > /tmp/prof.log 2>&1
echo "profiled rc $? at $((SECONDS-T0)) s" >> $S; tail -1 /tmp/prof.log | cut -c1-400 >> $S
timeout 60 python3 benchmarks/profile_summary.py /tmp/trace --top 60 --hlo /tmp/step.hlo > $OUT/profile_nocb.txt 2>&1
gzip -c /tmp/step.hlo > $OUT/step.hlo.gz
LEFT=$((580 - (SECONDS-T0)))
echo "train: $LEFT s left at $((SECONDS-T0)) s" >> $S
timeout $LEFT python3 -m train.cli --config configs/k3-small.yaml train.steps=100 logging.eval_every=50 \
  checkpoint.every=1000 run_dir=/tmp/run > /tmp/train.log 2>&1
echo "train rc $? at $((SECONDS-T0)) s" >> $S
grep -v "^WARNING" /tmp/train.log | tail -25 >> $S
cp /tmp/run/metrics.jsonl $OUT/ 2>/dev/null
