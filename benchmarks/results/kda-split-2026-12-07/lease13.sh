#!/bin/bash
# issue 43 (forward KDA), one call of ~9.5 minutes: kernel 1 split in two (Tuning.intra_split=1), the
# gate's in-chunk cumsum as kernels (cumsum_kernel=1) and the UT inverse's 16 x 16 blocks in
# registers (intra_inverse=2), beside the defaults: kda_op forward rows at the three shapes,
# fwd+bwd for the defaults and the split + cumsum form, GPU correctness against float64
# (kda_check --quick --tune), per-kernel profiles at 8x4096, then fla's safe gate in its own slot.
# lease12.sh (2026-12-07) with its logs packed into one tarball after each step: the device tool
# returns at most 8 files from $OUT.
T0=$(date +%s)
W=/tmp/w; mkdir -p $W
pack() { tar czf $OUT/logs.tgz -C $W . ; }
source benchmarks/env/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=name,uuid --format=csv,noheader >> $W/gpu.txt 2>&1
cat /etc/machine-id >> $W/gpu.txt 2>/dev/null
left() { echo $(( ${LIMIT:-585} - ($(date +%s) - T0) )); }
SHAPES=8x4096x16x128,2x16384x16x128,1x65536x16x128
s=$(date +%s)
timeout -s INT 200 python3 -m benchmarks.ops.kda_op --shapes $SHAPES --impl pallas --passes fwd \
  --tune ";cumsum_kernel=1;intra_split=1,cumsum_kernel=1;intra_inverse=2,cumsum_kernel=1;intra_split=1,intra_inverse=2,cumsum_kernel=1" \
  --json $OUT/op_fwd.json > $W/op_fwd.log 2>&1
echo "op_fwd rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt; pack
s=$(date +%s)
timeout -s INT 90 python3 -m benchmarks.checks.kda_check --quick --no-xla \
  --tune ";intra_split=1,cumsum_kernel=1;intra_inverse=2;intra_split=1,intra_inverse=2" --json $OUT/check.json > $W/check.log 2>&1
echo "check rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt; pack
s=$(date +%s)
timeout -s INT 60 python3 -m benchmarks.ops.kda_op --shapes 8x4096x16x128 --impl pallas --passes fwd \
  --tune ";intra_split=1,cumsum_kernel=1;intra_split=1,intra_inverse=2,cumsum_kernel=1" --profile /tmp/prof --json $W/op_prof.json > $W/op_prof.log 2>&1
echo "prof rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt; pack
tar czf $OUT/prof.tgz -C /tmp prof; pack
L=$(left)
if [ $L -gt 150 ]; then
  s=$(date +%s)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT $(( L > 250 ? 240 : L - 5 )) python3 .device/fla_kda_op.py --variants safe --json $OUT/fla_op.json > $W/fla_op.log 2>&1
  echo "fla rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt; pack
fi
s=$(date +%s)
L=$(left); [ $L -gt 30 ] && timeout -s INT $(( L - 5 )) python3 -m benchmarks.ops.kda_op --shapes $SHAPES --impl pallas --passes fwd+bwd \
  --tune ";intra_split=1,cumsum_kernel=1" --json $OUT/op_bwd.json > $W/op_bwd.log 2>&1
echo "op_bwd rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt; pack
echo "total wall=$(( $(date +%s)-T0 ))" >> $OUT/plan.txt; pack
