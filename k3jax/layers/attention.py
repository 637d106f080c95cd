"""Plain causal softmax attention with RoPE and GQA (the lineage's first stage), and the
pieces every cached attention shares: the heads-merging output projection, the cache
write and the decode mask.

With `model.attention.conv_size` W > 0, q, k and v each pass through the linear rungs'
causal depthwise short convolution + SiLU (k3jax.layers.conv.ShortConv, over each one's
flat [H*D] channels) before RoPE: the attention Zoology trains on MQAR, where a short conv
precedes every mixer. Its decode cache adds each conv's last W-1 inputs (conv_q/k/v).

Cache protocol (same as GatedMLA): `cache=None` is the training path; with a cache dict the
call writes its T tokens into slots [ctx.index, ctx.index+T) and token t attends to slots
s <= index+t whose ctx.kv_segment_ids equals its own segment id.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers import decode_gemv
from k3jax.layers.cache import DecodeContext, LayerCache
from k3jax.layers.common import EMBED, HEAD_DIM, HEADS, Dense, Dtypes
from k3jax.layers.conv import ShortConv
from k3jax.layers.rope import apply_rope
from k3jax.ops import causal_softmax_attention
from k3jax.layers import context_parallel as cp


class HeadsOutDense(Dense):
    """y = Σ_{h,e} o[..., h, e] W[h, e, :] for o [..., H, E], W [H, E, d]: an output projection
    that keeps the head axis in the kernel (so it shards by heads like the input side)."""

    def __init__(self, heads: int, head_dim: int, d_out: int, *, rngs: nnx.Rngs, std: float, dtypes: Dtypes):
        super().__init__(heads, (head_dim, d_out), (HEADS, HEAD_DIM, EMBED), rngs=rngs, std=std, dtypes=dtypes,
                         heads=heads)

    def __call__(self, o, out_dtype=None, residual=None):
        """Plus `residual` when given (see Dense)."""
        w = self.kernel[...]
        H, E, d = w.shape
        flat = o.reshape(o.shape[:-2] + (H * E,))
        if residual is not None:
            fast = decode_gemv.project(flat, [w], [self.compute], addends=[residual], round_dtype=self.compute,
                                       contract=2)
            return fast[0] if fast is not None else self(o) + residual
        fast = decode_gemv.project(flat, [w], [self.compute], out_dtypes=[out_dtype or self.compute], contract=2)
        if fast is not None:
            return fast[0]
        y = jnp.tensordot(o.astype(self.compute), w.astype(self.compute), axes=2, preferred_element_type=out_dtype)
        return y if out_dtype is not None else y.astype(self.compute)


def decode_mask(ctx: DecodeContext, segment_ids):
    """[B,T,S] bool: slot s is visible to query t (slot index+t) iff s <= index+t and it holds t's segment.

    Empty slots carry segment id -1 and so never match.
    """
    T, S = segment_ids.shape[1], ctx.kv_segment_ids.shape[1]
    q_slot = ctx.index + jnp.arange(T, dtype=jnp.int32)
    causal = jnp.arange(S, dtype=jnp.int32)[None, :] <= q_slot[:, None]
    same = ctx.kv_segment_ids[:, None, :] == segment_ids[:, :, None]
    return causal[None] & same


def masked_softmax(scores, mask):
    """Softmax over the last axis in fp32; masked entries get exactly zero weight.

    A finite fill (not -inf) keeps a fully masked row (a padding query) finite instead of NaN.
    """
    s = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    return jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)


class SoftmaxAttention(nnx.Module):
    """Causal softmax attention: RoPE on q and k, GQA when num_kv_heads < num_heads.

    params: q_proj [d,H,D], k_proj / v_proj [d,Hkv,D], o_proj [H,D,d]; with conv_size W > 0
    also q_conv1d [W,H*D], k_conv1d / v_conv1d [W,Hkv*D].
    cache: dict(k=[B,S,Hkv,D] (rotated), v=[B,S,Hkv,D]); with W > 0 also conv_q [B,W-1,H*D],
    conv_k / conv_v [B,W-1,Hkv*D] (the convs' pre-conv inputs, as the linear mixers keep them).
    """

    def __init__(self, model_cfg, *, rngs: nnx.Rngs):
        acfg = model_cfg.attention
        dt = Dtypes.of(model_cfg)
        std = model_cfg.init_std
        d = model_cfg.d_model
        self.num_heads = acfg.num_heads
        self.num_kv_heads = acfg.num_kv_heads or acfg.num_heads
        self.head_dim = model_cfg.head_dim("attention")
        self.rope_theta = float(acfg.rope_theta)
        self.attn_impl = acfg.impl
        self.compute = dt.compute
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = Dense(d, (H, D), (EMBED, HEADS, HEAD_DIM), rngs=rngs, std=std, dtypes=dt, heads=H)
        self.k_proj = Dense(d, (Hkv, D), (EMBED, HEADS, HEAD_DIM), rngs=rngs, std=std, dtypes=dt, heads=Hkv)
        self.v_proj = Dense(d, (Hkv, D), (EMBED, HEADS, HEAD_DIM), rngs=rngs, std=std, dtypes=dt, heads=Hkv)
        self.o_proj = HeadsOutDense(H, D, d, rngs=rngs, std=std, dtypes=dt)
        self.conv_size = acfg.conv_size
        if acfg.conv_size:  # drawn after the projections: they initialise as without the convs
            self.q_conv1d = ShortConv(H * D, acfg.conv_size, rngs=rngs, impl=acfg.conv_impl)
            self.k_conv1d = ShortConv(Hkv * D, acfg.conv_size, rngs=rngs, impl=acfg.conv_impl)
            self.v_conv1d = ShortConv(Hkv * D, acfg.conv_size, rngs=rngs, impl=acfg.conv_impl)

    def init_cache(self, batch: int, max_len: int, dtype) -> dict:
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        cache = dict(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
        if self.conv_size:
            for name, heads in (("q", self.num_heads), ("k", self.num_kv_heads), ("v", self.num_kv_heads)):
                cache[f"conv_{name}"] = jnp.zeros((batch, self.conv_size - 1, heads * self.head_dim), dtype)
        return cache

    def __call__(self, x, *, segment_ids, positions, cache=None, ctx: DecodeContext | None = None, residual=None):
        """(y, cache), plus `residual` when given (a decode step's residual stream)."""
        y, cache = self._forward(x, segment_ids=segment_ids, positions=positions, cache=cache, ctx=ctx)
        return (y if residual is None else y + residual), cache

    def _short_convs(self, q, k, v, segment_ids, view: LayerCache | None, ctx: DecodeContext | None):
        """q [B,T,H,D], k / v [B,T,Hkv,D] through their short convs (+ SiLU) -> (q, k, v, view with
        the next windows). A row whose first token starts a new segment starts from an empty
        window; under context parallelism each shard takes its halo from the upstream one."""
        B, T = q.shape[:2]
        mesh = cp.context_mesh() if view is None else None
        if not cp.splits(mesh, T, self.conv_size - 1):
            mesh = None
        fresh = None if view is None else segment_ids[:, 0] != ctx.prev_segment_ids
        out = []
        for name, h in (("q", q), ("k", k), ("v", v)):
            conv = getattr(self, f"{name}_conv1d")
            flat = h.reshape(B, T, -1)
            prev = None if view is None else jnp.where(fresh[:, None, None], 0, view.get(f"conv_{name}"))
            if mesh is not None:
                y, window = cp.short_conv(conv.weight[...], flat, segment_ids, prev, mesh, impl=conv.impl)
            else:
                y, window = conv(flat, segment_ids, prev)
            if view is not None:
                view = view.put(f"conv_{name}", window)
            out.append(y.reshape(h.shape))
        return (*out, view)

    def _forward(self, x, *, segment_ids, positions, cache=None, ctx: DecodeContext | None = None):
        """x [B,T,d] (the input_layernorm output), segment_ids / positions [B,T] -> (y [B,T,d], cache)."""
        if cache is not None and ctx is None:
            raise ValueError("SoftmaxAttention: a cache needs a DecodeContext")
        view, single = LayerCache.of(cache) if cache is not None else (None, False)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.conv_size:
            q, k, v, view = self._short_convs(q, k, v, segment_ids, view, ctx)
        q = apply_rope(q, positions, self.rope_theta)
        k = apply_rope(k, positions, self.rope_theta)
        scale = self.head_dim ** -0.5
        if cache is None:
            mesh = cp.context_mesh()
            if cp.splits(mesh, x.shape[1]):  # context parallel: gather k, v
                o = cp.attention(q, cp.gather_tokens(k, mesh), cp.gather_tokens(v, mesh), segment_ids, scale=scale,
                                 mesh=mesh, kv_segment_ids=cp.gather_tokens(segment_ids, mesh))
            else:
                o = causal_softmax_attention(q, k, v, scale=scale, segment_ids=segment_ids, impl=self.attn_impl)
            return self.o_proj(o), None
        view = view.write_tokens("k", k, ctx.index).write_tokens("v", v, ctx.index)
        B, T = x.shape[:2]
        Hkv, rep = self.num_kv_heads, self.num_heads // self.num_kv_heads
        qg = q.reshape(B, T, Hkv, rep, self.head_dim)  # query head h uses kv head h // rep
        kc, vc = view.get("k").astype(self.compute), view.get("v").astype(self.compute)
        s = jnp.einsum("btgrd,bsgd->bgrts", qg, kc, preferred_element_type=jnp.float32) * scale
        p = masked_softmax(s, decode_mask(ctx, segment_ids)[:, None, None])
        o = jnp.einsum("bgrts,bsgd->btgrd", p.astype(self.compute), vc, preferred_element_type=jnp.float32)
        o = o.reshape(B, T, self.num_heads, self.head_dim).astype(self.compute)
        return self.o_proj(o), view.result(single)
