"""Causal softmax attention with packed-document masking.

q, k [B,T,H,D] / [B,T,Hkv,D]; v [B,T,Hkv,Dv] with H a multiple of Hkv (GQA); Dv may differ
from D (MLA: 192 vs 128); segment_ids [B,T].
Token t attends to s <= t with segment_ids[s] == segment_ids[t]. The fast form is
`jax.nn.dot_product_attention` (cuDNN flash attention on GPU when it applies);
`naive_causal_softmax_attention` is the reference. Softmax in fp32, output in v's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check(q, k, v, segment_ids):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"softmax attention: q, k, v must be [B,T,H,D], got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"softmax attention: shapes disagree: q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"softmax attention: {q.shape[2]} query heads is not a multiple of {k.shape[2]} kv heads")
    if segment_ids is not None and segment_ids.shape != q.shape[:2]:
        raise ValueError(f"softmax attention: segment_ids must be [B,T] = {q.shape[:2]}, got {segment_ids.shape}")


def attention_mask(segment_ids, T: int, B: int = 1):
    """[B,1,T,T] bool: causal AND same segment."""
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (B, 1, T, T))
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal & same


def causal_softmax_attention(q, k, v, *, scale=None, segment_ids=None, implementation=None):
    """Fast path: jax.nn.dot_product_attention (XLA on CPU, cuDNN where it applies on GPU)."""
    _check(q, k, v, segment_ids)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    D, Dv = q.shape[-1], v.shape[-1]
    # dot_product_attention wants one head dim: zero-pad the narrower side (exact; scale is explicit)
    if Dv < D:
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, D - Dv)])
    elif Dv > D:
        q, k = (jnp.pad(x, [(0, 0)] * 3 + [(0, Dv - D)]) for x in (q, k))
    if segment_ids is None:
        o = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=implementation)
    else:
        mask = attention_mask(segment_ids, q.shape[1], q.shape[0])
        o = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)
    return o[..., :Dv]


def naive_causal_softmax_attention(q, k, v, *, scale=None, segment_ids=None):
    """Reference: explicit fp32 scores, mask, softmax."""
    _check(q, k, v, segment_ids)
    B, T, H, D = q.shape
    rep = H // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scale = D ** -0.5 if scale is None else scale
    s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    s = jnp.where(attention_mask(segment_ids, T, B), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v.astype(jnp.float32)).astype(v.dtype)
