#!/usr/bin/env bash
# The one command behind BENCHMARKS.md's train-step and several-GPU figures, on an
# nvidia-h200-x2 machine, packed into the device tool's 10-minute limit: independent
# one-GPU jobs run side by side (CUDA_VISIBLE_DEVICES), and each phase has a deadline.
#   OUT=dir bash benchmarks/h200x2_session.sh
source "$(dirname "$0")/gpu_env.sh"
T0=$SECONDS; left() { echo $(( ${BUDGET:-585} - (SECONDS - T0) )); }
RUNS=/tmp/runs; rm -rf $RUNS; mkdir -p $RUNS
# equivalence runs: correctness, not speed, so no GEMM autotuning (compile time)
eq=(--config configs/k3-small.yaml data.seq_len=1024 train.batch_size=8 train.micro_batches=1 train.steps=6 logging.every=1
    logging.eval_every=0 checkpoint.every=3 checkpoint.keep_last=4 model.moe.ep_capacity_factor=2)
EQ_FLAGS="--xla_gpu_autotune_level=0"
log() { grep -v "^W1\|^WARNING\|Warning\|%|" "$1" | tail -${2:-3} | cut -c1-400 > "$1.tail"; rm -f "$1"; }
# phase 1: GPU0 k3jax fla-peer train step; GPU1 the 6 equivalence steps on one GPU
(CUDA_VISIBLE_DEVICES=0 timeout 210 python3 benchmarks/train_step.py --model fla-peer --steps 6 --profile $RUNS/trace_peer \
   --json "$OUT/k3jax_fla_peer.json" model.remat=full > "$OUT/peer.log" 2>&1;
 python3 benchmarks/profile_summary.py $RUNS/trace_peer --top 30 > "$OUT/profile_fla_peer.txt" 2>&1; log "$OUT/peer.log") &
(CUDA_VISIBLE_DEVICES=1 XLA_FLAGS=$EQ_FLAGS timeout 200 python3 -m train "${eq[@]}" run_dir=$RUNS/run_1gpu > "$OUT/run_1gpu.log" 2>&1;
 log "$OUT/run_1gpu.log") &
wait
# phase 2: the same steps with experts split over both GPUs (saves step 3 and 6)
XLA_FLAGS=$EQ_FLAGS timeout 120 python3 -m train "${eq[@]}" run_dir=$RUNS/run_2gpu mesh.data=1 mesh.expert=2 > "$OUT/run_2gpu.log" 2>&1
log "$OUT/run_2gpu.log"
# phase 3: GPU0 restores the 2-GPU step-3 checkpoint and trains 4-6; GPU1 fla's PyTorch model
cp -r $RUNS/run_2gpu $RUNS/run_2to1 && rm -rf $RUNS/run_2to1/checkpoints/6
(CUDA_VISIBLE_DEVICES=0 XLA_FLAGS=$EQ_FLAGS timeout 110 python3 -m train "${eq[@]}" run_dir=$RUNS/run_2to1 > "$OUT/run_2to1.log" 2>&1;
 log "$OUT/run_2to1.log") &
(CUDA_VISIBLE_DEVICES=1 OUT=$OUT timeout 110 python3 .device/fla_model.py 2>&1 | grep -v Warning | tail -3 > "$OUT/fla_model.log") &
wait
for r in run_1gpu run_2gpu run_2to1; do cp $RUNS/$r/metrics.jsonl "$OUT/$r.metrics.jsonl" 2>/dev/null; done
python3 benchmarks/compare_runs.py $RUNS/run_1gpu $RUNS/run_2gpu $RUNS/run_2to1 > "$OUT/equivalence.txt" 2>&1
# phase 4: k3-small at 4096 tokens/row, 1 row per GPU: experts split (expert=2), then pure data parallel
for par in "ep mesh.data=1 mesh.expert=2" "dp mesh.data=2"; do
  set -- $par; name=$1; shift
  t=$(left); (( t > 40 )) || break
  timeout $t python3 benchmarks/train_step.py --model k3-small --steps 6 --profile $RUNS/trace_$name \
    --json "$OUT/small_${name}2.json" train.batch_size=2 "$@" > "$OUT/small_$name.log" 2>&1
  python3 benchmarks/profile_summary.py $RUNS/trace_$name --top 30 > "$OUT/profile_small_$name.txt" 2>&1
  log "$OUT/small_$name.log"
done
echo "session took $((SECONDS - T0)) s"
