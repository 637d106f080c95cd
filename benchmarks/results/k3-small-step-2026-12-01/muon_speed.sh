#!/usr/bin/env bash
# The per-head Muon update of k3-small on one GPU, Newton-Schulz before the issue-23 round
# (benchmarks/muon_before.py) and now (train/muon.py), with AdamW's update, in one process;
# then the orthogonalisation alone, before and now, and a 3-update profile of each Muon form.
# About 2-3 minutes on one H200:
#   OUT=results-dir bash benchmarks/muon_speed.sh [optimizer_step.py options or config overrides]
# Writes $OUT/optimizer.json, optimizer.log, profile_muon_head_before.txt, profile_muon_head.txt.
source "$(dirname "$0")/gpu_env.sh"
timeout 420 python3 benchmarks/optimizer_step.py --variants adamw,muon_head_before,muon_head --ns --iters 10 \
  --profile "$OUT/trace" --json "$OUT/optimizer.json" "$@" 2>&1 | grep -v Warning | tee "$OUT/optimizer.log"
for v in muon_head_before muon_head; do
  [[ -d $OUT/trace/$v ]] && python3 benchmarks/profile_summary.py "$OUT/trace/$v" --top 30 > "$OUT/profile_$v.txt" 2>&1
done
rm -rf "$OUT/trace"
