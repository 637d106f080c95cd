"""What QK-Clip's max-logit statistic costs, per way of computing it (compile memory and CPU time).

    python -m benchmarks.ops.qk_clip_max_logits [--seq 4096] [--batch 1] [--heads 16] [--time-seq 1024]

One MLA attention call (q, k [B,T,H,n+r], v [B,T,H,v], two documents per row), forward and
forward + backward, compiled with XLA and read through `memory_analysis()` (temporaries:
what the call needs beyond its inputs and outputs), then timed at --time-seq:

- off:            `causal_softmax_attention` alone (what the model runs with qk_clip_tau = 0)
- blocked-512/128: plus `causal_max_logits` in query x key blocks (a running max, the blocks
                  above the diagonal skipped): what the model runs with qk_clip_tau > 0
- dense-extra:    plus `causal_max_logits` in one block: the masked [B,H,T,T] scores again
- same-scores:    an explicit softmax attention that returns the max of its own row maxima
                  (the max the softmax takes anyway; one extra reduction, no second QK^T)

XLA:CPU's figures; cuDNN's fused attention holds no [T,T] scores at all, so on GPU only the
blocked form keeps the statistic from adding them.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_util import shape_args
from k3jax.ops.softmax_attn import attention_mask, causal_max_logits, causal_softmax_attention

N, R, V = 128, 64, 128  # K3's MLA head dims: qk_nope, qk_rope, v


def same_scores_attention(q, k, v, scale, seg):
    B, T = q.shape[:2]
    s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(attention_mask(seg, T, B), s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(v.dtype)
    return o, jax.lax.stop_gradient(jnp.max(m, axis=(0, 2, 3)))


def variants(scale):
    def off(q, k, v, seg):
        return causal_softmax_attention(q, k, v, scale=scale, segment_ids=seg), jnp.zeros(q.shape[2])

    def with_max(block):
        def f(q, k, v, seg):
            o = causal_softmax_attention(q, k, v, scale=scale, segment_ids=seg)
            return o, causal_max_logits(q, k, scale=scale, segment_ids=seg, block_size=block)
        return f

    return {"off": off, "blocked-512": with_max(512), "blocked-128": with_max(128),
            "dense-extra": with_max(1 << 30),
            "same-scores": lambda q, k, v, seg: same_scores_attention(q, k, v, scale, seg)}


def programs(fn):
    fwd = jax.jit(fn)

    def loss(q, k, v, seg, w):
        o, m = fn(q, k, v, seg)
        return jnp.sum(o.astype(jnp.float32) * w), m

    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    return fwd, bwd


def inputs(B, T, H, dtype, concrete=False):
    shapes = {"q": (B, T, H, N + R), "k": (B, T, H, N + R), "v": (B, T, H, V), "w": (B, T, H, V)}
    seg = np.repeat(np.concatenate([np.ones(T // 2), 2 * np.ones(T - T // 2)])[None].astype(np.int32), B, 0)
    if not concrete:
        a = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()}
        return a["q"], a["k"], a["v"], jax.ShapeDtypeStruct(seg.shape, jnp.int32), a["w"]
    rng = np.random.default_rng(0)
    a = {k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}
    return a["q"], a["k"], a["v"], jnp.asarray(seg), a["w"]


def main():
    ap = argparse.ArgumentParser()
    shape_args(ap, seq=4096, batch=1, heads=16, time_seq=1024)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    dtype = jnp.dtype(a.dtype)
    scale = (N + R) ** -0.5
    mib = 2 ** 20
    print(f"B={a.batch} H={a.heads} head dims n+r={N + R} v={V} {a.dtype}, XLA:{jax.default_backend()}")
    print(f"{'variant':<12} {'fwd temp MiB':>13} {'fwd+bwd temp MiB':>17}   T={a.seq}   |"
          f" {'fwd ms':>8} {'fwd+bwd ms':>11}   T={a.time_seq}")
    for name, fn in variants(scale).items():
        fwd, bwd = programs(fn)
        args = inputs(a.batch, a.seq, a.heads, dtype)
        mf = fwd.lower(*args[:4]).compile().memory_analysis().temp_size_in_bytes
        mb = bwd.lower(*args).compile().memory_analysis().temp_size_in_bytes
        q, k, v, seg, w = inputs(a.batch, a.time_seq, a.heads, dtype, concrete=True)
        times = []
        for f, args_ in ((fwd, (q, k, v, seg)), (bwd, (q, k, v, seg, w))):
            jax.block_until_ready(f(*args_))
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*args_))
                best = min(best, time.perf_counter() - t0)
            times.append(best * 1e3)
        print(f"{name:<12} {mf / mib:>13.1f} {mb / mib:>17.1f}              | {times[0]:>8.1f} {times[1]:>11.1f}")


if __name__ == "__main__":
    main()
