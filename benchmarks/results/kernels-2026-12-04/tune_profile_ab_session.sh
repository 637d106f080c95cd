#!/usr/bin/env bash
# Issue 23, one lease (~9.5 minutes), at most eight files back under $OUT:
#   1. ab_session.sh (AB_S seconds): this checkout's k3-small step against .device/prev's
#   2. the default k3-small step profiled (profile_nocb.txt, ops.csv.gz, step.hlo.gz:
#      benchmarks/profile_bytes.py reads the last two)
#   3. with the time left, the KDA operator's fwd+bwd at 8 x 4096 x 16 for each of $KDA_TUNE
#      (';'-separated k3jax.ops.kda_kernels.Tuning strings; kda_tune.log)
#   OUT=out KDA_TUNE=";score_split_k=2" bash benchmarks/tune_profile_ab_session.sh
source "$(dirname "$0")/gpu_env.sh"
session_start 560
BUDGET=${AB_S:-290} CONV_S=0 bash "$(dirname "$0")/ab_session.sh" > /tmp/ab_console.txt 2>&1
profile_default_step ${PROFILE_S:-150} ops
echo "kda_op with $(left) s left" >> "$S"
timeout $(( $(left) - 10 )) python3 benchmarks/kda_op.py --shapes 8x4096x16x128 --passes fwd+bwd \
  --tune "${KDA_TUNE:-}" > "$OUT/kda_tune.log" 2>&1
echo "kda_op rc $? at $((SECONDS - T0)) s" >> "$S"
(cd "$OUT" && tar czf extra.tgz gpu.txt step_profiled.json && rm -f gpu.txt step_profiled.json)
cat "$S"
