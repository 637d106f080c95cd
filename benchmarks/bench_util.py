"""What the benchmarks share: wall time per call, a profiler trace, a relative error, their
result rows, the lease they ran in and the settings a comparison must match.

    from benchmarks.bench_util import Rows, ms_per_call, profiled, rel_err, shape_args
    from benchmarks.bench_util import lease_id, run_settings, timing_row

Every row `Rows.add` keeps carries `lease` (this machine's lease: `lease_id`), so a
comparison can tell rows of one lease from rows of two. A row that times a training step
carries `settings` (`run_settings`: batch, micro-batches, remat, dtypes, gate, kernel paths,
optimizer, mesh, device) and its losses, and goes through `timing_row`: if a loss is not
finite the row is written as failed, {"status": "failed", "failure": why, ...} with its
settings and losses and its measurements moved under "discarded", never as a timing
(benchmarks/tools/compare_runs.py refuses it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import socket
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


def lease_id() -> str:
    """This machine's lease: $K3JAX_LEASE_ID when set, else a digest of the host name, the
    kernel's boot id and the start time of process 1 (a fresh machine or container has a new
    one; every command of one lease sees the same)."""
    if os.environ.get("K3JAX_LEASE_ID"):
        return os.environ["K3JAX_LEASE_ID"]
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/1/stat"):
        try:
            text = open(path).read().strip()
        except OSError:
            text = ""
        parts.append(text.split()[21] if path.endswith("stat") and len(text.split()) > 21 else text)
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def run_settings(cfg, devices: int = 1, device: str | None = None) -> dict:
    """What a step's timing depends on besides the code: the settings two compared rows must
    share (benchmarks/tools/compare_runs.py)."""
    from k3jax.kernel_paths import kernel_lines

    m = cfg.model
    return {"batch": [cfg.train.batch_size, cfg.data.seq_len], "micro_batches": cfg.train.micro_batches,
            "remat": m.remat, "param_dtype": m.param_dtype, "compute_dtype": m.compute_dtype, "gate": m.kda.gate,
            "kernels": kernel_lines(m), "optimizer": cfg.optimizer.name, "devices": devices,
            "device": device or jax.devices()[0].device_kind}


def all_finite(values) -> bool:
    return all(v is not None and math.isfinite(float(v)) for v in values)


def timing_row(row: dict, losses, measured: tuple[str, ...]) -> dict:
    """row with status "timed" when every loss is finite; else a failed row: status "failed",
    why, the row's other fields, and the `measured` fields (its timings: they mean nothing
    when the routing saw NaN) under "discarded"."""
    losses = [float(v) for v in losses]
    row = dict(row, losses=losses)
    if all_finite(losses):
        return dict(row, status="timed")
    bad = [i for i, v in enumerate(losses) if not math.isfinite(v)]
    failed = {k: v for k, v in row.items() if k not in measured}
    return dict(failed, status="failed", failure=f"{len(bad)} of {len(losses)} losses not finite (from step {bad[0]})",
                discarded={k: row[k] for k in measured if k in row})


class Rows(list):
    """A benchmark's result rows: each printed as one JSON line when added (a run killed by its
    time limit still shows the rows it measured), all written to --json as one list at the end
    (what benchmarks/run.py collects, with the tree's commit). Each row gets this machine's
    `lease` when it has none."""

    def add(self, row: dict) -> dict:
        row.setdefault("lease", lease_id())
        self.append(row)
        print(json.dumps(row), flush=True)
        return row

    def write(self, path: str | None) -> None:
        """The rows as one JSON list in `path` (nothing when it is None)."""
        if path:
            with open(path, "w") as f:
                json.dump(self, f, indent=1)
