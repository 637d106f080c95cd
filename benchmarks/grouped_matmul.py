"""Expert grouped matmuls at k3-small's per-GPU shape: ragged_dot vs the padded-block form.

    python benchmarks/grouped_matmul.py [--tokens 32768] [--experts 64] [--top-k 8] [--json out.json]

Times the routed-expert MLP (w1, w3, GLU, w2; bf16, fp32 output) forward+backward with each
`k3jax.ops.grouped_matmul` impl, and the peak memory each needs. Routing is uniform random,
which is what Quantile Balancing aims for.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp

from k3jax.ops.grouped_matmul import grouped_glu_mlp


def expert_mlp(x, w1, w3, w2, sizes, *, impl, block):
    return grouped_glu_mlp(x, w1, w3, w2, sizes, lambda a, b: jax.nn.silu(a) * b, compute_dtype=jnp.bfloat16,
                           impl=impl, block=block)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--latent", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--impls", default="blocked:128,blocked:256,blocked:512,ragged")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    M, E = a.tokens * a.top_k, a.experts
    ks = jax.random.split(jax.random.key(0), 5)
    experts = jnp.sort(jax.random.randint(ks[0], (M,), 0, E))
    sizes = jnp.bincount(experts, length=E).astype(jnp.int32)
    x = jax.random.normal(ks[1], (M, a.latent), jnp.bfloat16)
    w1 = jax.random.normal(ks[2], (E, a.latent, a.hidden), jnp.bfloat16) * 0.03
    w3 = jax.random.normal(ks[3], (E, a.latent, a.hidden), jnp.bfloat16) * 0.03
    w2 = jax.random.normal(ks[4], (E, a.hidden, a.latent), jnp.bfloat16) * 0.03
    flops = 2 * M * a.latent * a.hidden * 3 * 3  # three matmuls, forward + two backward
    rows = []
    for spec in a.impls.split(","):
        impl, _, block = spec.partition(":")
        fn = functools.partial(expert_mlp, impl=impl, block=int(block or 512))
        grad = jax.jit(jax.grad(lambda *p, f=fn: jnp.sum(f(*p, sizes)), argnums=(0, 1, 2, 3)))
        try:
            compiled = grad.lower(x, w1, w3, w2).compile()
            for _ in range(2):
                jax.block_until_ready(compiled(x, w1, w3, w2))
            t = time.perf_counter()
            for _ in range(10):
                out = compiled(x, w1, w3, w2)
            jax.block_until_ready(out)
            dt = (time.perf_counter() - t) / 10
            peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)
            row = dict(impl=spec, rows=M, experts=E, fwd_bwd_ms=round(dt * 1e3, 3),
                       tflops=round(flops / dt / 1e12, 1), peak_gb_so_far=round(peak / 2**30, 2))
        except Exception as e:  # an OOM in one impl should not hide the others
            row = dict(impl=spec, rows=M, experts=E, error=str(e).splitlines()[0][:200])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
