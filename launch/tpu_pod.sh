#!/usr/bin/env bash
# k3jax-train on every worker of a Cloud TPU VM pod slice, at once.
#
#   launch/tpu_pod.sh TPU_NAME ZONE --config configs/k3.yaml mesh.fsdp=-1 mesh.expert=64 [key=value ...]
#
# Arguments after ZONE are passed to k3jax-train unchanged. JAX detects the pod (workers,
# coordinator, process ids) from the TPU VM metadata, so no distributed.* keys are needed.
# The repository and its environment must already be on every worker (same path), e.g.
#   gcloud compute tpus tpu-vm ssh NAME --zone Z --worker=all --command "git clone … && pip install -e …"
#
# Environment:
#   K3_TPU_DIR       the repository on the workers (default ~/k3jax)
#   K3_TPU_SETUP     shell run before training (default: source K3_TPU_DIR/venv/bin/activate if present)
#   K3_TPU_PROJECT   gcloud project (default: gcloud's configured one)
#   K3_TPU_LOG       per-worker log file on the workers (default K3_TPU_DIR/runs/tpu-worker.log)
#
# gcloud's ssh returns when every worker's command has. Ctrl-C only closes the ssh sessions; to
# stop the run itself (k3jax-train checkpoints on SIGTERM), run the same ssh with
#   --command "pkill -TERM -f k3jax-train"
set -euo pipefail

if [[ $# -lt 2 ]]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
  exit 2
fi
name=$1
zone=$2
shift 2

dir=${K3_TPU_DIR:-'~/k3jax'}
setup=${K3_TPU_SETUP:-"if [ -f venv/bin/activate ]; then source venv/bin/activate; fi"}
log=${K3_TPU_LOG:-runs/tpu-worker.log}

# quote every argument for the remote shell, so values with spaces or quotes arrive intact
printf -v train_args ' %q' "$@"
remote="set -o pipefail; cd $dir && $setup && mkdir -p \"\$(dirname $log)\" && k3jax-train$train_args 2>&1 | tee $log"

project=()
[[ -n ${K3_TPU_PROJECT:-} ]] && project=(--project "$K3_TPU_PROJECT")
exec gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" "${project[@]}" --worker=all --command "$remote"
