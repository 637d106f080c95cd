#!/usr/bin/env bash
# A new user's first minutes on one GPU (issue 26): k3-small on a fresh machine, launched twice,
# stdout to a file (not a terminal), as under nohup or a scheduler.
#   OUT=out bash benchmarks/first_hour.sh [first|second|both|check]   (needs .device/ as run_gpu.sh)
# first:  an empty compilation cache (/tmp/k3jax-first-hour-cache, as on a new user's machine),
#         k3-small with its defaults (no kernel tuning: tokamax's heuristic configs), STEPS steps
#         with an eval every 10; the start lines carry their seconds since launch, so summary.txt
#         shows where the time to the first step went (expected: steps within about 300 s)
# second: the same config in a new run_dir: the steps come from the compilation cache (fast)
# check:  train/kernel_tuning.py against the installed tokamax (seconds; tunes a small op)
# One call of `first` fits in 10 minutes; `both` may not (run `second` in a later call).
source "$(dirname "$0")/gpu_env.sh"
what=${1:-first}
RUN=/tmp/k3jax-first-hour
export JAX_COMPILATION_CACHE_DIR=/tmp/k3jax-first-hour-cache  # its own: `first` empties it
# checkpoint only at the end: each is ~18 GB (fp32 weights + AdamW moments)
common=(train.steps=${STEPS:-30} logging.every=5 logging.eval_every=10 checkpoint.every=1000 ${EXTRA:-})
stamp='(\[ *[0-9.]+ s\] )?'  # a start line's seconds since launch
launch() {  # name, run_dir, timeout
  local t0=$SECONDS
  timeout -k 20 "$3" python3 -m train --config configs/k3-small.yaml "${common[@]}" run_dir="$2" > "$OUT/$1.log" 2>&1
  local rc=$?
  {
    echo "$1: rc=$rc, wall $((SECONDS - t0)) s"
    echo "  absl cache-miss lines: $(grep -c 'Autotuning cache miss' "$OUT/$1.log")"
    echo "  carriage returns (bar redraws): $(tr -cd '\r' < "$OUT/$1.log" | wc -c)"
    echo "  first step done at: $(grep -o '"first_step_s": [0-9.]*' "$2/metrics.jsonl" 2>/dev/null | cut -d' ' -f2) s after launch"
    grep -E "^${stamp}(starting|train state|eval:|tuning|tuned|tokamax:|compil)" "$OUT/$1.log" | cut -c1-260 | sed 's/^/  /'
    grep -E "^${stamp}step [0-9]+(/| ?: eval)" "$OUT/$1.log" | sed 's/^/  /'
    grep -E '^Traceback|Error' "$OUT/$1.log" | tail -3 | sed 's/^/  /'
  } | tee -a "$OUT/summary.txt"
  cp "$2/metrics.jsonl" "$OUT/$1_metrics.jsonl" 2>/dev/null
  cp "$2/config.yaml" "$OUT/$1_config.yaml" 2>/dev/null
  rm -rf "$2/checkpoints"  # the disk holds two of them, barely
}
if [[ $what == check ]]; then
  timeout 90 python3 benchmarks/kernel_tuning_check.py > "$OUT/kernel_tuning_check.log" 2>&1
  echo "kernel_tuning_check: rc=$?" | tee -a "$OUT/summary.txt"
  grep -E '^(ok|FAIL)' "$OUT/kernel_tuning_check.log" | sed 's/^/  /' | tee -a "$OUT/summary.txt"
fi
if [[ $what == first || $what == both ]]; then
  rm -rf "$RUN-1" "$JAX_COMPILATION_CACHE_DIR"
  launch first_launch "$RUN-1" "${FIRST_TIMEOUT:-420}"
fi
if [[ $what == second || $what == both ]]; then
  rm -rf "$RUN-2"
  launch second_launch "$RUN-2" "${SECOND_TIMEOUT:-240}"
fi
ls -laR "$JAX_COMPILATION_CACHE_DIR/tokamax" > "$OUT/tokamax_cache.txt" 2>&1
cp "$JAX_COMPILATION_CACHE_DIR"/tokamax/*/*.json "$OUT/" 2>/dev/null
du -sh "$JAX_COMPILATION_CACHE_DIR" >> "$OUT/tokamax_cache.txt" 2>&1
