#!/usr/bin/env bash
# Call C (2026-12-06, the same warm H100, 290 s limit): what call A's time cut, k3jax-generate at
# --batch 8 on call A's step-300 checkpoint (still in /dev/shm), then four of issue 48's GPU
# checks in the time left. Outputs: generate_b8.log here, the checks in ../checks-h100-2026-12-06/.
source benchmarks/env/gpu_env.sh >/dev/null
ls /dev/shm/after/checkpoints > $OUT/summary.txt 2>&1
timeout 110 python3 -m train.generate /dev/shm/after --prompt "import " --max-new-tokens 256 --batch 8 > $OUT/generate_b8.log 2>&1
echo "gen8 rc $? at $SECONDS" >> $OUT/summary.txt
python3 -m benchmarks.checks.all --out $OUT/checks --budget-s $((270 - SECONDS)) --only decode_kernels,attention,short_conv,kda >> $OUT/summary.txt 2>&1
echo "checks rc $? at $SECONDS" >> $OUT/summary.txt
