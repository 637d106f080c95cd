#!/bin/bash
# The short form of lease13.sh (the device budget left after refused starts): the forward rows of
# the defaults and the new kernel-1 forms at the three shapes, their GPU check against float64, then
# fla's safe gate with whatever time is left (it prints each row as it goes). FLA=0 leaves fla out
# (it autotunes for minutes: a slot too short for it is wasted), e.g. FLA=0 LIMIT=200.
# Logs go into one tarball after each step: the device tool returns at most 8 files from $OUT.
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
pack() { tar czf $OUT/logs.tgz -C $W . ; }
source benchmarks/env/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=name,uuid --format=csv,noheader >> $W/gpu.txt 2>&1
left() { echo $(( ${LIMIT:-280} - ($(date +%s) - T0) )); }
s=$(date +%s)
timeout -s INT 120 python3 -m benchmarks.ops.kda_op --shapes 8x4096x16x128,2x16384x16x128,1x65536x16x128 --impl pallas \
  --passes fwd --tune ";cumsum_kernel=1;intra_split=1,cumsum_kernel=1;intra_split=1,intra_inverse=2,cumsum_kernel=1" \
  --json $OUT/op_fwd.json > $W/op_fwd.log 2>&1
echo "op_fwd rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt; pack
s=$(date +%s)
timeout -s INT 60 python3 -m benchmarks.checks.kda_check --quick --no-xla \
  --tune ";intra_split=1,cumsum_kernel=1;intra_split=1,intra_inverse=2" --json $OUT/check.json > $W/check.log 2>&1
echo "check rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt; pack
L=$(left)
if [ "${FLA:-1}" != 0 ] && [ $L -gt 40 ]; then
  s=$(date +%s)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT $(( L - 3 )) python3 .device/fla_kda_op.py --variants safe --json $OUT/fla_op.json > $W/fla_op.log 2>&1
  echo "fla rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt; pack
fi
echo "total wall=$(( $(date +%s)-T0 ))" >> $OUT/plan.txt; pack
