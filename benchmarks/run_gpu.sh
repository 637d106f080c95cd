#!/usr/bin/env bash
# GPU benchmarks, k3jax and fla side by side in one command (see BENCHMARKS.md).
#   bash benchmarks/run_gpu.sh op|model|small|all     results under $OUT (default ./bench-out)
# Needs fla's wheels and scripts in .device/ (cp ../shared/wheels/*.whl ../shared/bench/*.py .device/).
source "$(dirname "$0")/gpu_env.sh"
what=${1:-all}
if [[ $what == op || $what == all ]]; then
  python3 .device/fla_kda_op.py --json "$OUT/fla_op.json" 2>&1 | grep -v Warning | tee "$OUT/fla_op.log"
  for s in 8x4096x16x128 2x16384x16x128 1x65536x16x128; do
    timeout 400 python3 benchmarks/kda_op.py --shapes $s --state-pass scan,associative --json "$OUT/k3jax_op_$s.json" 2>&1 | tee -a "$OUT/k3jax_op.log"
  done
fi
if [[ $what == model || $what == all ]]; then
  # save_dots keeps each layer's projection outputs; the KDA chunk internals are recomputed
  for remat in ${REMAT:-save_dots}; do
    timeout 240 python3 benchmarks/train_step.py --model fla-peer --profile "$OUT/trace_peer_$remat" \
      --json "$OUT/k3jax_fla_peer_$remat.json" model.remat=$remat 2>&1 | tail -2 | tee -a "$OUT/k3jax_model.log"
    python3 benchmarks/profile_summary.py "$OUT/trace_peer_$remat" --top 30 > "$OUT/profile_fla_peer_$remat.txt" 2>&1
    rm -rf "$OUT/trace_peer_$remat"
  done
  OUT=$OUT timeout 200 python3 .device/fla_model.py 2>&1 | grep -v Warning | tail -4 | tee "$OUT/fla_model.log"
fi
if [[ $what == small || $what == all ]]; then
  python3 benchmarks/grouped_matmul.py --json "$OUT/grouped_matmul.json" 2>&1 | tee "$OUT/grouped_matmul.log"
  for b in ${SMALL_BATCH:-2}; do  # 2 x 4096: ~75 GiB of temporaries + 17 GiB of state
    timeout 240 python3 benchmarks/train_step.py --model k3-small --steps 8 --profile "$OUT/trace_small_b$b" \
      --json "$OUT/k3jax_small_b$b.json" mesh.num_devices=1 train.batch_size=$b 2>&1 | tail -2 | tee -a "$OUT/k3jax_small.log"
    python3 benchmarks/profile_summary.py "$OUT/trace_small_b$b" --top 30 > "$OUT/profile_small_b$b.txt" 2>&1
    rm -rf "$OUT/trace_small_b$b"
  done
fi
