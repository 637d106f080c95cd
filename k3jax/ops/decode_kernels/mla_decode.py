"""MLA's decode attention in the absorbed form, reading the latent cache once per step.

    o_lat = latent_decode_attention(q_lat, q_rope, latent, k_rope, kv_seg, q_seg, index, layer, scale=...)

One query token per row, H heads sharing one cache (an MQA over the latent): head h scores slot
s as scale * (q_lat[h] . c_s + q_rope[h] . k^p_s) and returns sum_s p_hs c_s (k3-architecture.md
§3.3; W_UK is already folded into q_lat and W_UV is applied by the caller).

Shapes: q_lat [B,H,R], q_rope [B,H,r] in the compute dtype; latent [L,B,S,R], k_rope [L,B,S,r]:
a stage's stacked cache, `layer` (int32 scalar) picking this layer's slice in place, so the cache
is never copied; kv_seg [B,S] int32 (-1 = empty slot); q_seg [B] int32; index: int32 scalar,
the query's slot. The query sees slot s iff s <= index and kv_seg[s] == q_seg. lo [B] (optional):
no visible slot lies before it (the first slot of the query's document), so the scan starts
there. -> o_lat [B,H,R] fp32 (0 for a row that sees nothing).

The kernel is flash decoding: the visible range [lo, index] of each row is cut into `splits`
contiguous parts, one program each (grid (B, splits), so a single sequence still fills the GPU);
a program streams its part in blocks of `block` slots, each block of c and k^p loaded once and
used for both products (scores, then p c), with an online softmax in fp32. The partial results
(max, sum, p c per head) are merged in XLA. Only slots up to `index` are read: the bytes a step
reads are those of the filled cache, whatever its allocated length. Heads are padded to 16 rows
(the smallest dot).

`latent_decode_attention_reference` is the plain form (scores over every slot, masked softmax).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from k3jax.ops.decode_kernels.common import block_dividing, pow2_at_least

F32 = jnp.float32
NEG = -1e30  # a finite "minus infinity": a fully masked block never makes inf - inf
TARGET_PROGRAMS = 264  # two per SM of an H200 (132 SMs)
# launch parameters (no autotuner in Pallas-Triton); benchmarks may override them
TUNING = {"block": 64, "warps": 4, "stages": 2, "programs": TARGET_PROGRAMS}


def _dot(a, b, precision, *, tb: bool = False):
    dims = (((1,), (1 if tb else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def _kernel(meta_ref, ql_ref, qr_ref, lat_ref, kr_ref, seg_ref, o_ref, m_ref, l_ref, *, block, splits, scale,
            precision):
    """Grid (b, j). meta_ref [4] = (layer, index, lo, q_seg) of row b; lat_ref [L,S,R], kr_ref [L,S,r],
    seg_ref [S]; outputs of split j: o_ref [Hp,R], m_ref / l_ref [Hp]."""
    j = pl.program_id(1)
    layer, index, lo, q_seg = meta_ref[0], meta_ref[1], meta_ref[2], meta_ref[3]
    first = lo // block
    n_blocks = jnp.maximum(index // block + 1 - first, 0)
    per = (n_blocks + splits - 1) // splits
    b0 = first + j * per
    b1 = jnp.minimum(b0 + per, first + n_blocks)
    ql, qr = ql_ref[...], qr_ref[...]
    Hp, R = ql.shape

    def body(blk, carry):
        m, l, acc = carry
        start = pl.multiple_of(blk * block, block)
        c = lat_ref[layer, pl.ds(start, block), :]
        kr = kr_ref[layer, pl.ds(start, block), :]
        seg = seg_ref[pl.ds(start, block)]
        s = _dot(ql, c, precision, tb=True) + _dot(qr, kr, precision, tb=True)  # [Hp, block]
        slot = start + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        ok = (slot <= index) & (seg[None, :] == q_seg)
        s = jnp.where(ok, s * scale, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(ok, jnp.exp(s - m_new[:, None]), 0.0)
        corr = jnp.exp(m - m_new)
        acc = acc * corr[:, None] + _dot(p.astype(c.dtype), c, precision)
        return m_new, l * corr + jnp.sum(p, axis=1), acc

    init = (jnp.full((Hp,), NEG, F32), jnp.zeros((Hp,), F32), jnp.zeros((Hp, R), F32))
    m, l, acc = jax.lax.fori_loop(b0, b1, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def num_splits(B: int, S: int, block: int, multiple: int = 1) -> int:
    """Programs per row: enough for TUNING["programs"] in all, at most one per block, rounded up to
    a multiple of `multiple` (the extra ones see no block and return m = NEG, l = 0)."""
    n = max(1, min(S // block, math.ceil(TUNING["programs"] / B)))
    return -(-n // multiple) * multiple


def unsupported_reason(q_lat, latent, k_rope) -> str | None:
    """Why the kernel cannot take these shapes (None when it can)."""
    S, R, r = latent.shape[2], latent.shape[-1], k_rope.shape[-1]
    for name, n in (("kv_lora_rank", R), ("qk_rope_head_dim", r)):
        if n < 16 or n & (n - 1):
            return f"{name}={n} is not a power of two >= 16"
    if block_dividing(S) is None:
        return f"cache length {S} is not a multiple of 16"
    if latent.dtype != q_lat.dtype or k_rope.dtype != q_lat.dtype:
        return f"the cache ({latent.dtype}) and the query ({q_lat.dtype}) differ in dtype"
    return None


def latent_decode_attention(q_lat, q_rope, latent, k_rope, kv_seg, q_seg, index, layer, *, scale: float,
                            lo=None, splits: int | None = None, block: int | None = None,
                            interpret: bool = False):
    """The kernel (module docstring). -> o_lat [B,H,R] fp32."""
    why = unsupported_reason(q_lat, latent, k_rope)
    if why:
        raise ValueError(f"latent_decode_attention: {why}")
    B, H = q_lat.shape[:2]
    Hp = pow2_at_least(H)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, Hp - H), (0, 0)))  # noqa: E731
    lo = jnp.zeros((B,), jnp.int32) if lo is None else lo.astype(jnp.int32)
    meta = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (B,)),
                      jnp.broadcast_to(jnp.asarray(index, jnp.int32), (B,)), lo, q_seg.astype(jnp.int32)], axis=1)
    o, m, l = latent_decode_partials(pad(q_lat), pad(q_rope), latent, k_rope, kv_seg, meta, scale=scale,
                                     splits=splits, block=block, interpret=interpret)
    return merge_splits(o, m, l)[:, :H]


def latent_decode_partials(q_lat, q_rope, latent, k_rope, kv_seg, meta, *, scale: float, splits: int | None = None,
                           block: int | None = None, split_multiple: int = 1, interpret: bool = False):
    """The kernel on queries already padded to Hp heads (q_lat [B,Hp,R], q_rope [B,Hp,r]) and
    its per-row meta [B,4] = (layer, index, lo, q_seg): the splits' partial results (o
    [B,NS,Hp,R], m / l [B,NS,Hp]) for `merge_splits` (or a kernel that merges them)."""
    L, B, S, R = latent.shape
    Hp, r = q_lat.shape[1], k_rope.shape[-1]
    block = block or (TUNING["block"] if S % TUNING["block"] == 0 else block_dividing(S))
    splits = splits or num_splits(B, S, block, split_multiple)
    precision = jax.lax.Precision.HIGHEST if q_lat.dtype == F32 else jax.lax.Precision.DEFAULT
    kernel = functools.partial(_kernel, block=block, splits=splits, scale=float(scale), precision=precision)
    row = lambda *shape: pl.BlockSpec((None,) + shape, lambda b, j: (b,) + (0,) * len(shape))  # noqa: E731
    part = lambda *shape: pl.BlockSpec((None, None) + shape, lambda b, j: (b, j) + (0,) * len(shape))  # noqa: E731
    o, m, l = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((B, splits, Hp, R), F32), jax.ShapeDtypeStruct((B, splits, Hp), F32),
                   jax.ShapeDtypeStruct((B, splits, Hp), F32)],
        grid=(B, splits),
        in_specs=[row(4), row(Hp, R), row(Hp, r),
                  pl.BlockSpec((L, None, S, R), lambda b, j: (0, b, 0, 0)),
                  pl.BlockSpec((L, None, S, r), lambda b, j: (0, b, 0, 0)),
                  row(S)],
        out_specs=[part(Hp, R), part(Hp), part(Hp)],
        compiler_params=pltr.CompilerParams(num_warps=TUNING["warps"], num_stages=TUNING["stages"]),
        interpret=interpret, name="mla_latent_decode",
    )(meta, q_lat, q_rope, latent, k_rope, kv_seg.astype(jnp.int32))
    return o, m, l


def merge_splits(o, m, l):
    """Partial results of the splits (o [B,NS,H,R], m / l [B,NS,H]) -> [B,H,R] fp32."""
    top = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - top) * (l > 0)
    den = jnp.sum(w * l, axis=1)
    num = jnp.sum(w[..., None] * o, axis=1)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def latent_decode_attention_reference(q_lat, q_rope, latent, k_rope, kv_seg, q_seg, index, layer, *,
                                      scale: float, lo=None):
    """The plain form: scores over every slot of the layer's cache, masked softmax in fp32."""
    del lo  # an optimisation of the kernel's scan only
    c = jax.lax.dynamic_index_in_dim(latent, layer, 0, keepdims=False)
    kr = jax.lax.dynamic_index_in_dim(k_rope, layer, 0, keepdims=False)
    prec = jax.lax.Precision.HIGHEST
    s = (jnp.einsum("bhr,bsr->bhs", q_lat, c, preferred_element_type=F32, precision=prec)
         + jnp.einsum("bhp,bsp->bhs", q_rope, kr, preferred_element_type=F32, precision=prec)) * scale
    slot = jnp.arange(c.shape[1])
    ok = ((slot <= index)[None, :] & (kv_seg == q_seg[:, None]))[:, None, :]
    s = jnp.where(ok, s, NEG)
    p = jnp.where(ok, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den > 0, den, 1.0)
    return jnp.einsum("bhs,bsr->bhr", p, c.astype(F32), precision=prec)
