# Sourced by the GPU scripts (run_gpu.sh, multi_gpu.sh): output folder,
# fla's wheels from .device/ (fla, grain & co.), the environment, and what machine this is.
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/*.whl 2>&1 | tail -1
# tokamax 0.0.17 imports xprof.cli.tools (for its own benchmarking only) from xprof >= 2.23.1;
# the newest wheel we can carry is 2.22.1, which lacks it: give that one import a stub
if [[ -d /tmp/site/xprof && ! -e /tmp/site/xprof/cli/tools.py ]]; then
  mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/cli/__init__.py
  printf 'def get_kernel_stats_tool(*a, **k):\n    raise NotImplementedError("xprof stub")\n' > /tmp/site/xprof/cli/tools.py
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/k3jax-jax-cache
# JAX preallocates 75 % of GPU memory by default; k3-small wants more of it
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
# A lease's A/B of two trees and the k3-small step the session scripts timed are
# `python3 benchmarks/run.py [--base-tree DIR] k3_small_step ...` (benchmarks/README.md).
