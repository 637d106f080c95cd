#!/usr/bin/env bash
# Issue 23: a compile-time variant of the k3-small step on an empty cache, then the KDA operator's
# six rows (BENCHMARKS.md §1) with fla's safe-gate path beside them. One command, at most ~9.5
# minutes, at most eight files under $OUT.
#   OUT=out bash benchmarks/op_compile_session.sh
#   COLD="name:override NAME=value;..." (default: XLA's Triton GEMM fusions off), each on its own
#   empty compilation cache, so its compile time is a first launch's
source "$(dirname "$0")/gpu_env.sh"
session_start 570
IFS=';' read -ra cs <<< "${COLD-notriton:XLA_FLAGS=--xla_gpu_enable_triton_gemm=false}"
for c in "${cs[@]}"; do
  read -ra ws <<< "${c#*:}"
  rm -rf "/tmp/cold-${c%%:*}"
  k3_small_step "${c%%:*}" "$PWD" JAX_COMPILATION_CACHE_DIR="/tmp/cold-${c%%:*}" "${ws[@]}"
done
timeout 170 python3 benchmarks/kda_op.py --profile /tmp/op_profiles --json "$OUT/k3jax_op.json" > /tmp/k3jax_op.log 2>&1
echo "k3jax op rc $? at $((SECONDS - T0)) s" >> "$S"
grep -v "^W\|^I0" /tmp/k3jax_op.log | tail -14 >> "$S"
tar -czf "$OUT/op_profiles.tgz" -C /tmp op_profiles 2>/dev/null
LEFT=$(( $(left) - 10 ))
echo "fla: $LEFT s left" >> "$S"
timeout $LEFT python3 .device/fla_kda_op.py --variants ${FLA_VARIANTS:-safe} --json "$OUT/fla_op.json" > /tmp/fla_op.log 2>&1
echo "fla op rc $? at $((SECONDS - T0)) s" >> "$S"
grep -v "Warning\|^W\|^I0" /tmp/fla_op.log | tail -12 >> "$S"
cat "$S"
