"""Compare what two or more runs measured, and refuse what cannot be compared.

    python -m benchmarks.tools.compare_runs RUN_A RUN_B [RUN_C ...]              # run folders: losses per step
    python -m benchmarks.tools.compare_runs A.json B.json [--key step_ms]        # benchmark rows: a ratio
    python -m benchmarks.tools.compare_runs bench-out/NAME/NAME.json             # benchmarks/run.py's two sides
        [--allow-leases] [--allow-settings KEY,... | all]

Run folders: each run's metrics.jsonl (the last line per step wins, so a resumed run shows the
steps it re-trained), and their largest relative loss difference. Refused: a run with a loss
that is not finite, and runs whose config.yaml differ beyond their paths and logging (the
keys named) unless --allow-settings names them.

Benchmark rows (a --json file: one row or a list; or the runner's NAME.json, its "this" and
"base" sides): rows are paired in order and each pair's measured figures (`MEASURED`) given as
B / A. Refused, with one line saying why:
- a row written as failed (`status` "failed": losses not finite, benchmarks/bench_util.timing_row)
  or with a figure or a loss that is not finite: never comparable;
- rows from different leases (`lease`), or without one: two machines' timings differ by more
  than most changes measured (--allow-leases to compare anyway, and say so);
- rows whose `settings` differ (batch, remat, dtypes, gate, kernel paths, ...): --allow-settings
  names the keys that may differ (all: any).
Exit status 2 when refused, else 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

MEASURED = ("step_ms", "tokens_per_s", "mfu", "ms", "fwd_ms", "fwd_bwd_ms", "compile_s", "peak_gb")
RUN_PATH_KEYS = ("run_dir", "logging.", "checkpoint.", "train.steps")  # may differ between compared runs


class Refused(Exception):
    """Rows or runs that must not be compared: the message says why."""


# ------------------------------------------------------------------------------------------ rows


def load_rows(path: str) -> list[tuple[str, dict]]:
    """(label, row) of a rows file: one row, a list, or the runner's summary (both sides)."""
    data = json.loads(Path(path).read_text())
    name = Path(path).name
    if isinstance(data, dict) and "sides" in data:
        out = []
        for side in data["sides"]:
            rows = side["rows"] if isinstance(side["rows"], list) else [side["rows"]]
            out += [(f"{name}:{side['side']}[{i}]", r) for i, r in enumerate(rows)]
        return out
    rows = data if isinstance(data, list) else [data]
    return [(f"{name}[{i}]", r) for i, r in enumerate(rows)]


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return True  # not a number: nothing to vouch for


def vouch(label: str, row: dict) -> None:
    """Refused unless the row is a measurement: not failed, every loss and figure finite."""
    if row.get("status") == "failed":
        raise Refused(f"{label} was written as failed ({row.get('failure', 'no reason given')}): no timing to compare")
    bad = [i for i, v in enumerate(row.get("losses") or []) if not _finite(v)]
    if bad:
        raise Refused(f"{label} has {len(bad)} losses that are not finite (from step {bad[0]}): "
                      "its timing means nothing")
    if nan := [k for k in MEASURED + ("loss",) if k in row and not _finite(row[k])]:
        raise Refused(f"{label}: {', '.join(nan)} not finite")


def comparable(a: tuple[str, dict], b: tuple[str, dict], allow_leases: bool = False,
               allow_settings: tuple[str, ...] = ()) -> list[str]:
    """Raises Refused when rows a and b must not be compared; returns the notes of what was
    allowed to differ."""
    (la, ra), (lb, rb) = a, b
    vouch(la, ra)
    vouch(lb, rb)
    notes = []
    lease_a, lease_b = ra.get("lease"), rb.get("lease")
    if lease_a is None or lease_b is None or lease_a != lease_b:
        what = (f"{la if lease_a is None else lb} has no lease id" if None in (lease_a, lease_b)
                else f"{la} and {lb} come from different leases ({lease_a}, {lease_b})")
        if not allow_leases:
            raise Refused(f"{what}: timings of two machines; --allow-leases to compare anyway")
        notes.append(f"{what} (allowed)")
    sa, sb = ra.get("settings"), rb.get("settings")
    if sa is None or sb is None:
        what = f"{la if sa is None else lb} records no settings"
        if "all" not in allow_settings:
            raise Refused(f"{what}: cannot tell what it ran; --allow-settings all to compare anyway")
        notes.append(f"{what} (allowed)")
    else:
        differ = sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k))
        refused = [k for k in differ if k not in allow_settings and "all" not in allow_settings]
        if refused:
            detail = "; ".join(f"{k}: {sa.get(k)!r} vs {sb.get(k)!r}" for k in refused)
            raise Refused(f"{la} and {lb} ran other settings ({detail}); --allow-settings {','.join(refused)} "
                          "to compare anyway")
        notes += [f"{k} differs (allowed): {sa.get(k)!r} vs {sb.get(k)!r}" for k in differ]
    return notes


