#!/bin/bash
# next session (issue 42, compile <= 45 s): where XLA's ~59 s of k3jax-train's compile go, and what
# the autotuner costs. k3-small unrolled, 8 x 4096 (the headline command; on an H100 add
# train.micro_batches=2), each variant from its own empty compilation cache: compile_s, lower_s,
# step_ms, and XLA's HLO-passes / backend split (gpu_compiler's VLOG). Step time must not suffer.
source benchmarks/env/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=name,uuid --format=csv,noheader > $OUT/gpu.txt 2>&1; cp $OUT/gpu.txt $OUT/lease.txt
MB=""; grep -q H100 $OUT/gpu.txt && MB="train.micro_batches=2"
run() {  # name, extra XLA flags
  s=$(date +%s)
  XLA_FLAGS="$2" TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1 JAX_COMPILATION_CACHE_DIR=/tmp/c-$1 \
    timeout -s INT 170 python3 -m benchmarks.step.train_step --model k3-small --steps 13 mesh.num_devices=1 \
    train.batch_size=8 $MB --json $OUT/$1.json > $OUT/$1.log 2>&1
  echo "$1 rc=$? wall=$(( $(date +%s)-s ))" >> $OUT/plan.txt
  grep -h "RunHloPasses\|RunBackend" $OUT/$1.log | sed 's/^.*\] //' > $OUT/$1_passes.txt
}
run default ""
run autotune0 "--xla_gpu_autotune_level=0"
run no_triton_gemm "--xla_gpu_enable_triton_gemm=false"
run both "--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false"
