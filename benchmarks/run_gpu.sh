#!/usr/bin/env bash
# GPU benchmarks, k3jax and fla side by side in one command (see BENCHMARKS.md).
#   bash benchmarks/run_gpu.sh op|model|small|all     results under $OUT (default ./bench-out)
# Needs fla's wheels and scripts in .device/ (cp ../shared/wheels/*.whl ../shared/bench/*.py .device/).
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
if [[ $what == op || $what == all ]]; then
  python3 .device/fla_kda_op.py --json "$OUT/fla_op.json" 2>&1 | grep -v Warning | tee "$OUT/fla_op.log"
  for s in 8x4096x16x128 2x16384x16x128 1x65536x16x128; do
    timeout 400 python3 benchmarks/kda_op.py --shapes $s --json "$OUT/k3jax_op_$s.json" 2>&1 | tee -a "$OUT/k3jax_op.log"
  done
fi
if [[ $what == model || $what == all ]]; then
  timeout 500 python3 benchmarks/train_step.py --model fla-peer --profile "$OUT/trace" --json "$OUT/k3jax_fla_peer.json" 2>&1 | tail -3 | tee "$OUT/k3jax_model.log"
  python3 benchmarks/profile_summary.py "$OUT/trace" --top 25 | tee "$OUT/profile_fla_peer.txt"
  OUT=$OUT timeout 400 python3 .device/fla_model.py 2>&1 | grep -v Warning | tail -4 | tee "$OUT/fla_model.log"
fi
if [[ $what == small || $what == all ]]; then
  timeout 500 python3 benchmarks/train_step.py --model k3-small --profile "$OUT/trace_small" --json "$OUT/k3jax_small.json" 2>&1 | tail -3 | tee "$OUT/k3jax_small.log"
  python3 benchmarks/profile_summary.py "$OUT/trace_small" --top 25 | tee "$OUT/profile_small.txt"
fi
