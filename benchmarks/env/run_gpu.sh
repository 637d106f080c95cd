#!/usr/bin/env bash
# GPU benchmarks, k3jax and fla side by side in one command (see BENCHMARKS.md).
#   bash benchmarks/env/run_gpu.sh op|model|kernels|small|recipe|all     results under $OUT (default ./bench-out)
#   bash benchmarks/env/run_gpu.sh ladder      the lineage ladder's LM table (k3jax-ladder --size h200; not in `all`)
#   bash benchmarks/env/run_gpu.sh alike       DeltaNet / gated DeltaNet kernels with alike keys vs float64 (not in `all`)
# Needs fla's wheels and scripts in .device/ (cp ../shared/wheels/*.whl ../shared/bench/*.py .device/).
source "$(dirname "$0")/gpu_env.sh"
what=${1:-all}
if [[ $what == op || $what == all ]]; then
  # the fused kernels (IMPL=pallas,xla adds the plain-XLA form: slow to compile), then fla's two paths
  timeout 300 python3 -m benchmarks.ops.kda_op --impl ${IMPL:-pallas} --profile "$OUT/op_profiles" \
    --json "$OUT/k3jax_op.json" 2>&1 | tee "$OUT/k3jax_op.log"
  timeout 450 python3 .device/fla_kda_op.py --variants safe,default --json "$OUT/fla_op.json" 2>&1 \
    | grep -v Warning | tee "$OUT/fla_op.log"
fi
if [[ $what == model || $what == all ]]; then
  # like for like: K3's bounded gate against fla's safe gate. remat=none does not fit (168 GiB);
  # save_dots (no kernel or matmul recomputed, as fla recomputes none) plans at 33.4 GB and full
  # at 10.9 (k3jax-plan, benchmarks/results/k3-plan-2026-12-03/fla_peer_h200_*.txt); full was
  # the only one measured until 2026-12-03
  for remat in ${REMAT:-save_dots full}; do
    timeout 240 python3 -m benchmarks.step.train_step --model fla-peer --profile "$OUT/trace_peer_$remat" \
      --json "$OUT/k3jax_fla_peer_$remat.json" model.kda.gate=lower_bound model.remat=$remat 2>&1 | tail -2 \
      | tee -a "$OUT/k3jax_model.log"
    python3 -m benchmarks.tools.profile_summary "$OUT/trace_peer_$remat" --top 30 > "$OUT/profile_fla_peer_$remat.txt" 2>&1
    rm -rf "$OUT/trace_peer_$remat"
  done
  # fla autotunes its kernels for minutes on the first call: its own slot
  OUT=$OUT timeout ${FLA_TIMEOUT:-450} python3 .device/fla_model.py ${FLA_VARIANTS:-safe} 2>&1 | grep -v Warning | tail -4 \
    | tee "$OUT/fla_model.log"
fi
if [[ $what == kernels || $what == all ]]; then
  # k3-small's other hot operators, each against its alternative and checked against a reference
  python3 -c "from k3jax.config import load_config; from k3jax.kernel_paths import kernel_lines; \
print(*kernel_lines(load_config('configs/k3-small.yaml').model), sep='\n')" 2>&1 | tee "$OUT/kernels.log"
  timeout 200 python3 -m benchmarks.ops.attention --json "$OUT/attention.json" 2>&1 | grep -v Warning \
    | tee -a "$OUT/kernels.log"
  timeout 200 python3 -m benchmarks.ops.grouped_matmul --tokens 32768 --json "$OUT/grouped_matmul.json" 2>&1 \
    | grep -v Warning | tee -a "$OUT/kernels.log"
  # tokamax's grouped-GEMM kernels per launch config and k3jax's kernel path against fp32 (the
  # weight gradient at tokamax's own fallback config is wrong on an H200: BENCHMARKS.md §3)
  timeout 240 python3 -m benchmarks.checks.gmm_check --json "$OUT/gmm_check.json" > "$OUT/gmm_check.log" 2>&1
  grep -v "^WARNING" "$OUT/gmm_check.log" | grep routing | tee -a "$OUT/kernels.log"
fi
if [[ $what == small || $what == all ]]; then
  first=1
  for b in ${SMALL_BATCH:-2}; do
    # the planner's figure for the same step, compiled here (on the GPU), beside the measured peak
    timeout 200 python3 -m train.plan.cli --config configs/k3-small.yaml --devices 1 --batch $b --json train.micro_batches=1 \
      > "$OUT/plan_small_b$b.json" 2>&1
    prof=(); [[ $first == 1 && -z ${NO_PROFILE:-} ]] && prof=(--profile "$OUT/trace_small_b$b")
    timeout 300 python3 -m benchmarks.step.train_step --model k3-small --steps 8 "${prof[@]}" \
      --json "$OUT/k3jax_small_b$b.json" mesh.num_devices=1 train.batch_size=$b ${SMALL_ARGS:-} 2>&1 | tail -2 \
      | tee -a "$OUT/k3jax_small.log"
    if [[ ${#prof[@]} -gt 0 ]]; then
      python3 -m benchmarks.tools.profile_summary "$OUT/trace_small_b$b" --top 40 > "$OUT/profile_small_b$b.txt" 2>&1
      rm -rf "$OUT/trace_small_b$b"
    fi
    first=0
  done
fi
if [[ $what == recipe || $what == all ]]; then
  # what each switch of K3's training recipe costs per step (k3-small, one batch size)
  b=${RECIPE_BATCH:-2}
  for sw in "" "model.qat=mxfp4" "optimizer.name=muon optimizer.muon_per_head=true" "optimizer.qk_clip_tau=100"; do
    timeout 200 python3 -m benchmarks.step.train_step --model k3-small --steps 6 mesh.num_devices=1 \
      train.batch_size=$b $sw 2>&1 | tail -1 | sed "s|^|{\"switch\": \"$sw\"} |" | tee -a "$OUT/recipe.log"
  done
fi
if [[ $what == alike ]]; then
  # the inputs that sent the ladder's DeltaNet rung to NaN (keys sharing a direction, no decay),
  # through the compiled kernels with the H200's TF32/bf16 products
  timeout 300 python3 -m benchmarks.checks.kda_check --alike --json "$OUT/kda_alike.json" 2>&1 | grep -v Warning \
    | tee "$OUT/kda_alike.log"
fi
if [[ $what == ladder ]]; then
  # every rung of the lineage on language modelling, ladder.json / ladder.md / plots written after
  # each rung; a second call with the same --out resumes where a time limit stopped it
  # (--stop-after: no run starts that would likely end past it, so the timeout never cuts one)
  timeout ${LADDER_TIMEOUT:-570} python3 -m train.ladder.cli --size h200 --out "$OUT/ladder-h200" \
    --stop-after ${LADDER_STOP_AFTER:-420} ${LADDER_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/ladder-h200.log"
fi
