#!/usr/bin/env bash
# MQAR at Zoology's setting, several rungs at once on one GPU: one k3jax-ladder process per
# argument (a comma-separated list of rungs), each resuming its own copy of this folder's
# ladder.json into $OUT/p<i>, all started together and waited for. The models are tiny (4 layers,
# width 128/256, 64 x 256 tokens a step: ~16 ms a step alone, bound by kernel launches), so the
# GPU sits mostly idle under one process. The returned ledgers are merged here afterwards with
# `k3jax-ladder --merge $OUT/p*/ladder.json --out <this folder>`.
#   usage (repository root, .device/ carried): bash benchmarks/results/ladder-zoology-2026-12-06/parallel.sh softmax_conv kda hybrid mla
source benchmarks/env/gpu_env.sh >/dev/null
R=benchmarks/results/ladder-zoology-2026-12-06
LIMIT=${LIMIT:-540} STOP=${STOP:-420}
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.15  # four processes share the card
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 > "$OUT/util.csv" 2>&1 &
smi=$!
i=0; pids=()
for rungs in "$@"; do
  d=$OUT/p$i; mkdir -p "$d"; cp $R/ladder.json "$d/"
  timeout -s INT "$LIMIT" python3 -m train.ladder.cli --size zoology --rungs "$rungs" --set data.num_workers=4 \
    --out "$d" --stop-after "$STOP" > "$d/cli.log" 2>&1 &
  pids+=($!); i=$((i + 1))
done
for p in "${pids[@]}"; do wait "$p"; echo "process $p: rc $?" >> "$OUT/rc.txt"; done
kill $smi
# at most 8 files come back: one archive of the ledgers and logs
(cd "$OUT" && tar czf mqar-parts.tgz p[0-9]*/ladder.json p[0-9]*/ladder.log p[0-9]*/cli.log util.csv rc.txt && rm -rf p[0-9]* util.csv)
