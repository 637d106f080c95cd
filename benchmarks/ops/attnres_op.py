"""One AttnRes site at k3-small's shapes on a GPU: the form before issue 23's glue round (autodiff
of reductions), the new XLA form and the fused kernels, forward and forward+backward, in one
process; --sweep times the kernels' launch settings instead.

    python -m benchmarks.ops.attnres_op [--batch 8] [--seq 4096] [--d 1536] [--slots 4] [--sweep]
        [--json out.json]

Each row: ms (median of --iters after warm-up) and GB/s over the bytes the form must move at
least: forward (n + 1) sources read and the output written; forward+backward adds g read,
the sources read again and the cotangents (n slots of the block buffer's running cotangent
read and written, the prefix's written). The backward of the old form is timed with the
running cotangent added to its fresh one (what XLA fuses in the model), the new forms get it
as the pass-through's cotangent (the kernel's time includes XLA's copy of it: a jit argument is
not updated in place; in the model it is). Before the timings, the kernels' outputs and gradients are
checked against the XLA form's on the GPU (max relative difference printed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.bench_util import Rows, shape_args
from k3jax.ops import attnres_mix as am


def attn_res_mix_before(blocks, num_blocks, prefix, query, eps):
    """k3jax.layers.attnres.attn_res_mix as of commit 65cb849 (before this round): reductions
    and an unrolled sum, differentiated by autodiff."""
    q = query.astype(jnp.float32)

    def logit(v):
        v32 = v.astype(jnp.float32)
        return jnp.sum(v32 * q, axis=-1) * jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1) + eps)

    lb, lp = logit(blocks), logit(prefix)
    valid = (jnp.arange(blocks.shape[0]) < num_blocks)[:, None, None]
    lb = jnp.where(valid, lb, -jnp.inf)
    m = jnp.maximum(jnp.max(lb, axis=0), lp)
    eb, ep = jnp.exp(lb - m), jnp.exp(lp - m)
    inv_z = 1.0 / (jnp.sum(eb, axis=0) + ep)
    wb, wp = eb * inv_z, ep * inv_z
    out = wp[..., None] * prefix.astype(jnp.float32)
    for i in range(blocks.shape[0]):
        out = out + wb[i][..., None] * blocks[i].astype(jnp.float32)
    return out.astype(prefix.dtype)


def timed(fn, args, iters):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def forms(impl_kw, interpret=False):
    """name -> (forward fn, forward+backward fn) over (blocks, n, prefix, query, g, acc)."""
    eps = 1e-5

    def before_fwd(b, n, p, q, g, acc):
        return attn_res_mix_before(b, n, p, q, eps)

    def before_bwd(b, n, p, q, g, acc):
        out, vjp = jax.vjp(lambda b, p, q: attn_res_mix_before(b, n, p, q, eps), b, p, q)
        db, dp, dq = vjp(g)
        return out, acc + db, dp, dq

    def site(impl, **kw):
        def fwd(b, n, p, q, g, acc):
            if impl == "xla":
                return am.mix_xla(b, n, p, q, eps)
            return am.mix_kernel(b, n, p, q, eps=eps, interpret=interpret, **kw)

        def bwd(b, n, p, q, g, acc):
            if impl == "xla":
                out = am.mix_xla(b, n, p, q, eps)
                return (out,) + am.grads_xla(b, n, p, q, g, acc, eps)
            out = am.mix_kernel(b, n, p, q, eps=eps, interpret=interpret, **kw)
            return (out,) + am.grads_kernel(b, n, p, q, g, acc, eps=eps, interpret=interpret, **kw)
        return fwd, bwd

    out = {"before (autodiff)": (before_fwd, before_bwd), "xla": site("xla"), "kernel": site("kernel", **impl_kw)}
    return {k: (jax.jit(f), jax.jit(b)) for k, (f, b) in out.items()}


def main():
    ap = argparse.ArgumentParser()
    shape_args(ap, batch=8, seq=4096, d=1536, slots=4, iters=20)
    ap.add_argument("--sweep", action="store_true", help="time the kernels' launch settings (not the forms)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    B, T, d, NB = a.batch, a.seq, a.d, a.slots
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    scale = jnp.asarray([1.0, 3.0, 0.5, 2.0] * NB)[:NB, None, None, None]
    blocks = (jax.random.normal(k[0], (NB, B, T, d)) * scale).astype(jnp.bfloat16)
    prefix = jax.random.normal(k[1], (B, T, d)).astype(jnp.bfloat16)
    query = 0.05 * jax.random.normal(k[2], (d,))
    g = jax.random.normal(k[3], (B, T, d)).astype(jnp.bfloat16)
    acc = jax.random.normal(k[4], (NB, B, T, d)).astype(jnp.bfloat16)
    unit = B * T * d * 2  # one [B,T,d] bf16 tensor
    rows = Rows()
    print(f"AttnRes site, B={B} T={T} d={d} NB={NB}, bf16 sources, {jax.devices()[0].device_kind}", flush=True)

    # the kernels against the XLA form on this GPU
    interpret = jax.default_backend() == "cpu"  # a smoke run off the GPU: the Pallas interpreter
    fs = forms({}, interpret)
    for n in (0, 2, NB):
        ref = fs["xla"][1](blocks, jnp.int32(n), prefix, query, g, acc)
        got = fs["kernel"][1](blocks, jnp.int32(n), prefix, query, g, acc)
        errs = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
                      / (float(jnp.max(jnp.abs(y.astype(jnp.float32)))) + 1e-30)) for x, y in zip(got, ref)]
        untouched = bool(jnp.all(got[1][n:] == acc[n:]))
        print(f"check n={n}: kernel vs xla max rel diff (out, dblocks, dprefix, dq) "
              + " ".join(f"{e:.1e}" for e in errs) + f"; slots >= n untouched: {untouched}", flush=True)
        rows.append({"check": n, "rel_diff": errs, "untouched": untouched})

    for n in range(1, NB + 1) if not a.sweep else ():
        fwd_bytes = (n + 2) * unit
        bwd_bytes = fwd_bytes + (1 + (n + 1) + 2 * n + 1) * unit
        for name, (f, b) in fs.items():
            args = (blocks, jnp.int32(n), prefix, query, g, acc)
            tf, tb = timed(f, args, a.iters), timed(b, args, a.iters)
            row = {"n": n, "form": name, "fwd_ms": round(tf, 3), "fwd_bwd_ms": round(tb, 3),
                   "fwd_GBps": round(fwd_bytes / tf / 1e6, 1), "fwd_bwd_GBps": round(bwd_bytes / tb / 1e6, 1)}
            rows.add(row)

    if a.sweep:
        for tokens in (16, 32, 64):
            for warps in (4, 8):
                for chunk in (64, 128, 256):
                    if d % chunk:
                        continue
                    fs_k = forms({"tokens": tokens, "warps": warps, "chunk": chunk}, interpret)["kernel"]
                    for n in (2, NB):
                        args = (blocks, jnp.int32(n), prefix, query, g, acc)
                        try:
                            tf, tb = timed(fs_k[0], args, a.iters), timed(fs_k[1], args, a.iters)
                        except Exception as e:  # a setting Triton cannot lay out (registers, shared memory)
                            print(json.dumps({"sweep": [tokens, warps, chunk], "n": n, "error": str(e)[:200]}))
                            continue
                        row = {"sweep": [tokens, warps, chunk], "n": n, "fwd_ms": round(tf, 3),
                               "fwd_bwd_ms": round(tb, 3)}
                        rows.add(row)
    rows.write(a.json)


if __name__ == "__main__":
    main()
