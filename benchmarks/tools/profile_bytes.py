"""A profile's kernels against the bytes each one moves: where the step is slower than HBM allows.

    python -m benchmarks.tools.profile_bytes ops.csv[.gz] step.hlo[.gz] [--top 40] [--gbs 4000]

ops.csv: `benchmarks/tools/profile_summary.py --ops-csv` (ms per step per HLO instruction); step.hlo:
the same run's optimized HLO (`benchmarks/step/train_step.py --hlo`). For every kernel XLA emitted
(`glue_regions.kernels`: fusions and custom kernels; matmuls listed apart), bytes read + written per launch
(`glue_regions.kernel_bytes`: an operand read through slices counts as its slices, a buffer
updated in place as its update), times launches per step, against the time measured. The floor
is those bytes at --gbs GB/s (4,000: what a large copy reaches on an H200, about 83 % of its 4.8
TB/s); "over" is measured minus floor, what a kernel at memory speed would save. Per source line
(`benchmarks/tools/hlo_sources.py`), largest "over" first. Custom kernels' bytes are an upper bound
(all operands and results once), so their floor is too.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io

from benchmarks.tools.glue_regions import kernels


def _read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def instruction_table(text: str) -> dict[str, dict]:
    """HLO instruction name -> {kind, bytes (one launch), source (2 frames)} for every kernel."""
    return {k.name: {"kind": k.kind, "bytes": k.read + k.written,
                     "source": " < ".join((k.source or "(no source)").split(" < ")[:2])} for k in kernels(text)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ops_csv")
    ap.add_argument("hlo")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--gbs", type=float, default=4000.0, help="the floor's bandwidth, GB/s")
    a = ap.parse_args()
    table = instruction_table(_read(a.hlo))
    rows = list(csv.DictReader(io.StringIO(_read(a.ops_csv))))
    by_src = collections.defaultdict(lambda: collections.Counter())
    by_kind = collections.Counter()
    unmatched = 0.0
    for r in rows:
        ms, launches = float(r["ms_per_step"]), float(r["launches_per_step"])
        info = table.get(r["hlo_op"])
        if info is None:  # a library kernel inside an instruction (cuBLAS, memcpy), or no HLO op
            unmatched += ms
            by_kind["(not an HLO kernel)"] += ms
            continue
        gb = info["bytes"] * launches / 1e9
        floor = gb / a.gbs * 1e3
        key = (info["kind"], info["source"])
        t = by_src[key]
        t["ms"] += ms
        t["gb"] += gb
        t["floor"] += floor
        t["launches"] += launches
        by_kind[info["kind"]] += ms
    total = sum(float(r["ms_per_step"]) for r in rows)
    print(f"{total:.1f} ms of kernels per step; by kind: " +
          ", ".join(f"{k} {v:.1f}" for k, v in by_kind.most_common()))
    print(f"{'ms':>8} {'floor':>7} {'over':>7} {'GB':>7} {'GB/s':>6} {'launch':>6}  kind     source")
    ranked = sorted(by_src.items(), key=lambda kv: -(kv[1]["ms"] - kv[1]["floor"]))
    for (kind, src), t in ranked[:a.top]:
        gbs = t["gb"] / (t["ms"] / 1e3) if t["ms"] else 0.0
        print(f"{t['ms']:8.2f} {t['floor']:7.2f} {t['ms'] - t['floor']:7.2f} {t['gb']:7.2f} {gbs:6.0f} "
              f"{t['launches']:6.0f}  {kind:8s} {src[:120]}")
    glue = [t for (kind, _), t in by_src.items() if kind == "glue"]
    print(f"glue: {sum(t['ms'] for t in glue):.1f} ms measured, {sum(t['floor'] for t in glue):.1f} ms at "
          f"{a.gbs:.0f} GB/s ({sum(t['gb'] for t in glue):.1f} GB)")


if __name__ == "__main__":
    main()
