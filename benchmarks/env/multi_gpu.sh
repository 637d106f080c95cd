#!/usr/bin/env bash
# Expert parallelism on the N GPUs of one host (BENCHMARKS.md, "Several GPUs").
#   bash benchmarks/env/multi_gpu.sh throughput|equivalence|all     results under $OUT (default ./bench-out)
# throughput:  k3-small train step with mesh.expert=N and with pure data parallelism (mesh.data=N):
#              tokens/s, MFU, peak memory per GPU, and a profile (MoE all-to-all time).
# equivalence: the same 6 steps on 1 GPU and on N GPUs (expert=N); the N-GPU checkpoint of
#              step 3 restored on 1 GPU runs steps 4-6; losses compared by compare_runs.py.
# Needs grain & co. in .device/ (cp ../shared/wheels/*.whl .device/).
source "$(dirname "$0")/gpu_env.sh"
N=${N:-$(nvidia-smi -L | wc -l)}
what=${1:-all}
nvidia-smi topo -m >> "$OUT/gpu.txt" 2>&1
PER_GPU_BATCH=${PER_GPU_BATCH:-1}  # one 4096-token row per GPU: ~44 GiB of temporaries (BENCHMARKS.md, section 4)
if [[ $what == throughput || $what == all ]]; then
  for par in "ep mesh.data=1 mesh.expert=$N" "dp mesh.data=$N"; do
    set -- $par; name=$1; shift
    timeout 280 python3 -m benchmarks.step.train_step --model k3-small --steps 8 --profile "$OUT/trace_$name" \
      --json "$OUT/small_${name}${N}.json" train.batch_size=$((PER_GPU_BATCH * N)) "$@" 2>&1 | tail -2 | tee "$OUT/small_$name.log"
    python3 -m benchmarks.tools.profile_summary "$OUT/trace_$name" --top 30 > "$OUT/profile_$name.txt" 2>&1
    rm -rf "$OUT/trace_$name"
  done
fi
if [[ $what == equivalence || $what == all ]]; then
  common=(--config configs/k3-small.yaml data.seq_len=1024 train.batch_size=8 train.micro_batches=1 train.steps=6 logging.every=1
          logging.eval_every=0 checkpoint.every=3 checkpoint.keep_last=4 model.moe.ep_capacity_factor=$N)
  timeout 200 python3 -m train "${common[@]}" run_dir="$OUT/run_1gpu" mesh.num_devices=1 > "$OUT/run_1gpu.log" 2>&1
  timeout 200 python3 -m train "${common[@]}" run_dir="$OUT/run_${N}gpu" mesh.data=1 mesh.expert=$N > "$OUT/run_${N}gpu.log" 2>&1
  # restore the N-GPU checkpoint of step 3 on one GPU and train steps 4-6 there
  cp -r "$OUT/run_${N}gpu" "$OUT/run_${N}to1" && rm -rf "$OUT/run_${N}to1/checkpoints/6"
  timeout 200 python3 -m train "${common[@]}" run_dir="$OUT/run_${N}to1" mesh.num_devices=1 > "$OUT/run_${N}to1.log" 2>&1
  python3 -m benchmarks.tools.compare_runs "$OUT/run_1gpu" "$OUT/run_${N}gpu" "$OUT/run_${N}to1" | tee "$OUT/equivalence.txt"
  rm -rf "$OUT"/run_*/checkpoints
fi
