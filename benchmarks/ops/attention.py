"""MLA's training attention on GPU: the fused flash kernel against the dense-mask XLA form.

    python -m benchmarks.ops.attention [--json out.json]

At k3-small's MLA shape (12 heads, q/k head dim 192 = 128 nope + 64 rope, v 128, bf16) with
packed documents: forward and forward+backward time, XLA's temporary memory for each, and the
kernel's output and gradients against the float32 naive reference
(`naive_causal_softmax_attention`) on the same packed rows.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_util import Rows, ms_per_call, rel_err
from k3jax.ops.softmax_attn import (
    causal_softmax_attention,
    naive_causal_softmax_attention,
)


def packed_segments(B, T, mean_doc, rng):
    """[B,T] ids: documents of random length (exponential, mean `mean_doc`), numbered 1.. per row."""
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        t, d = 0, 1
        while t < T:
            n = max(1, int(rng.exponential(mean_doc)))
            seg[b, t:t + n] = d
            t, d = t + n, d + 1
    return jnp.asarray(seg)


def inputs(B, T, H, D, Dv, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, H, D), dtype)
    k = jax.random.normal(ks[1], (B, T, H, D), dtype)
    v = jax.random.normal(ks[2], (B, T, H, Dv), dtype)
    do = jax.random.normal(ks[3], (B, T, H, Dv), dtype)
    return q, k, v, do


def timed(fn, args, reps=10):
    """(seconds per call, the compiled program's temporary bytes)."""
    compiled = jax.jit(fn).lower(*args).compile()
    return ms_per_call(compiled, *args, iters=reps) / 1e3, compiled.memory_analysis().temp_size_in_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--shapes", default="2x4096,8x4096,1x16384")
    ap.add_argument("--mean-doc", type=float, default=1500.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    H, D, Dv = a.heads, 192, 128
    scale = D ** -0.5
    rng = np.random.default_rng(0)
    rows = Rows()

    # correctness: kernel (bf16 and fp32 inputs) against the fp32 naive form, packed rows
    for dtype in (jnp.float32, jnp.bfloat16):
        B, T = 2, 2048
        q, k, v, do = inputs(B, T, H, D, Dv, dtype)
        seg = packed_segments(B, T, 600.0, rng)
        row = dict(check="kernel vs naive fp32", dtype=jnp.dtype(dtype).name, shape=[B, T, H, D, Dv])
        try:
            def f(impl, q, k, v):
                return causal_softmax_attention(q, k, v, scale=scale, segment_ids=seg, impl=impl)
            o, vjp = jax.vjp(lambda q, k, v: f("kernel", q, k, v), q, k, v)
            g = vjp(do)
            f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
            o_ref, vjp_ref = jax.vjp(lambda q, k, v: naive_causal_softmax_attention(q, k, v, scale=scale,
                                                                                    segment_ids=seg),
                                     f32(q), f32(k), f32(v))
            g_ref = vjp_ref(f32(do))
            row.update(out=rel_err(o, o_ref), dq=rel_err(g[0], g_ref[0]), dk=rel_err(g[1], g_ref[1]), dv=rel_err(g[2], g_ref[2]))
        except Exception as e:  # recorded, so the timing rows still run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        rows.add(row)

    for shape in a.shapes.split(","):
        B, T = map(int, shape.split("x"))
        q, k, v, do = inputs(B, T, H, D, Dv, jnp.bfloat16)
        seg = packed_segments(B, T, a.mean_doc, rng)
        flops_fwd = 2 * B * H * (T * T / 2) * (D + Dv)  # causal half, ignoring the document mask
        for impl in ("kernel", "xla"):
            row = dict(impl=impl, batch=B, seq=T, heads=H, d_qk=D, d_v=Dv)
            try:
                fwd = lambda q, k, v, seg, impl=impl: causal_softmax_attention(  # noqa: E731
                    q, k, v, scale=scale, segment_ids=seg, impl=impl)
                t_f, m_f = timed(fwd, (q, k, v, seg))

                def fwd_bwd(q, k, v, do, seg, fwd=fwd):
                    o, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, seg), q, k, v)
                    return vjp(do)
                t_fb, m_fb = timed(fwd_bwd, (q, k, v, do, seg))
                row.update(fwd_ms=round(t_f * 1e3, 3), fwd_bwd_ms=round(t_fb * 1e3, 3),
                           fwd_tflops_causal=round(flops_fwd / t_f / 1e12, 1),
                           fwd_bwd_tflops_causal=round(3.5 * flops_fwd / t_fb / 1e12, 1),
                           temp_gb_fwd=round(m_f / 2**30, 2), temp_gb_fwd_bwd=round(m_fb / 2**30, 2))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.add(row)
    rows.write(a.json)


if __name__ == "__main__":
    main()
