"""k3jax chunk_kda forward and forward+backward time, compile time and peak memory.

    python benchmarks/kda_op.py [--shapes 8x4096x16x128,2x16384x16x128,1x65536x16x128] [--json out.json]

Inputs match ../shared/bench/fla_kda_op.py: bf16 q, v, beta; l2-normalised bf16 k; fp32 log-decay
g in (-0.1, 0). Each shape is BxTxHxD. Run it in the same command as fla's script
(benchmarks/run_gpu.sh does) so the ratio is measured on one machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp

from k3jax.ops import chunk_kda


def _timeit(fn, *args, warmup=2, iters=10):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters


def _forward(q, k, v, g, beta, *, chunk, state_pass):
    return chunk_kda(q, k, v, g, beta, chunk_size=chunk, state_pass=state_pass)[0]


def _peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x4096x16x128,2x16384x16x128,1x65536x16x128")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--state-pass", default="auto", help="comma list of scan / associative / auto")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        B, T, H, D = map(int, shape.split("x"))
        ks = jax.random.split(jax.random.PRNGKey(0), 5)
        q = jax.random.normal(ks[0], (B, T, H, D), jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, T, H, D), jnp.float32)
        k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
        v = jax.random.normal(ks[2], (B, T, H, D), jnp.bfloat16)
        g = -0.1 * jax.random.uniform(ks[3], (B, T, H, D), jnp.float32)
        beta = jax.random.uniform(ks[4], (B, T, H), jnp.bfloat16)
        for state_pass in args.state_pass.split(","):
            fwd = functools.partial(_forward, chunk=args.chunk, state_pass=state_pass)
            grad = jax.grad(lambda *x, f=fwd: jnp.sum(f(*x).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))
            for name, fn in (("fwd", fwd), ("fwd+bwd", grad)):
                t0 = time.perf_counter()
                compiled = jax.jit(fn).lower(q, k, v, g, beta).compile()
                compile_s = time.perf_counter() - t0
                dt = _timeit(compiled, q, k, v, g, beta, iters=args.iters)
                peak = _peak_bytes()
                rows.append(dict(impl=f"k3jax.chunk_kda[{state_pass}]", B=B, T=T, H=H, D=D, what=name,
                                 ms=round(dt * 1e3, 3), tokens_per_s=round(B * T / dt),
                                 compile_s=round(compile_s, 1),
                                 peak_gb=None if peak is None else round(peak / 2**30, 2),
                                 backend=jax.default_backend()))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
