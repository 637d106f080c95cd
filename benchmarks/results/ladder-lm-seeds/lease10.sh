#!/bin/bash
# session 12: the seeded LM ladder (issue 44, plan (a)), resumed from the carried ladder.json
T0=$(date +%s)
source benchmarks/env/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/gpu.txt 2>&1; cp $OUT/gpu.txt $OUT/lease.txt
(while true; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >> $OUT/util.csv; sleep 10; done) &
UTIL=$!
mkdir -p $OUT/lm
cp .device/ladder.json $OUT/lm/ 2>/dev/null
left=$(( ${LADDER_LEFT:-570} - ($(date +%s) - T0) ))
timeout -s INT $left python3 -m train.ladder.cli --size h200 --seeds ${SEEDS:-0,1} --parallel ${PAR:-4} --out $OUT/lm --stop-after $(( left - 25 )) > $OUT/lm/cli.log 2>&1
rc=$?; kill $UTIL 2>/dev/null
echo "ladder rc=$rc wall=$(( $(date +%s)-T0 ))" >> $OUT/plan.txt
(cd $OUT/lm && tar czf parts.tgz part*/cli.log && rm -rf part*)
