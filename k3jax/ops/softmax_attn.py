"""Causal softmax attention with packed-document masking.

q, k [B,T,H,D] / [B,T,Hkv,D]; v [B,T,Hkv,Dv] with H a multiple of Hkv (GQA); Dv may differ
from D (MLA: 192 vs 128); segment_ids [B,T].
Token t attends to s <= t in t's document, a document being a maximal run of equal segment
ids (a new one starts wherever the id changes, the rule the linear-attention recurrences and
convolutions reset by, so every mixer agrees on where documents are). Two fast forms:
`impl="kernel"`, a fused flash-attention kernel that takes each query's document start and
never builds a [T,T] mask (`k3jax.ops.flash_attention`, GPU with the [gpu] extra; the default
there), and `impl="xla"`, `jax.nn.dot_product_attention` with a dense [B,1,T,T] mask.
`naive_causal_softmax_attention` is the reference. Softmax in fp32, output in v's dtype.

`causal_max_logits` is QK-Clip's statistic: each query head's largest scaled pre-softmax
logit over the pairs the mask allows, in query blocks x key blocks with a running max, so it
never holds a [T,T] score matrix (the fused attention on GPU holds none either).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.flash_attention import document_start, flash_causal_attention, resolve_impl


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
    """[B,1,T,T] bool: key s visible to query t iff start(t) <= s <= t, start(t) being the
    first position of t's document (`document_start`)."""
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (B, 1, T, T))
    start = document_start(segment_ids)
    return causal & (jnp.arange(T)[None, None, None, :] >= start[:, None, :, None])


def causal_softmax_attention(q, k, v, *, scale=None, segment_ids=None, impl: str = "auto", implementation=None):
    """impl: auto (the fused kernel on a GPU with the [gpu] extra, else xla), kernel, or xla
    (jax.nn.dot_product_attention with a dense mask; `implementation` goes to it)."""
    _check(q, k, v, segment_ids)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if resolve_impl(impl) == "kernel":
        B, T = q.shape[:2]
        return flash_causal_attention(q, k, v, scale=scale, doc_start=document_start(segment_ids, T, B))
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


def causal_max_logits(q, k, *, scale=None, segment_ids=None, block_size: int = 512):
    """max over b, t and s <= t in t's document of scale * q[b,t,h] . k[b,s,h_kv] -> [H] fp32.

    q [B,T,H,D], k [B,T,Hkv,D] (H a multiple of Hkv, as in `causal_softmax_attention`).
    No gradient flows through it. Up to `block_size` tokens it is one masked score matrix;
    longer, the queries and keys go in blocks of `block_size` and only the key blocks at or
    below each query block's diagonal are visited (a running max, one [B,H,blk,blk] score
    block alive at a time). Products accumulate in fp32.
    """
    _check(q, k, k, segment_ids)
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    q = jax.lax.stop_gradient(q).reshape(B, T, Hkv, H // Hkv, D)
    k = jax.lax.stop_gradient(k)
    seg = document_start(segment_ids, T, B)  # [B,T]: key s visible to query t iff seg[t] <= s <= t

    def block_max(qb, kb, q_pos, k_pos, q_start):
        """a query block's scores against a key block, masked -> [H] (-inf where nothing is visible)."""
        s = jnp.einsum("bthgd,bshd->bhgts", qb, kb, preferred_element_type=jnp.float32) * scale
        ok = (q_pos[:, None] >= k_pos[None, :])[None] & (k_pos[None, None, :] >= q_start[:, :, None])  # [B,t,s]
        s = jnp.where(ok[:, None, None], s, -jnp.inf)
        return jnp.max(s, axis=(0, 3, 4)).reshape(H)

    if T <= block_size:
        pos = jnp.arange(T, dtype=jnp.int32)
        return block_max(q, k, pos, pos, seg)
    n = -(-T // block_size)
    pad = n * block_size - T
    q = jnp.pad(q, [(0, 0), (0, pad)] + [(0, 0)] * 3)
    k = jnp.pad(k, [(0, 0), (0, pad), (0, 0), (0, 0)])
    seg = jnp.pad(seg, [(0, 0), (0, pad)])
    qs = jnp.moveaxis(q.reshape(B, n, block_size, Hkv, H // Hkv, D), 1, 0)
    ks = jnp.moveaxis(k.reshape(B, n, block_size, Hkv, D), 1, 0)
    segs = jnp.moveaxis(seg.reshape(B, n, block_size), 1, 0)
    local = jnp.arange(block_size, dtype=jnp.int32)

    def query_block(i, qb, q_seg):
        q_pos = i * block_size + local
        # a padded query (position >= T) would see real keys: mask it by position; padded
        # keys lie past every real query, so the causal test already hides them
        q_pos = jnp.where(q_pos < T, q_pos, -1)

        def key_block(j, m):
            return jnp.maximum(m, block_max(qb, ks[j], q_pos, j * block_size + local, q_seg))

        # key blocks above the diagonal are fully masked: visit j = 0..i only
        return jax.lax.fori_loop(0, i + 1, key_block, jnp.full((H,), -jnp.inf, jnp.float32))

    per_block = jax.lax.map(lambda a: query_block(*a), (jnp.arange(n, dtype=jnp.int32), qs, segs))
    return jnp.max(per_block, axis=0)


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
