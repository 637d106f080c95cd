#!/usr/bin/env bash
# Issue 23 (k3-small on one H200): one command, at most ~9.5 minutes, every output under $OUT.
#   OUT=out bash benchmarks/speed_session.sh                 # this checkout
#   OUT=out BASE=/path/to/baseline bash benchmarks/speed_session.sh   # + the baseline's step, same lease
# What runs, in order of what the issue needs most (each step is skipped when the time left
# would not cover its limit):
#   1. k3-small 8 x 4096, one micro-batch, GPU defaults (AdamW): tokens/s, step ms, compile s;
#      a 3-step profile and the compiled HLO, summarised by kernel and by source line
#   2. the same step with per-head Muon (optimizer.name=muon optimizer.muon_per_head=true):
#      the goal is <= 1.05 x step 1's ms
#   3. the baseline checkout's step 1 (BASE set), for the ratio in one lease
#   4. the optimizer update alone: AdamW, per-head Muon before the issue-23 Newton-Schulz round and now
#      (bf16), and the orthogonalisation alone before and now (its TFLOP/s)
source "$(dirname "$0")/gpu_env.sh"
BUDGET=${BUDGET:-570}
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
fits() {  # fits SECONDS WHAT: enough time left for a step with that limit, else a line in skipped.log
  [[ $(left) -ge $1 ]] || { echo "skipped ($1 s needed, $(left) s left): $2" | tee -a "$OUT/skipped.log"; return 1; }
}
STEP=(benchmarks/train_step.py --model k3-small --steps 8)  # options; the config overrides go last
B8=(mesh.num_devices=1 train.batch_size=8)

if fits 200 "k3-small AdamW"; then
  timeout $(( $(left) < 260 ? $(left) : 260 )) python3 "${STEP[@]}" --profile "$OUT/trace_small" \
    --hlo "$OUT/step_small.hlo" --json "$OUT/k3jax_small_b8.json" "${B8[@]}" 2>&1 | tail -3 | tee -a "$OUT/small.log"
  if [[ -d "$OUT/trace_small" ]]; then
    python3 benchmarks/profile_summary.py "$OUT/trace_small" --top 45 --hlo "$OUT/step_small.hlo" \
      > "$OUT/profile_small_b8.txt" 2>&1
    rm -rf "$OUT/trace_small"
  fi
  [[ -f "$OUT/step_small.hlo" ]] && gzip -f "$OUT/step_small.hlo"
fi
if fits 170 "k3-small per-head Muon"; then
  timeout $(( $(left) < 220 ? $(left) : 220 )) python3 "${STEP[@]}" --json "$OUT/k3jax_small_b8_muon_head.json" \
    "${B8[@]}" optimizer.name=muon optimizer.muon_per_head=true 2>&1 | tail -2 | tee -a "$OUT/small.log"
fi
if [[ -n ${BASE:-} ]] && fits 170 "baseline k3-small AdamW ($BASE)"; then
  out=$(realpath "$OUT")
  (cd "$BASE" && PYTHONPATH=/tmp/site:$PWD timeout $(( $(left) < 220 ? $(left) : 220 )) python3 \
    "${STEP[@]}" --json "$out/base_small_b8.json" "${B8[@]}") 2>&1 | tail -2 | tee -a "$OUT/small.log"
fi
if fits 60 "optimizer update alone"; then
  timeout $(left) python3 benchmarks/optimizer_step.py --variants adamw,muon_head_before,muon_head --ns --iters 5 \
    --json "$OUT/optimizer.json" 2>&1 | grep -v Warning | tee "$OUT/optimizer.log"
fi
echo "session: $((SECONDS - T0)) s" | tee -a "$OUT/small.log"
