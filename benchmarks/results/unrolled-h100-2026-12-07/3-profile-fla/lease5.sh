#!/bin/bash
# session 10, lease 3 (H100): the unrolled k3-small step profiled (issue 42); fla's safe-gate KDA in its own slot (issue 43)
source benchmarks/env/gpu_env.sh >/dev/null
s=$(date +%s)
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout -s INT 200 python3 -m benchmarks.step.train_step --model k3-small --steps 5 mesh.num_devices=1 train.batch_size=8 train.micro_batches=2 model.scan_layers=false --profile /tmp/prof --hlo /tmp/step.hlo --json $OUT/step_profiled.json > $OUT/profile.log 2>&1
echo "profile rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
python3 -m benchmarks.tools.profile_summary /tmp/prof --top 60 --steps 3 --hlo /tmp/step.hlo --ops-csv $OUT/ops.csv > $OUT/profile_unrolled.txt 2>&1
gzip -f $OUT/ops.csv; gzip -c /tmp/step.hlo > $OUT/step.hlo.gz
echo "summary rc=$?" >> $OUT/plan.txt
s=$(date +%s)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT 330 python3 .device/fla_kda_op.py --variants safe --json $OUT/fla_op.json > $OUT/fla_op.log 2>&1
echo "fla rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