def compare_rows(paths: list[str], keys: tuple[str, ...], allow_leases: bool, allow_settings: tuple[str, ...]) -> list:
    """[(label A, label B, {key: (a, b, b / a)}, notes)] of the rows of paths (two files, or one
    runner summary with two sides)."""
    if len(paths) == 1:
        rows = load_rows(paths[0])
        a = [r for r in rows if ":this[" in r[0]]
        b = [r for r in rows if ":base[" in r[0]]
    elif len(paths) == 2:
        a, b = load_rows(paths[0]), load_rows(paths[1])
    else:
        raise Refused("rows compare two files (or one runner summary with its two sides)")
    if len(a) != len(b) or not a:
        raise Refused(f"{len(a)} rows against {len(b)}: pair them by hand")
    out = []
    for ra, rb in zip(a, b):
        notes = comparable(ra, rb, allow_leases, allow_settings)
        figures = {k: (ra[1][k], rb[1][k], rb[1][k] / ra[1][k]) for k in keys
                   if isinstance(ra[1].get(k), (int, float)) and isinstance(rb[1].get(k), (int, float)) and ra[1][k]}
        out.append((ra[0], rb[0], figures, notes))
    return out


# ------------------------------------------------------------------------------------------ run folders


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


def run_settings_differ(runs: list[str], allow_settings: tuple[str, ...]) -> list[str]:
    """Raises Refused when the runs' config.yaml differ beyond paths and logging (unless
    allowed); returns the notes of allowed differences."""
    from k3jax.config import load_config
    from k3jax.config.load import diff_configs

    paths = [Path(r) / "config.yaml" for r in runs]
    if not all(p.is_file() for p in paths):
        missing = next(p for p in paths if not p.is_file())
        if "all" in allow_settings:
            return [f"{missing} missing (allowed)"]
        raise Refused(f"{missing} does not exist: cannot tell what the run ran; --allow-settings all to compare anyway")
    cfgs = [load_config(p) for p in paths]
    notes = []
    for run, cfg in zip(runs[1:], cfgs[1:]):
        differ = [d for d in diff_configs(cfgs[0], cfg) if not d[0].startswith(RUN_PATH_KEYS)]
        refused = [d for d in differ if d[0] not in allow_settings and "all" not in allow_settings]
        if refused:
            detail = "; ".join(f"{k}: {a!r} vs {b!r}" for k, a, b in refused)
            raise Refused(f"{runs[0]} and {run} ran other settings ({detail}); --allow-settings "
                          f"{','.join(k for k, _, _ in refused)} to compare anyway")
        notes += [f"{run}: {k} differs (allowed): {a!r} vs {b!r}" for k, a, b in differ]
    return notes


def compare_run_folders(runs: list[str], allow_settings: tuple[str, ...]) -> None:
    table = [losses(r) for r in runs]
    for run, t in zip(runs, table):
        bad = sorted(s for s, v in t.items() if not math.isfinite(v))
        if bad:
            raise Refused(f"{run} has a loss that is not finite at step {bad[0]}: not comparable")
    for note in run_settings_differ(runs, allow_settings):
        print(f"note: {note}")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="run folders, or rows files (.json)")
    p.add_argument("--key", action="append", help=f"rows: the figures to compare (default {', '.join(MEASURED)})")
    p.add_argument("--allow-leases", action="store_true", help="rows: compare rows of different leases")
    p.add_argument("--allow-settings", default="", help="settings keys that may differ (comma-separated, or all)")
    a = p.parse_args(argv)
    allow = tuple(k for k in a.allow_settings.split(",") if k)
    try:
        if all(x.endswith(".json") for x in a.paths):
            for la, lb, figures, notes in compare_rows(a.paths, tuple(a.key or MEASURED), a.allow_leases, allow):
                print(f"{lb} / {la}:")
                for note in notes:
                    print(f"  note: {note}")
                for k, (x, y, ratio) in figures.items():
                    print(f"  {k:14s} {x:>12.4g} -> {y:>12.4g}  x{ratio:.3f}")
        else:
            compare_run_folders(a.paths, allow)
    except Refused as e:
        print(f"compare_runs: refused: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
