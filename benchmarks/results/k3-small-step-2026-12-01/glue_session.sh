#!/usr/bin/env bash
# Issue 23, the glue round (AttnRes kernels, norm backward): one command on one H200, at most
# ~9.5 minutes, every output under $OUT.
#   OUT=out BASE=/path/to/baseline bash benchmarks/glue_session.sh
# BASE: a checkout of the code before this round (git -C /work/main archive 65cb849 | tar -x -C .base),
# whose k3-small step runs in the same lease. In order of what the round needs most (each step
# skipped when the time left would not cover its limit):
#   1. one AttnRes site at k3-small's shapes: the old autodiff form, the new XLA form and the
#      kernels, forward and forward+backward, n = 1..4 valid blocks; the kernels checked against
#      the XLA form on the GPU (attnres_op.py)
#   2. k3-small 8 x 4096 AdamW step, this checkout's GPU defaults (AttnRes kernels): tokens/s,
#      step ms; its compiled HLO read by glue_regions.py (kernels and bytes per source region)
#   3. the baseline checkout's step (BASE set): the same-lease ratio
#   4. this checkout with model.attn_res_impl=xla (the new XLA form: the kernels' share)
#   5. the kernels' launch settings (attnres_op.py --sweep)
source "$(dirname "$0")/gpu_env.sh"
R="$OUT/glue"  # everything lands here, then one archive (a lease brings back few files)
mkdir -p "$R"
BUDGET=${BUDGET:-570}
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
fits() {  # fits SECONDS WHAT: enough time left for a step with that limit, else a line in skipped.log
  [[ $(left) -ge $1 ]] || { echo "skipped ($1 s needed, $(left) s left): $2" | tee -a "$R/small.log"; return 1; }
}
STEP=(benchmarks/train_step.py --model k3-small --steps 8)
B8=(mesh.num_devices=1 train.batch_size=8)

if fits 60 "AttnRes site"; then
  timeout 120 python3 benchmarks/attnres_op.py --json "$R/attnres_op.json" 2>&1 | grep -v Warning \
    | tee "$R/attnres_op.log"
fi
if fits 200 "k3-small AdamW (AttnRes kernels)"; then
  timeout $(( $(left) < 240 ? $(left) : 240 )) python3 "${STEP[@]}" --hlo "$R/step_small.hlo" \
    --json "$R/k3jax_small_b8.json" "${B8[@]}" 2>&1 | tail -3 | tee -a "$R/small.log"
  if [[ -f "$R/step_small.hlo" ]]; then
    python3 benchmarks/glue_regions.py --from-hlo "$R/step_small.hlo" --out "$R/glue_regions.txt" > /dev/null 2>&1
    gzip -f "$R/step_small.hlo"
  fi
fi
if [[ -n ${BASE:-} ]] && fits 170 "baseline k3-small AdamW ($BASE)"; then
  out=$(realpath "$R")
  (cd "$BASE" && PYTHONPATH=/tmp/site:$PWD timeout $(( $(left) < 220 ? $(left) : 220 )) python3 \
    "${STEP[@]}" --json "$out/base_small_b8.json" "${B8[@]}") 2>&1 | tail -2 | tee -a "$R/small.log"
fi
if fits 170 "k3-small AdamW, model.attn_res_impl=xla"; then
  timeout $(( $(left) < 220 ? $(left) : 220 )) python3 "${STEP[@]}" --json "$R/k3jax_small_b8_xla.json" \
    "${B8[@]}" model.attn_res_impl=xla 2>&1 | tail -2 | tee -a "$R/small.log"
fi
if fits 60 "AttnRes kernel launch settings"; then
  timeout $(left) python3 benchmarks/attnres_op.py --sweep --iters 10 --json "$R/attnres_sweep.json" 2>&1 \
    | grep sweep | tee "$R/attnres_sweep.log"
fi
echo "session: $((SECONDS - T0)) s" | tee -a "$R/small.log"
tar -czf "$OUT/glue.tgz" -C "$OUT" glue && cp "$R"/small.log "$R"/attnres_op.log "$R"/glue_regions.txt "$OUT"/ 2>/dev/null
rm -rf "$R"
