#!/usr/bin/env bash
# GPU benchmarks, k3jax and fla side by side in one command (see BENCHMARKS.md).
#   bash benchmarks/run_gpu.sh op|model|small|all     results under $OUT (default ./bench-out)
# Needs fla's wheels and scripts in .device/ (cp ../shared/wheels/*.whl ../shared/bench/*.py .device/).
source "$(dirname "$0")/gpu_env.sh"
what=${1:-all}
if [[ $what == op || $what == all ]]; then
  # the fused kernels (IMPL=pallas,xla adds the plain-XLA form: slow to compile), then fla's two paths
  timeout 300 python3 benchmarks/kda_op.py --impl ${IMPL:-pallas} --profile "$OUT/op_profiles" \
    --json "$OUT/k3jax_op.json" 2>&1 | tee "$OUT/k3jax_op.log"
  timeout 450 python3 .device/fla_kda_op.py --variants safe,default --json "$OUT/fla_op.json" 2>&1 \
    | grep -v Warning | tee "$OUT/fla_op.log"
fi
if [[ $what == model || $what == all ]]; then
  # like for like: K3's bounded gate against fla's safe gate; remat=full is what fits (none: 168 GiB)
  for remat in ${REMAT:-full}; do
    timeout 240 python3 benchmarks/train_step.py --model fla-peer --profile "$OUT/trace_peer_$remat" \
      --json "$OUT/k3jax_fla_peer_$remat.json" model.kda.gate=lower_bound model.remat=$remat 2>&1 | tail -2 \
      | tee -a "$OUT/k3jax_model.log"
    python3 benchmarks/profile_summary.py "$OUT/trace_peer_$remat" --top 30 > "$OUT/profile_fla_peer_$remat.txt" 2>&1
    rm -rf "$OUT/trace_peer_$remat"
  done
  # fla autotunes its kernels for minutes on the first call: its own slot
  OUT=$OUT timeout 450 python3 .device/fla_model.py ${FLA_VARIANTS:-safe} 2>&1 | grep -v Warning | tail -4 \
    | tee "$OUT/fla_model.log"
fi
if [[ $what == small || $what == all ]]; then
  python3 benchmarks/grouped_matmul.py --json "$OUT/grouped_matmul.json" 2>&1 | tee "$OUT/grouped_matmul.log"
  for b in ${SMALL_BATCH:-2}; do  # 2 x 4096: ~75 GiB of temporaries + 17 GiB of state
    # the planner's figure for the same step, compiled here (on the GPU), beside the measured peak
    python3 -m k3jax.plan --config configs/k3-small.yaml --devices 1 --batch $b --json > "$OUT/plan_small_b$b.json" 2>&1
    timeout 240 python3 benchmarks/train_step.py --model k3-small --steps 8 --profile "$OUT/trace_small_b$b" \
      --json "$OUT/k3jax_small_b$b.json" mesh.num_devices=1 train.batch_size=$b 2>&1 | tail -2 | tee -a "$OUT/k3jax_small.log"
    python3 benchmarks/profile_summary.py "$OUT/trace_small_b$b" --top 30 > "$OUT/profile_small_b$b.txt" 2>&1
    rm -rf "$OUT/trace_small_b$b"
  done
fi
