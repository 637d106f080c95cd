"""k3jax-plot: loss curves of one or more runs to a PNG.

    k3jax-plot runs/softmax runs/kda runs/hybrid [-o lineage.png] [--metric loss] [--smooth 10]

Reads each run's metrics.jsonl; draws the training metric (smoothed), one point per logging
window (a resumed run's the same as an uninterrupted one's), and, where logged, the eval metric
as markers. The legend uses the run folder names.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is this a k3jax run folder?)")
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash
    return rows


def series(rows, key):
    """(steps, values) of `key`: the last line per step wins (a resumed run re-logs the steps after
    its checkpoint), and a line whose window a later line completes is left out (a launch's first
    step, a stop, the steps a resume joined: train/log_window.py), so a resumed run draws the same
    points as one that never stopped."""
    last = {r["step"]: r for r in rows if isinstance(r.get(key), (int, float))}
    kept, covered_after = [], float("inf")  # later lines average the steps after covered_after
    for step in sorted(last, reverse=True):
        if step > covered_after:
            continue
        kept.append(step)
        covered_after = min(covered_after, step - last[step].get("window_steps", 0))
    kept.reverse()
    return np.array(kept), np.array([last[s][key] for s in kept], dtype=float)


def smooth(y, window: int):
    if window <= 1 or len(y) < window:
        return y
    kernel = np.ones(window) / window
    head = np.cumsum(y[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(y, kernel, mode="valid")])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="k3jax-plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("-o", "--output", default="loss.png")
    p.add_argument("--metric", default="loss")
    p.add_argument("--smooth", type=int, default=1)
    p.add_argument("--log-y", action="store_true")
    a = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run in a.runs:
        try:
            rows = read_metrics(run)
        except FileNotFoundError as e:
            print(f"k3jax-plot: {e}", file=sys.stderr)
            return 2
        name = Path(run).name
        x, y = series(rows, a.metric)
        if len(x):
            (line,) = ax.plot(x, smooth(y, a.smooth), label=f"{name}")
            ex, ey = series(rows, f"eval_{a.metric}")
            if len(ex):
                ax.plot(ex, ey, "o", color=line.get_color(), label=f"{name} (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel(a.metric)
    if a.log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.output, dpi=120)
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
