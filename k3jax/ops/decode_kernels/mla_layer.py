"""MLA's decode step around the latent attention kernel: one kernel before it, one after.

    q_lat, q_rope, meta, latent, k_rope = mla_decode_prep(q, kv_a, w_kvb, gamma, latent, k_rope, ...)
    o, m, l = mla_decode.latent_decode_partials(q_lat, q_rope, latent, k_rope, kv_seg, meta, ...)
    out = mla_decode_finish(o, m, l, w_kvb, g, ...)                  # -> o_proj

k3jax/layers/mla.py's absorbed decode (k3-architecture.md §3.3), per row b:

    prep:    q_lat_h = W_UK,h^T q^n_h   (per head, [R])  and q^p_h, padded to Hp heads with zeros;
             c = RMSNorm(kv_a[:R]) and k^p = kv_a[R:] written into the cache at `index`;
             meta = (layer, index, lo, q_seg) for the attention kernel
    finish:  o_lat_h = the splits' partial softmax results merged (mla_decode.merge_splits);
             out_h = sigmoid(g_h) * (W_UV,h o_lat_h)          (the output gate; none without it)

XLA ran these as eleven kernels per MLA layer at batch 1 (a cast, the latent's norm, the two
cache writes, the W_UK product, two pads and the meta, the three-step merge, the W_UV product,
the gate). Grids: prep (B, Hp), one program per head (the first also writes the cache), each
reading its head's [R, n] slice of W_UK; finish (B, H), one program per head, merging its
head's partials in chunks of 16 splits (their count a multiple of 16) and 64 latent channels.

Rounding as the plain path: q, kv_a, q_lat, the cache entries, o_lat and W_UV's product in the
compute dtype `dtype`; the norm's statistic, the merge and the gate in fp32. W_kvb (kv_b_proj's
kernel [R, H, n+v]: W_UK then W_UV per head) and the norm's gamma may be stacked over a stage's
repeats ([L, ...] with their layers), read in place. R, r, n and v powers of two >= 16.

`mla_decode_prep_reference` and `mla_decode_finish_reference` are the plain forms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from k3jax.ops.decode_kernels.common import index_operands, pow2_at_least
from k3jax.ops.decode_kernels.mla_decode import merge_splits

F32 = jnp.float32
SPLIT_CHUNK = 16  # finish reads the splits' partials this many at a time
TUNING = {"block_r": 64, "warps": 4}


def unsupported_reason(R: int, r: int, nope: int, v: int) -> str | None:
    for name, n in (("kv_lora_rank", R), ("qk_rope_head_dim", r), ("qk_nope_head_dim", nope), ("v_head_dim", v)):
        if n < 16 or n & (n - 1):
            return f"{name}={n} is not a power of two >= 16"
    return None


def _prep_kernel(*refs, n_idx, pos, H, R, r, n, BR, eps, dtype):
    """Grid (b, h). refs: index operands [1] (at pos: layer, index, w_kvb's layer, gamma's layer);
    lo_ref, qs_ref [1] (row b); q_ref [H, n+r], kv_ref [R+r] (row b); w_ref [Lw, R, H, n+v];
    g_ref [Lg, R]; lat_ref / kr_ref [L, S, R] / [L, S, r] (row b, in and out: aliased); outputs
    ql_ref [R], qr_ref [r] (row b, head h), meta_ref [4] (row b)."""
    idx_refs = refs[:n_idx]
    lo_ref, qs_ref, q_ref, kv_ref, w_ref, g_ref, lat_ref, kr_ref, ql_ref, qr_ref, meta_ref, lat_out, kr_out = \
        refs[n_idx:]
    layer, index, lw, lg = (idx_refs[p][0] for p in pos)
    h = pl.program_id(1)
    hh = jnp.minimum(h, H - 1)  # padding heads read head H-1 and write zeros
    valid = h < H
    rnd = lambda a: a.astype(dtype).astype(F32)  # noqa: E731
    qn = rnd(q_ref[hh, pl.ds(0, n)])
    for c in range(R // BR):
        rows = pl.ds(c * BR, BR)
        ql = jnp.sum(rnd(w_ref[lw, rows, hh, pl.ds(0, n)]) * qn[None, :], axis=1)
        ql_ref[rows] = jnp.where(valid, rnd(ql), 0.0).astype(ql_ref.dtype)
    qr_ref[...] = jnp.where(valid, rnd(q_ref[hh, pl.ds(n, r)]), 0.0).astype(qr_ref.dtype)

    @pl.when(h == 0)
    def _():
        c = rnd(kv_ref[pl.ds(0, R)])
        cn = (c * jax.lax.rsqrt(jnp.sum(c * c) / R + eps)).astype(dtype) * g_ref[lg, :].astype(dtype)
        lat_out[layer, index, :] = cn.astype(lat_out.dtype)
        kr_out[layer, index, :] = rnd(kv_ref[pl.ds(R, r)]).astype(kr_out.dtype)
        i4 = jax.lax.broadcasted_iota(jnp.int32, (4,), 0)
        meta_ref[...] = jnp.where(i4 == 0, layer, jnp.where(i4 == 1, index, jnp.where(i4 == 2, lo_ref[0], qs_ref[0])))


def mla_decode_prep(q, kv_a, w_kvb, gamma, latent, k_rope, *, index, layer, lo, q_seg, eps: float, dtype,
                    layers=(0, 0), interpret: bool = False):
    """The prep kernel (module docstring). q [B, H, n+r], kv_a [B, R+r] (fp32 or dtype); w_kvb
    [R, H, n+v] or [Lw, ...]; gamma [R] or [Lg, R]; latent [L, B, S, R], k_rope [L, B, S, r];
    index, layer int32 scalars; lo, q_seg [B] int32; layers: (w_kvb's, gamma's).
    -> (q_lat [B, Hp, R], q_rope [B, Hp, r] in dtype, meta [B, 4] int32, latent, k_rope)."""
    L, B, S, R = latent.shape
    H, r = q.shape[1], k_rope.shape[-1]
    n = q.shape[2] - r
    Hp = pow2_at_least(H)
    w_kvb = w_kvb if w_kvb.ndim == 4 else w_kvb[None]
    gamma = gamma.reshape(-1, R)
    idx, pos = index_operands([layer, index, layers[0], layers[1]])
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731
    row = lambda *shape: pl.BlockSpec((None,) + shape, lambda b, h: (b,) + (0,) * len(shape))  # noqa: E731
    cache = lambda a: pl.BlockSpec((L, None) + a.shape[2:], lambda b, h: (0, b, 0, 0))  # noqa: E731
    kernel = functools.partial(_prep_kernel, n_idx=len(idx), pos=tuple(pos), H=H, R=R, r=r, n=n,
                               BR=min(TUNING["block_r"], R), eps=float(eps), dtype=jnp.dtype(dtype))
    head = lambda d: pl.BlockSpec((None, None, d), lambda b, h: (b, h, 0))  # noqa: E731
    ql, qr, meta, latent, k_rope = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((B, Hp, R), dtype), jax.ShapeDtypeStruct((B, Hp, r), dtype),
                   jax.ShapeDtypeStruct((B, 4), jnp.int32), jax.ShapeDtypeStruct(latent.shape, latent.dtype),
                   jax.ShapeDtypeStruct(k_rope.shape, k_rope.dtype)],
        grid=(B, Hp),
        in_specs=[full(i) for i in idx] + [row(1), row(1), row(H, n + r), row(R + r), full(w_kvb), full(gamma),
                                           cache(latent), cache(k_rope)],
        out_specs=[head(R), head(r), row(4), cache(latent), cache(k_rope)],
        input_output_aliases={len(idx) + 6: 3, len(idx) + 7: 4},
        compiler_params=pltr.CompilerParams(num_warps=TUNING["warps"], num_stages=1),
        interpret=interpret, name="mla_decode_prep",
    )(*idx, lo.astype(jnp.int32)[:, None], q_seg.astype(jnp.int32)[:, None], q, kv_a, w_kvb, gamma, latent, k_rope)
    return ql, qr, meta, latent, k_rope


def _finish_kernel(*refs, n_idx, NS, R, n, v, BR, gated, dtype):
    """Grid (b, h). refs: index operands [1] (w_kvb's layer); o_ref [NS, Hp, R], m_ref / l_ref
    [NS, Hp] (row b); w_ref [Lw, R, H, n+v]; (g_ref [H*v], row b); out_ref [H*v] (row b)."""
    idx_refs = refs[:n_idx]
    o_ref, m_ref, l_ref, w_ref, *rest = refs[n_idx:]
    g_ref, out_ref = (rest if gated else (None, rest[0]))
    lw = idx_refs[0][0]
    h = pl.program_id(1)
    C = SPLIT_CHUNK
    rnd = lambda a: a.astype(dtype).astype(F32)  # noqa: E731

    def chunk(s):
        return pl.ds(pl.multiple_of(s * C, C), C)

    top = jax.lax.fori_loop(0, NS // C, lambda s, t: jnp.maximum(t, jnp.max(m_ref[chunk(s), h])),
                            jnp.full((), -jnp.inf, F32))

    def weights(s):
        return jnp.exp(m_ref[chunk(s), h] - top) * (l_ref[chunk(s), h] > 0)

    den = jax.lax.fori_loop(0, NS // C, lambda s, d: d + jnp.sum(weights(s) * l_ref[chunk(s), h]), jnp.zeros((), F32))
    safe = jnp.where(den > 0, den, 1.0)
    out = jnp.zeros((v,), F32)
    for c in range(R // BR):
        cols = pl.ds(c * BR, BR)
        num = jax.lax.fori_loop(0, NS // C, lambda s, a, cols=cols: a + jnp.sum(
            weights(s)[:, None] * o_ref[chunk(s), h, cols], axis=0), jnp.zeros((BR,), F32))
        o_lat = rnd(jnp.where(den > 0, num / safe, 0.0))
        out = out + jnp.sum(o_lat[:, None] * rnd(w_ref[lw, cols, h, pl.ds(n, v)]), axis=0)
    out = rnd(out)
    heads = pl.ds(pl.multiple_of(h * v, v), v)
    if gated:
        out = rnd(out * jax.nn.sigmoid(g_ref[heads]))
    out_ref[heads] = out.astype(out_ref.dtype)


def mla_decode_finish(o, m, l, w_kvb, g, *, nope: int, dtype, layer=0, interpret: bool = False):
    """The finish kernel (module docstring). o [B, NS, Hp, R], m / l [B, NS, Hp] (NS a multiple
    of SPLIT_CHUNK); w_kvb [R, H, n+v] or [Lw, ...] (`layer`); g [B, H*v] fp32 or None.
    -> [B, H*v] in dtype."""
    B, NS, Hp, R = o.shape
    w_kvb = w_kvb if w_kvb.ndim == 4 else w_kvb[None]
    H, v = w_kvb.shape[2], w_kvb.shape[3] - nope
    if NS % SPLIT_CHUNK:
        raise ValueError(f"mla_decode_finish: {NS} splits, not a multiple of {SPLIT_CHUNK}")
    idx, _ = index_operands([layer])
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731
    row = lambda *shape: pl.BlockSpec((None,) + shape, lambda b, h: (b,) + (0,) * len(shape))  # noqa: E731
    gated = g is not None
    kernel = functools.partial(_finish_kernel, n_idx=len(idx), NS=NS, R=R, n=nope, v=v,
                               BR=min(TUNING["block_r"], R), gated=gated, dtype=jnp.dtype(dtype))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((B, H * v), dtype),
        grid=(B, H),
        in_specs=[full(i) for i in idx] + [row(NS, Hp, R), row(NS, Hp), row(NS, Hp), full(w_kvb)]
        + ([row(H * v)] if gated else []),
        out_specs=row(H * v),
        compiler_params=pltr.CompilerParams(num_warps=TUNING["warps"], num_stages=1),
        interpret=interpret, name="mla_decode_finish",
    )(*idx, o, m, l, w_kvb, *([g] if gated else []))


def mla_decode_prep_reference(q, kv_a, w_kvb, gamma, latent, k_rope, *, index, layer, lo, q_seg, eps: float, dtype,
                              layers=(0, 0)):
    """The plain form of `mla_decode_prep`."""
    L, B, S, R = latent.shape
    H, r = q.shape[1], k_rope.shape[-1]
    n = q.shape[2] - r
    Hp = pow2_at_least(H)
    w = (w_kvb if w_kvb.ndim == 3 else w_kvb[layers[0]]).astype(dtype)
    g = gamma.reshape(-1, R)[layers[1]]
    q = q.astype(dtype)
    ql = jnp.einsum("bhn,rhn->bhr", q[..., :n], w[..., :n], preferred_element_type=F32,
                    precision=jax.lax.Precision.HIGHEST).astype(dtype)
    pad = lambda a: jnp.pad(a, ((0, 0), (0, Hp - H), (0, 0)))  # noqa: E731
    kv = kv_a.astype(dtype)
    c32 = kv[:, :R].astype(F32)
    c = (c32 * jax.lax.rsqrt(jnp.mean(c32 * c32, -1, keepdims=True) + eps)).astype(dtype) * g.astype(dtype)
    latent = jax.lax.dynamic_update_slice(latent, c[None, :, None].astype(latent.dtype), (layer, 0, index, 0))
    k_rope = jax.lax.dynamic_update_slice(k_rope, kv[None, :, None, R:].astype(k_rope.dtype), (layer, 0, index, 0))
    meta = jnp.stack([jnp.full((B,), layer, jnp.int32), jnp.full((B,), index, jnp.int32), lo.astype(jnp.int32),
                      q_seg.astype(jnp.int32)], axis=1)
    return pad(ql), pad(q[..., n:]), meta, latent, k_rope


def mla_decode_finish_reference(o, m, l, w_kvb, g, *, nope: int, dtype, layer=0):
    """The plain form of `mla_decode_finish`."""
    w = (w_kvb if w_kvb.ndim == 3 else w_kvb[layer]).astype(dtype)
    H = w.shape[1]
    o_lat = merge_splits(o, m, l)[:, :H].astype(dtype)
    out = jnp.einsum("bhr,rhv->bhv", o_lat, w[..., nope:], preferred_element_type=F32,
                     precision=jax.lax.Precision.HIGHEST).astype(dtype)
    if g is not None:
        out = (out.astype(F32) * jax.nn.sigmoid(g.reshape(out.shape))).astype(dtype)
    return out.reshape(out.shape[0], -1)
