"""k3jax chunk_kda forward and forward+backward: time, compile time and memory, per path.

    python -m benchmarks.ops.kda_op [--shapes 8x4096x16x128,...] [--impl pallas,xla] [--tune 'warps_grad=4;...']
                                [--json out.json]

Inputs match ../shared/bench/fla_kda_op.py: bf16 q, v, beta; l2-normalised bf16 k; fp32 log-decay
g in (-0.1, 0). K3's gate bound (-5) is passed as `decay_bound`, as the layer does: the fused
kernels need it (fla's counterpart is `safe_gate=True, lower_bound=-5`). Each shape is BxTxHxD.
`--tune` lists kernel launch settings to try (`k3jax.ops.kda_kernels.Tuning`), ';'-separated.
Memory: `xla_gb` is XLA's own account of the compiled call (arguments + outputs + temporaries),
`peak_gb` the allocator's high-water mark of this shape: each shape runs in its own process
(JAX cannot reset the peak), so a shape's rows carry its own peak, not an earlier larger
shape's (until 2026-12 one process ran every shape and `peak_gb` repeated the running peak);
within a shape the fwd row is measured first, so the fwd+bwd row's peak is the shape's. Rows
carry `settings` (shape, path, tuning, pass, dtype, gate bound: what a comparison must share)
and `lease`. Run it in the same command as fla's script (benchmarks/env/run_gpu.sh does) so the
ratio is measured on one machine.

Roofline (`kda_roofline`; issue 43): on a chip k3jax.chips knows, each row carries the time the
chip's spec allows and `roofline_fraction`, that time over the measured one. The time is the
larger of the model FLOPs at the dense bf16 peak (`k3jax.flops.delta_rule_flops_per_token`, x3
for fwd+bwd, the MFU convention) and the fewest bytes the call must move at the HBM bandwidth:
its inputs read once (bf16 q, k, v, beta; fp32 g) and its outputs written once (bf16 o; for
fwd+bwd the gradients in the inputs' dtypes instead: the summed output need not be stored). Both
are floors, so a correct kernel stays below 1; `bound` names the larger term.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from benchmarks.bench_util import Rows, ms_per_call
from k3jax.chips import Chip, chip_for_device_kind
from k3jax.flops import delta_rule_flops_per_token
from k3jax.ops import chunk_kda
from k3jax.ops.kda_kernels import Tuning


def _forward(q, k, v, g, beta, *, chunk, impl, tuning, bound):
    return chunk_kda(q, k, v, g, beta, chunk_size=chunk, decay_bound=bound, impl=impl, tuning=tuning)[0]


def _profile(compiled, args, out_dir, tag):
    """Per-kernel ms per call over 3 calls (benchmarks/tools/profile_summary.py), into out_dir/tag.txt."""
    import contextlib
    import io
    import os
    import shutil
    import tempfile

    from benchmarks.tools.profile_summary import load, summarize

    trace = tempfile.mkdtemp()
    jax.block_until_ready(compiled(*args))
    jax.profiler.start_trace(trace, create_perfetto_trace=True)
    for _ in range(3):
        out = compiled(*args)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        summarize(load(trace), top=25, steps=3)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, tag + ".txt"), "w") as f:
        f.write(text.getvalue())
    shutil.rmtree(trace, ignore_errors=True)


def kda_roofline(B: int, T: int, H: int, K: int, V: int, chunk: int, what: str, chip: Chip) -> dict:
    """The fastest `what` ("fwd" or "fwd+bwd") of chunk_kda on [B, T, H, K|V] inputs that `chip`'s
    spec allows: {model_tflop, min_gb, roofline_ms, bound} (module docstring)."""
    tokens = B * T * H
    flops = tokens * delta_rule_flops_per_token(chunk, K, V) * (3 if what == "fwd+bwd" else 1)
    inputs = tokens * (2 * K + 2 * K + 2 * V + 4 * K + 2)  # q, k, v bf16; g fp32; beta bf16
    outputs = inputs if what == "fwd+bwd" else tokens * 2 * V  # the gradients, or o in bf16
    compute_s = flops / (chip.peak_bf16_tflops * 1e12)
    memory_s = (inputs + outputs) / (chip.hbm_tbps * 1e12)
    return {"model_tflop": flops / 1e12, "min_gb": (inputs + outputs) / 1e9,
            "roofline_ms": 1e3 * max(compute_s, memory_s), "bound": "compute" if compute_s > memory_s else "memory"}


def _gb(x):
    return None if x is None else round(x / 2**30, 3)


def _shape_in_child(shape: str, argv: list[str]) -> list[dict]:
    """This benchmark on one shape in a fresh process (its output passed through): its rows."""
    rest, skip = [], False
    for i, w in enumerate(argv):  # the caller's arguments without --shapes and --json
        if skip:
            skip = False
            continue
        if w in ("--shapes", "--json"):
            skip = True
            continue
        if not w.startswith(("--shapes=", "--json=")):
            rest.append(w)
    with tempfile.TemporaryDirectory(prefix="k3jax-kda-op-") as tmp:
        path = os.path.join(tmp, "rows.json")
        p = subprocess.run([sys.executable, "-m", "benchmarks.ops.kda_op", *rest, "--shapes", shape, "--json", path])
        if p.returncode or not os.path.exists(path):
            return [dict(shape=shape, status="failed", failure=f"its process exited {p.returncode}")]
        with open(path) as f:
            return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x4096x16x128,2x16384x16x128,1x65536x16x128")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--impl", default="pallas", help="comma list of pallas / xla")
    ap.add_argument("--tune", default="", help="';'-separated Tuning strings, e.g. 'state_block_v=32;warps_grad=4'")
    ap.add_argument("--bound", type=float, default=-5.0)
    ap.add_argument("--passes", default="fwd,fwd+bwd")
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", default=None, help="write a per-kernel time summary of each run to DIR/*.txt")
    args = ap.parse_args(argv)
    try:
        tunings = dict(zip(args.tune.split(";"), Tuning.parse_list(args.tune)))  # a typo refused before any timing
    except ValueError as e:
        ap.error(str(e))
    rows = Rows()
    shapes = args.shapes.split(",")
    if len(shapes) > 1:  # one process per shape: each row's peak is its own shape's
        for shape in shapes:
            rows.extend(_shape_in_child(shape, argv if argv is not None else sys.argv[1:]))
        rows.write(args.json)
        return
    chip = chip_for_device_kind(jax.devices()[0].device_kind)  # None on a CPU: no roofline
    for shape in shapes:
        B, T, H, D = map(int, shape.split("x"))
        ks = jax.random.split(jax.random.PRNGKey(0), 5)
        q = jax.random.normal(ks[0], (B, T, H, D), jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, T, H, D), jnp.float32)
        k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
        v = jax.random.normal(ks[2], (B, T, H, D), jnp.bfloat16)
        g = -0.1 * jax.random.uniform(ks[3], (B, T, H, D), jnp.float32)
        beta = jax.random.uniform(ks[4], (B, T, H), jnp.bfloat16)
        for impl in args.impl.split(","):
            for tune in (args.tune.split(";") if impl == "pallas" else [""]):
                fwd = functools.partial(_forward, chunk=args.chunk, impl=impl, tuning=tunings[tune],
                                        bound=args.bound)
                # value_and_grad: the forward runs too (jax.grad alone lets XLA drop the forward kernels,
                # whose output only feeds the sum), as in fla's fwd().sum().backward()
                grad = jax.value_and_grad(lambda *x, f=fwd: jnp.sum(f(*x).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))
                for name, fn in (("fwd", fwd), ("fwd+bwd", grad)):
                    if name not in args.passes.split(","):
                        continue
                    t0 = time.perf_counter()
                    compiled = jax.jit(fn).lower(q, k, v, g, beta).compile()
                    compile_s = time.perf_counter() - t0
                    dt = ms_per_call(compiled, q, k, v, g, beta, iters=args.iters) / 1e3
                    ma = compiled.memory_analysis()
                    xla_bytes = None if ma is None else (ma.argument_size_in_bytes + ma.output_size_in_bytes
                                                         + ma.temp_size_in_bytes)
                    stats = jax.devices()[0].memory_stats() or {}
                    settings = dict(shape=[B, T, H, D], impl=impl, tuning=tune or "default", what=name,
                                    dtype="bfloat16", chunk=args.chunk, gate_bound=args.bound,
                                    device=jax.devices()[0].device_kind)
                    roof = {} if chip is None else kda_roofline(B, T, H, D, D, args.chunk, name, chip)
                    if roof:
                        roof.update(roofline_fraction=round(roof["roofline_ms"] / (dt * 1e3), 4),
                                    model_tflops=round(roof["model_tflop"] / dt, 1))
                    rows.add(dict(impl=f"k3jax.chunk_kda[{impl}]", tuning=tune or "default", B=B, T=T, H=H,
                                  D=D, what=name, ms=round(dt * 1e3, 3), tokens_per_s=round(B * T / dt), **roof,
                                  compile_s=round(compile_s, 1), xla_gb=_gb(xla_bytes),
                                  peak_gb=_gb(stats.get("peak_bytes_in_use")), gate_bound=args.bound,
                                  settings=settings, process=os.getpid(), backend=jax.default_backend(),
                                  jax=jax.__version__))
                    if args.profile:
                        _profile(compiled, (q, k, v, g, beta), args.profile,
                                 f"{impl}_{shape}_{name}_{tune or 'default'}".replace("=", "-").replace(",", "_"))
    rows.write(args.json)


if __name__ == "__main__":
    main()
