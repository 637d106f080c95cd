#!/usr/bin/env bash
# Issue 23: where the default k3-small step's time goes, kernel by kernel, then the other steps the
# issue's goals name, as far as the time allows. One command, at most BUDGET s (default 480), at
# most eight files under $OUT.
#   OUT=out BUDGET=480 bash benchmarks/profile_steps_session.sh
#   1. the k3-small step (8 x 4096, defaults), command buffers off, 5 steps with 3 profiled:
#      profile_nocb.txt (by kernel and by source line), ops.csv.gz (every HLO instruction's kernels,
#      ms/step; with step.hlo.gz it gives each kernel's bytes: benchmarks/glue_regions.py helpers)
#   2. the fla-shaped step (fla's KDA-340M shape, K3's bounded gate, remat=full; its peer is
#      .device/fla_model.py, not run here: it autotunes for minutes)
#   3. k3-small with per-head Muon, command buffers off like 1. (the goal: at most 1.05x the AdamW step)
source "$(dirname "$0")/gpu_env.sh"
session_start 480
profile_default_step 220 ops
run_step() {  # name model overrides...
  local name=$1 model=$2; shift 2
  if [[ $(left) -lt 90 ]]; then echo "skipped $name ($(left) s left)" >> "$S"; return; fi
  timeout $(( $(left) < 170 ? $(left) : 170 )) python3 benchmarks/train_step.py --model "$model" --steps 10 \
    --json "$OUT/step_$name.json" "$@" > "/tmp/step_$name.log" 2>&1
  echo "$name rc $? at $((SECONDS - T0)) s" >> "$S"
  step_headline "$name"
}
run_step fla_peer fla-peer model.kda.gate=lower_bound model.remat=full
XLA_FLAGS=--xla_gpu_enable_command_buffer= run_step muon_head k3-small mesh.num_devices=1 train.batch_size=8 optimizer.name=muon optimizer.muon_per_head=true
head -60 "$OUT/profile_nocb.txt" >> "$S"
cat "$S"
