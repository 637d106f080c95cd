# Sourced by the GPU scripts (run_gpu.sh, multi_gpu.sh, h200x2_session.sh): output folder,
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

# The GPU session scripts' shared pieces (ab_session.sh, norm_profile_train_session.sh,
# profile_steps_session.sh): a clock against a budget, a summary file, a step's headline, and the
# default k3-small step profiled.
session_start() {  # default budget in s; BUDGET overrides it
  OUT=$(realpath "$OUT"); BUDGET=${BUDGET:-$1}; T0=$SECONDS; S=$OUT/summary.txt
}
left() { echo $((BUDGET - (SECONDS - T0))); }
step_headline() {  # name: its step JSON's figures into the summary, else its log's last lines
  python3 -c "import json; d = json.load(open('$OUT/step_$1.json')); print({k: d[k] for k in
    ('step_ms', 'tokens_per_s', 'mfu', 'compile_s', 'peak_gb', 'loss')})" >> "$S" 2>&1 || tail -3 "/tmp/step_$1.log" >> "$S"
}
k3_small_step() {  # name dir words...: the k3-small step (8 x 4096, one micro-batch, 13 timed steps)
  # of the tree in dir, into $OUT/step_NAME.json and a headline in the summary. Words are overrides,
  # or NAME=value words set in the step's environment (XLA_FLAGS=...: train/xla_flags.py adds only the
  # flags it does not name). Skipped with under 100 s left; at most STEP_TIMEOUT (160) s.
  local name=$1 dir=$2; shift 2
  local envs=() ovs=() w cap=${STEP_TIMEOUT:-160}
  for w in "$@"; do if [[ $w =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$w"); else ovs+=("$w"); fi; done
  if [[ $(left) -lt 100 ]]; then echo "skipped $name ($(left) s left)" >> "$S"; return; fi
  (cd "$dir" && env PYTHONPATH=/tmp/site:$PWD "${envs[@]}" timeout $(( $(left) < cap ? $(left) : cap )) \
    python3 benchmarks/train_step.py --model k3-small --steps 13 --json "$OUT/step_$name.json" \
    mesh.num_devices=1 train.batch_size=8 "${ovs[@]}") > "/tmp/step_$name.log" 2>&1
  echo "$name rc $? at $((SECONDS - T0)) s" >> "$S"
  step_headline "$name"
}
profile_default_step() {  # timeout_s [ops]: k3-small 8 x 4096, command buffers off, 5 steps (3 traced);
  # profile_nocb.txt and step.hlo.gz under $OUT (with "ops": ops.csv.gz, every HLO instruction's time)
  local ops=()
  [[ ${2:-} == ops ]] && ops=(--ops-csv /tmp/ops.csv)
  XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$1" python3 benchmarks/train_step.py --model k3-small \
    --steps 5 --profile /tmp/trace --hlo /tmp/step.hlo --json "$OUT/step_profiled.json" mesh.num_devices=1 \
    train.batch_size=8 > /tmp/prof.log 2>&1
  echo "profiled step rc $? at $((SECONDS - T0)) s" >> "$S"
  timeout 60 python3 benchmarks/profile_summary.py /tmp/trace --top 80 --hlo /tmp/step.hlo "${ops[@]}" \
    > "$OUT/profile_nocb.txt" 2>&1
  [[ ${#ops[@]} -gt 0 ]] && gzip -c /tmp/ops.csv > "$OUT/ops.csv.gz"
  gzip -c /tmp/step.hlo > "$OUT/step.hlo.gz"
}
