"""benchmarks/tools/profile_summary.py on a hand-made trace: time per kernel, the collectives
column, and --hlo's source lines (the command as a lease runs it, `python -m ...`)."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.tools.hlo_sources import hlo_sources
from k3jax.ops.matmul_f32 import matmul_f32_out

ROOT = Path(__file__).resolve().parents[1]


def test_profile_summary_counts_kernels_collectives_and_sources(tmp_path):
    x, w = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 4), jnp.bfloat16)
    hlo = jax.jit(matmul_f32_out).lower(x, w).compile().as_text()
    (tmp_path / "step.hlo").write_text(hlo)
    ours = {op: src for op, src in hlo_sources(hlo).items() if "k3jax/ops/matmul_f32.py" in src}
    assert ours, "the compiled matmul names no instruction from k3jax/ops/matmul_f32.py"
    op = sorted(ours)[0]
    gpu, host = 7, 9
    events = [{"ph": "M", "name": "process_name", "pid": gpu, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": host, "args": {"name": "/host:CPU"}},
              {"ph": "M", "name": "thread_name", "pid": gpu, "tid": 1, "args": {"name": "Stream #14"}}]
    # two steps: per step the grouped GEMM 3 ms (not a collective, though its name has "ragged"),
    # an NCCL all-gather 1 ms, the matmul's fusion 0.5 ms; a host event that must not count
    for step in range(2):
        t0 = step * 10_000
        events += [
            {"ph": "X", "pid": gpu, "tid": 1, "ts": t0, "dur": 3000, "name": "ragged_dot_sm90_mosaic_gpu_kernel"},
            {"ph": "X", "pid": gpu, "tid": 1, "ts": t0 + 3000, "dur": 1000, "name": "ncclDevKernel_AllGather_RING"},
            {"ph": "X", "pid": gpu, "tid": 1, "ts": t0 + 4000, "dur": 500, "name": op, "args": {"hlo_op": op}},
            {"ph": "X", "pid": host, "tid": 2, "ts": t0, "dur": 9000, "name": "PjitFunction"}]
    trace = tmp_path / "trace" / "plugins" / "profile" / "run"
    trace.mkdir(parents=True)
    with gzip.open(trace / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = subprocess.run([sys.executable, "-m", "benchmarks.tools.profile_summary", str(tmp_path / "trace"),
                          "--steps", "2", "--hlo", str(tmp_path / "step.hlo"), "--ops-csv", str(tmp_path / "ops.csv")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    kernel_ms = {l.split()[-1]: float(l.split()[0]) for l in lines[1:4]}
    assert kernel_ms == {"ragged_dot_sm90_mosaic_gpu_kernel": 3.0, "ncclDevKernel_AllGather_RING": 1.0,
                         op.rsplit(".", 1)[0] if op.rsplit(".", 1)[-1].isdigit() else op: 0.5}
    # the track's busy time is the three kernels (4.5 ms a step); of it collectives only the NCCL 1 ms
    track = next(l for l in lines if l.endswith("Stream #14"))
    assert [float(v) for v in track.split()[:2]] == [4.5, 1.0]
    src = next(l for l in lines if "k3jax/ops/matmul_f32.py" in l)
    assert float(src.split()[0]) == 0.5
    rows = (tmp_path / "ops.csv").read_text().splitlines()
    assert any(r.startswith(f"{op},{op},0.5000,1,k3jax/ops/matmul_f32.py") for r in rows), rows
