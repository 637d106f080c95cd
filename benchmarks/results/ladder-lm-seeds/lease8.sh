#!/bin/bash
# session 11, calls 2+: the seeded LM ladder (issue 44, plan (a)), resumed from the carried ladder.json
T0=$(date +%s)
source benchmarks/env/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=uuid --format=csv,noheader > $OUT/lease.txt 2>&1
mkdir -p $OUT/lm
cp .device/ladder.json $OUT/lm/ 2>/dev/null
left=$(( ${LADDER_LEFT:-570} - ($(date +%s) - T0) ))
timeout -s INT $left python3 -m train.ladder.cli --size h200 --seeds 0,1 --parallel 2 --out $OUT/lm --stop-after $(( left - 25 )) > $OUT/lm/cli.log 2>&1
echo "ladder rc=$? wall=$(( $(date +%s)-T0 ))" >> $OUT/plan.txt
(cd $OUT/lm && tar czf parts.tgz part*/cli.log && rm -rf part*)
