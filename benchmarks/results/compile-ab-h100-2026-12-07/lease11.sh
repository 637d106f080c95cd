#!/bin/bash
# session 12 (issue 42, compile <= 45 s): where XLA's part of the first compile goes, and what the
# autotuner and Triton GEMMs cost. k3-small unrolled, 8 x 4096 (on an H100: 2 micro-batches), each
# variant from its own empty compilation cache: compile_s, lower_s, step_ms, and XLA's per-pass split
# (benchmarks/tools/compile_passes.py over gpu_compiler's and hlo_pass_pipeline's VLOG lines).
T0=$(date +%s)
source benchmarks/env/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/gpu.txt 2>&1
MB=""; grep -q H100 $OUT/gpu.txt && MB="train.micro_batches=2"
mkdir -p $OUT/ab
run() {  # name, extra XLA flags, seconds
  s=$(date +%s)
  XLA_FLAGS="$2" TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1,hlo_pass_pipeline=1 JAX_COMPILATION_CACHE_DIR=/tmp/c-$1 \
    timeout -s INT $3 python3 -m benchmarks.step.train_step --model k3-small --steps 13 mesh.num_devices=1 \
    train.batch_size=8 $MB --json $OUT/ab/$1.json > $OUT/ab/$1.raw 2>&1
  echo "$1 rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/ab/plan.txt
  python3 -m benchmarks.tools.compile_passes $OUT/ab/$1.raw --top 40 > $OUT/ab/$1_passes.txt 2>&1
  grep -v "^[IWE][0-9]\{4\} " $OUT/ab/$1.raw > $OUT/ab/$1.log; rm -f $OUT/ab/$1.raw
  (cd $OUT && tar czf ab.tgz ab)
}
left() { echo $(( ${LIMIT:-590} - ($(date +%s) - T0) )); }
run default "" 185
run autotune0 "--xla_gpu_autotune_level=0" 185
L=$(left); [ $L -gt 120 ] && run no_triton_gemm "--xla_gpu_enable_triton_gemm=false" $(( L - 10 ))
echo "total wall=$(( $(date +%s)-T0 ))" >> $OUT/ab/plan.txt
(cd $OUT && tar czf ab.tgz ab && rm -rf ab)
