"""What the benchmarks share: wall time per call, a profiler trace, a relative error, and
their result rows.

    from benchmarks.bench_util import Rows, ms_per_call, profiled, rel_err, shape_args
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np


def shape_args(ap: argparse.ArgumentParser, **defaults: int) -> None:
    """An integer flag per keyword, with its default (the shapes a benchmark runs at):
    shape_args(ap, batch=8, top_k=8) adds --batch and --top-k."""
    for name, default in defaults.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def ms_per_call(fn, *args, iters: int = 10, warmup: int = 2) -> float:
    """Mean wall milliseconds of fn(*args) over `iters` back-to-back calls, after `warmup` calls
    (the first compiles), timed to the last call's result being ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3


def profiled(fn, *args, trace_dir: str | None, calls: int = 3):
    """`calls` calls of fn (compiled and warm) under a jax.profiler trace in trace_dir (nothing
    when it is None); read it with benchmarks/tools/profile_summary.py trace_dir --steps calls."""
    if not trace_dir:
        return
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)


def rel_err(a, b) -> float:
    """max |a - b| / max |b|, in fp32."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))


class Rows(list):
    """A benchmark's result rows: each printed as one JSON line when added (a run killed by its
    time limit still shows the rows it measured), all written to --json as one list at the end
    (what benchmarks/run.py collects, with the tree's commit)."""

    def add(self, row: dict) -> dict:
        self.append(row)
        print(json.dumps(row), flush=True)
        return row

    def write(self, path: str | None) -> None:
        """The rows as one JSON list in `path` (nothing when it is None)."""
        if path:
            with open(path, "w") as f:
                json.dump(self, f, indent=1)
