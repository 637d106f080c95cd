#!/usr/bin/env bash
# Run k3jax-train as N cooperating processes on this host (jax.distributed over 127.0.0.1).
#
#   launch/local.sh N --config configs/k3-tiny.yaml [key=value ...]
#
# Each process gets its share of the local GPUs through CUDA_VISIBLE_DEVICES (the GPU count
# must be a multiple of N). Without GPUs each process runs on K3_CPU_DEVICES fake CPU devices
# (default 1), which is how a multi-host mesh is rehearsed on a laptop.
#
# Environment:
#   K3_PORT          coordinator port (default: a free one)
#   K3_CPU_DEVICES   CPU devices per process when there is no GPU (default 1)
#   K3_LOG_DIR       where processes 1..N-1 write their output (default runs/launch-logs);
#                    process 0 prints to this terminal
#
# Ctrl-C / SIGTERM are forwarded to every process (k3jax-train checkpoints and exits); if one
# process fails the others are stopped, and the script exits with the first failure's status.
set -euo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
  exit 2
fi
N=$1
shift

port=${K3_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
log_dir=${K3_LOG_DIR:-runs/launch-logs}
mkdir -p "$log_dir"

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if (( gpus > 0 && gpus % N != 0 )); then
  echo "local.sh: $gpus GPUs do not split evenly over $N processes" >&2
  exit 2
fi

pids=()
stop() {
  # children of a non-interactive shell ignore SIGINT, so TERM is what reaches them
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
}
signalled=0
trap 'signalled=1; stop' INT TERM

for ((i = 0; i < N; i++)); do
  env_vars=()
  if (( gpus > 0 )); then
    per=$((gpus / N))
    env_vars+=("CUDA_VISIBLE_DEVICES=$(seq -s, $((i * per)) $((i * per + per - 1)))")
  else
    # XLA:CPU needs gloo for collectives across processes
    env_vars+=("JAX_PLATFORMS=cpu" "JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo"
               "XLA_FLAGS=${XLA_FLAGS:-} --xla_force_host_platform_device_count=${K3_CPU_DEVICES:-1}")
  fi
  cmd=(k3jax-train "$@" "distributed.coordinator=127.0.0.1:$port"
       "distributed.num_processes=$N" "distributed.process_id=$i")
  if (( i == 0 )); then
    env "${env_vars[@]}" "${cmd[@]}" &
  else
    env "${env_vars[@]}" "${cmd[@]}" >"$log_dir/process_$i.log" 2>&1 &
  fi
  pids+=($!)
done
echo "local.sh: $N processes on 127.0.0.1:$port (logs of 1..$((N - 1)) in $log_dir)" >&2

status=0
set +e
while true; do
  wait -n  # a trapped signal also ends the wait (status > 128): counted as a failure
  rc=$?
  (( rc == 127 )) && break  # no children left
  if (( rc != 0 && status == 0 )); then
    status=$rc
    (( signalled )) || echo "local.sh: a process exited with status $rc; stopping the others" >&2
    stop
  fi
done
exit "$status"
