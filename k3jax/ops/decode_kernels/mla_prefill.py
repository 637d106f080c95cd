"""A prompt chunk's attention over MLA's cache (chunked prefill), flash style, expanded form.

    o = expanded_prefill_attention(q_nope, q_rope, k_nope, v, k_rope, kv_seg, q_seg, index, lo, scale=...)

The chunk's C queries sit at slots [index, index + C) of a cache of S slots that already holds
their keys (the caller wrote the chunk first). Query t sees slot s iff s <= index + t and
kv_seg[s] == q_seg[t]: causal with an offset, within the document, the mask of the plain path
(`k3jax.layers.attention.decode_mask`).

Why expanded here and absorbed in decoding: a prefill is bound by FLOPs, and per (query, key,
head) the expanded form costs n + r + v = 320 multiply-adds against R + r + R = 576 absorbed
(k3-small; K3: 320 vs 1088); the expansion of the cached latent into per-head keys and values
(one GEMM per chunk and layer) is small beside the attention at long context. Decoding is bound
by bytes, where the absorbed form reads 576 values per slot instead of H(n + v).

Shapes: q_nope [B,C,H,n], q_rope [B,C,H,r]; k_nope [B,S,H,n], v [B,S,H,dv] (the expanded cache);
k_rope [B,S,r] (the cached shared key, one per slot for all heads); kv_seg [B,S] int32; q_seg
[B,C] int32; index int32 scalar; lo [B] int32: no visible slot lies before it (the first slot of
the chunk's first document), so key blocks before it are skipped. -> o [B,C,H,dv] in v's dtype
(0 for a query that sees nothing).

Grid (C/block_q, B*H): one program per block of queries and head, walking the key blocks from lo
to its last query's slot with an online softmax in fp32 (n and r are separate dots: each side a
power of two). `expanded_prefill_attention_reference` is the plain form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from k3jax.ops.decode_kernels.common import block_dividing, pow2_at_least

F32 = jnp.float32
NEG = -1e30


def _dot(a, b, precision, *, tb: bool = False):
    dims = (((1,), (1 if tb else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def _kernel(meta_ref, qn_ref, qr_ref, qs_ref, kn_ref, v_ref, kr_ref, seg_ref, o_ref, *, block_k, scale, precision):
    """Grid (i, bh). meta_ref [2] = (index, lo) of the row; qn/qr_ref [bq, n|r], qs_ref [bq];
    kn_ref [S,n], v_ref [S,dv], kr_ref [S,r], seg_ref [S]; o_ref [bq, dv]."""
    i = pl.program_id(0)
    index, lo = meta_ref[0], meta_ref[1]
    qn, qr, qs = qn_ref[...], qr_ref[...], qs_ref[...]
    bq, dv = o_ref.shape
    q_slot = index + i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    first = lo // block_k
    # the block of the program's last query (padded queries past the cache's end: its last block)
    last = jnp.minimum((index + (i + 1) * bq - 1) // block_k, kn_ref.shape[0] // block_k - 1)

    def body(blk, carry):
        m, l, acc = carry
        start = pl.multiple_of(blk * block_k, block_k)
        keys = pl.ds(start, block_k)
        kn, kr, vv, seg = kn_ref[keys, :], kr_ref[keys, :], v_ref[keys, :], seg_ref[keys]
        s = _dot(qn, kn, precision, tb=True) + _dot(qr, kr, precision, tb=True)  # [bq, bk]
        k_slot = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        ok = (k_slot <= q_slot) & (seg[None, :] == qs[:, None])
        s = jnp.where(ok, s * scale, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        acc = acc * corr[:, None] + _dot(p.astype(vv.dtype), vv, precision)
        return m_new, l * corr + jnp.sum(p, axis=1), acc

    init = (jnp.full((bq,), NEG, F32), jnp.zeros((bq,), F32), jnp.zeros((bq, dv), F32))
    _, l, acc = jax.lax.fori_loop(first, last + 1, body, init)
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def unsupported_reason(q_nope, q_rope, k_nope, v, k_rope) -> str | None:
    """Why the kernel cannot take these shapes (None when it can)."""
    for name, n in (("qk_nope_head_dim", q_nope.shape[-1]), ("qk_rope_head_dim", q_rope.shape[-1]),
                    ("v_head_dim", v.shape[-1])):
        if n < 16 or n & (n - 1):
            return f"{name}={n} is not a power of two >= 16"
    if block_dividing(k_nope.shape[1]) is None:
        return f"cache length {k_nope.shape[1]} is not a multiple of 16"
    if len({x.dtype for x in (q_nope, q_rope, k_nope, v, k_rope)}) > 1:
        return "q, k and v differ in dtype"
    return None


# launch parameters (no autotuner in Pallas-Triton): a flash-attention forward's usual choice
# for 128-wide heads on Hopper; benchmarks may override them (benchmarks/decode/long_decode.py --tuning)
TUNING = {"block_q": 128, "block_k": 64, "warps": 8, "stages": 2}


def expanded_prefill_attention(q_nope, q_rope, k_nope, v, k_rope, kv_seg, q_seg, index, lo=None, *,
                               scale: float, block_q: int | None = None, block_k: int | None = None,
                               warps: int | None = None, stages: int | None = None, interpret: bool = False):
    """The kernel (module docstring); launch parameters default to TUNING. -> o [B,C,H,dv] in v's dtype."""
    block_q, block_k = block_q or TUNING["block_q"], block_k or TUNING["block_k"]
    warps, stages = warps or TUNING["warps"], stages or TUNING["stages"]
    why = unsupported_reason(q_nope, q_rope, k_nope, v, k_rope)
    if why:
        raise ValueError(f"expanded_prefill_attention: {why}")
    B, C, H, n = q_nope.shape
    S, r, dv = k_nope.shape[1], q_rope.shape[-1], v.shape[-1]
    bq = min(block_q, pow2_at_least(C))
    bk = block_k if S % block_k == 0 else block_dividing(S)
    pad = (-C) % bq
    if pad:  # padded queries carry segment -2: they see nothing and are cut off below
        q_nope, q_rope = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q_nope, q_rope))
        q_seg = jnp.pad(q_seg, ((0, 0), (0, pad)), constant_values=-2)
    lo = jnp.zeros((B,), jnp.int32) if lo is None else lo.astype(jnp.int32)
    meta = jnp.stack([jnp.broadcast_to(jnp.asarray(index, jnp.int32), (B,)), lo], axis=1)
    precision = jax.lax.Precision.HIGHEST if v.dtype == F32 else jax.lax.Precision.DEFAULT
    kernel = functools.partial(_kernel, block_k=bk, scale=float(scale), precision=precision)
    q_spec = lambda w: pl.BlockSpec((None, bq, None, w), lambda i, bh: (bh // H, i, bh % H, 0))  # noqa: E731
    kv_spec = lambda w: pl.BlockSpec((None, S, None, w), lambda i, bh: (bh // H, 0, bh % H, 0))  # noqa: E731
    o = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((B, C + pad, H, dv), v.dtype),
        grid=((C + pad) // bq, B * H),
        in_specs=[pl.BlockSpec((None, 2), lambda i, bh: (bh // H, 0)), q_spec(n), q_spec(r),
                  pl.BlockSpec((None, bq), lambda i, bh: (bh // H, i)), kv_spec(n), kv_spec(dv),
                  pl.BlockSpec((None, S, r), lambda i, bh: (bh // H, 0, 0)),
                  pl.BlockSpec((None, S), lambda i, bh: (bh // H, 0))],
        out_specs=q_spec(dv),
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name="mla_expanded_prefill",
    )(meta, q_nope, q_rope, q_seg.astype(jnp.int32), k_nope, v, k_rope, kv_seg.astype(jnp.int32))
    return o[:, :C]


def expanded_prefill_attention_reference(q_nope, q_rope, k_nope, v, k_rope, kv_seg, q_seg, index, lo=None, *,
                                         scale: float):
    """The plain form: [B,H,C,S] scores, masked softmax in fp32 (tests)."""
    del lo
    prec = jax.lax.Precision.HIGHEST
    s = (jnp.einsum("bchn,bshn->bhcs", q_nope, k_nope, preferred_element_type=F32, precision=prec)
         + jnp.einsum("bchr,bsr->bhcs", q_rope, k_rope, preferred_element_type=F32, precision=prec)) * scale
    C, S = q_nope.shape[1], k_nope.shape[1]
    ok = (jnp.arange(S)[None, :] <= index + jnp.arange(C)[:, None])[None] & (q_seg[:, :, None] == kv_seg[:, None, :])
    ok = ok[:, None]
    s = jnp.where(ok, s, NEG)
    p = jnp.where(ok, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den > 0, den, 1.0)
    return jnp.einsum("bhcs,bshv->bchv", p, v.astype(F32), precision=prec).astype(v.dtype)
