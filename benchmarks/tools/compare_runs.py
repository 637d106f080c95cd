"""Per-step losses of several run folders side by side, and their largest relative difference.

    python -m benchmarks.tools.compare_runs RUN_A RUN_B [RUN_C ...]

Reads each run's metrics.jsonl (the last line per step wins, so a resumed run shows the
steps it re-trained).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def losses(run: str) -> dict[int, float]:
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"compare_runs: {path} does not exist (did that run start? see its log)")
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "step" in rec:
            out[int(rec["step"])] = float(rec["loss"])
    return out


def main(runs: list[str]) -> None:
    table = [losses(r) for r in runs]
    steps = sorted(set().union(*table))
    print("step  " + "  ".join(f"{Path(r).name:>14}" for r in runs))
    worst = 0.0
    for s in steps:
        vals = [t.get(s) for t in table]
        print(f"{s:4d}  " + "  ".join(f"{v:14.6f}" if v is not None else f"{'-':>14}" for v in vals))
        have = [v for v in vals if v is not None]
        if len(have) > 1:
            worst = max(worst, (max(have) - min(have)) / abs(have[0]))
    print(f"max relative loss difference across runs: {worst:.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
