"""Expert grouped matmuls at k3-small's per-GPU shape: tokamax's kernel, ragged_dot, the padded-block form.

    python -m benchmarks.ops.grouped_matmul [--tokens 32768] [--experts 64] [--top-k 8] [--json out.json]

Times the routed-expert MLP (w1, w3, GLU, w2; bf16, fp32 output) forward+backward with each
`k3jax.ops.grouped_matmul` impl, and the peak memory each needs, and checks each impl's
output and gradients against the blocked form (itself tested against the naive per-row form
on CPU). Routing is uniform random, which is what Quantile Balancing aims for; rows past the
routed ones (a capacity buffer's padding) are included so the kernels' handling of them is checked.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from benchmarks.bench_util import Rows, shape_args
from k3jax.ops.grouped_matmul import grouped_glu_mlp


def expert_mlp(x, w1, w3, w2, sizes, *, impl, block):
    return grouped_glu_mlp(x, w1, w3, w2, sizes, lambda a, b: jax.nn.silu(a) * b, compute_dtype=jnp.bfloat16,
                           impl=impl, block=block)


def main():
    ap = argparse.ArgumentParser()
    shape_args(ap, tokens=32768, experts=64, top_k=8, latent=768, hidden=512)
    ap.add_argument("--impls", default="blocked:512,kernel,blocked:256,ragged")
    ap.add_argument("--pad-rows", type=int, default=1024, help="unrouted rows at the end (must come out zero)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    routed, E = a.tokens * a.top_k, a.experts
    M = routed + a.pad_rows
    ks = jax.random.split(jax.random.key(0), 5)
    experts = jnp.sort(jax.random.randint(ks[0], (routed,), 0, E))
    sizes = jnp.bincount(experts, length=E).astype(jnp.int32)
    x = jax.random.normal(ks[1], (M, a.latent), jnp.bfloat16)
    w1 = jax.random.normal(ks[2], (E, a.latent, a.hidden), jnp.bfloat16) * 0.03
    w3 = jax.random.normal(ks[3], (E, a.latent, a.hidden), jnp.bfloat16) * 0.03
    w2 = jax.random.normal(ks[4], (E, a.hidden, a.latent), jnp.bfloat16) * 0.03
    flops = 2 * routed * a.latent * a.hidden * 3 * 3  # three matmuls, forward + two backward
    rows, ref = Rows(), None

    def rel(a_, b_):
        a_, b_ = jnp.asarray(a_, jnp.float32), jnp.asarray(b_, jnp.float32)
        return float(jnp.max(jnp.abs(a_ - b_)) / (jnp.max(jnp.abs(b_)) + 1e-30))

    for spec in a.impls.split(","):
        impl, _, block = spec.partition(":")
        fn = functools.partial(expert_mlp, impl=impl, block=int(block or 512))
        cot = jax.random.normal(ks[0], (M, a.latent), jnp.float32)
        grad = jax.jit(jax.value_and_grad(lambda *p, f=fn: jnp.sum(f(*p, sizes) * cot), argnums=(0, 1, 2, 3)))
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
            row = dict(impl=spec, rows=routed, pad_rows=a.pad_rows, experts=E, fwd_bwd_ms=round(dt * 1e3, 3),
                       tflops=round(flops / dt / 1e12, 1), peak_gb_so_far=round(peak / 2**30, 2))
            y = jax.jit(fn)(x, w1, w3, w2, sizes)
            row["pad_rows_zero"] = bool(jnp.all(y[routed:] == 0)) and bool(jnp.all(out[1][0][routed:] == 0))
            if ref is None and impl == "blocked":
                ref = (y, out)
            elif ref is not None:
                row["rel_err_vs_blocked"] = dict(y=rel(y, ref[0]), **{f"d{n}": rel(g, r) for n, g, r in
                                                  zip(("x", "w1", "w3", "w2"), out[1], ref[1][1])})
        except Exception as e:  # an OOM in one impl should not hide the others
            row = dict(impl=spec, rows=M, experts=E, error=str(e).splitlines()[0][:200])
        rows.add(row)
    rows.write(a.json)


if __name__ == "__main__":
    main()
