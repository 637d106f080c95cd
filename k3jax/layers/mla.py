"""Gated multi-head latent attention: DeepSeek-V3's MLA plus a sigmoid output gate.

Training / no cache: the expanded form (per-head keys and values decompressed from the
latent, HF DeepSeek-V3 layout), K_h = [k^n_h ; k^p], Q_h = [q^n_h ; q^p_h], through
`causal_softmax_attention`. With a cache: the absorbed form (W_UK folded into the query,
W_UV applied after attention), an MQA over the cached [c (R_kv) ; k^p (r)] per token, so
the cache holds R_kv + r values per token instead of H·(n+r+v). Both end with the sigmoid
output gate and o_proj.

Decoding and chunked prefill on the kernel path (`model.decode_impl`, k3jax/ops/decode_kernels):
a decode step reads the latent cache once, in place, in the absorbed form (flash decoding); a
prefill chunk is bound by FLOPs, not bytes, so it expands the cached latent into per-head keys
and values (one GEMM) and runs a flash kernel over them (320 multiply-adds per query, key and
head against the absorbed form's 576 at k3-small's shapes).

Shapes: H heads, n = qk_nope_head_dim, r = qk_rope_head_dim, v = v_head_dim,
R_q = q_lora_rank, R_kv = kv_lora_rank.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3jax.layers import decode_gemv
from k3jax.layers.attention import HeadsOutDense, decode_mask, masked_softmax
from k3jax.layers.cache import DecodeContext, LayerCache
from k3jax.layers.common import EMBED, HEAD_DIM, HEADS, LORA, Dense, Dtypes
from k3jax.layers.norms import RMSNorm
from k3jax.layers.rope import apply_rope
from k3jax.ops import causal_softmax_attention
from k3jax.ops.context_attn import blocked_attention
from k3jax.ops.decode_kernels import mla_decode, mla_layer, mla_prefill
from k3jax.ops.decode_kernels.common import interpret, log_once, resolve_impl
from k3jax.ops.remat_names import ATTENTION_OUT
from k3jax.ops.softmax_attn import causal_max_logits
from k3jax.layers import context_parallel as cp


def prefix_sizes(S: int, T: int, growth: int = 8, align: int = 64) -> list[int]:
    """Static prefix lengths a prefill chunk of T tokens expands (ascending, the last = S): from
    the first multiple of `align` >= T, times `growth` each, so at most growth x the slots a
    chunk can see are expanded."""
    sizes, P = [], -(-T // align) * align
    while P < S:
        sizes.append(P)
        P *= growth
    return sizes + [S]


def mla_cache_bytes_per_token(model_cfg, dtype_bytes: int = 2) -> int:
    """Decode cache per token per MLA layer: the latent c and the shared key k^p."""
    return (model_cfg.mla.kv_lora_rank + model_cfg.mla.qk_rope_head_dim) * dtype_bytes


class GatedMLA(nnx.Module):
    """params (kernels [in, out]): q_a_proj [d,R_q], q_a_layernorm [R_q], q_b_proj [R_q,H,n+r]
    (or q_proj [d,H,n+r] when R_q == 0), kv_a_proj_with_mqa [d,R_kv+r], kv_a_layernorm [R_kv],
    kv_b_proj [R_kv,H,n+v] (per head: W_UK then W_UV), g_proj [d,H,v], o_proj [H,v,d].
    cache: dict(latent=[B,S,R_kv], k_rope=[B,S,r]).
    """

    def __init__(self, model_cfg, *, rngs: nnx.Rngs):
        m = model_cfg.mla
        dt = Dtypes.of(model_cfg)
        std, eps, d = model_cfg.init_std, model_cfg.rms_norm_eps, model_cfg.d_model
        self.num_heads, self.v_dim = m.num_heads, m.v_head_dim
        self.nope, self.rope = m.qk_nope_head_dim, m.qk_rope_head_dim
        self.kv_rank = m.kv_lora_rank
        self.use_rope, self.rope_theta = bool(m.use_rope), float(m.rope_theta)
        self.compute = dt.compute
        H, qk = m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
        self.q_lora = m.q_lora_rank > 0
        if self.q_lora:
            self.q_a_proj = Dense(d, m.q_lora_rank, (EMBED, LORA), rngs=rngs, std=std, dtypes=dt)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps=eps, axis_name=LORA)
            self.q_b_proj = Dense(m.q_lora_rank, (H, qk), (LORA, HEADS, HEAD_DIM), rngs=rngs, std=std, dtypes=dt,
                                  heads=H)
        else:
            self.q_proj = Dense(d, (H, qk), (EMBED, HEADS, HEAD_DIM), rngs=rngs, std=std, dtypes=dt, heads=H)
        self.kv_a_proj_with_mqa = Dense(d, m.kv_lora_rank + m.qk_rope_head_dim, (EMBED, LORA),
                                        rngs=rngs, std=std, dtypes=dt)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps=m.kv_norm_eps or eps, axis_name=LORA)
        self.kv_b_proj = Dense(m.kv_lora_rank, (H, m.qk_nope_head_dim + m.v_head_dim), (LORA, HEADS, HEAD_DIM),
                               rngs=rngs, std=std, dtypes=dt, heads=H)
        self.output_gate = bool(m.output_gate)
        self.attn_impl = m.impl
        self.decode_impl = model_cfg.decode_impl
        if self.output_gate:
            self.g_proj = Dense(d, (H, m.v_head_dim), (EMBED, HEADS, HEAD_DIM), rngs=rngs, std=std, dtypes=dt, heads=H)
        self.o_proj = HeadsOutDense(H, m.v_head_dim, d, rngs=rngs, std=std, dtypes=dt)

    def init_cache(self, batch: int, max_len: int, dtype) -> dict:
        return dict(latent=jnp.zeros((batch, max_len, self.kv_rank), dtype),
                    k_rope=jnp.zeros((batch, max_len, self.rope), dtype))

    def _decode_projections(self, x) -> dict | None:
        """In a decode step (k3jax.layers.decode_gemv), the projections of x in one gemv launch:
        q_a (or q), kv_a and the output gate's logits (fp32). None elsewhere."""
        if not decode_gemv.active():
            return None
        denses, outs = self._input_projections()
        ys = decode_gemv.dense_group(x, denses, out_dtypes=outs)
        return dict(zip(("q", "kv_a", "g"), ys))

    def _input_projections(self):
        """The projections of the layer's input x, (q_a or q, kv_a[, g]), and their output dtypes
        (the output gate's logits in fp32; None: the Dense's own)."""
        denses = [self.q_a_proj if self.q_lora else self.q_proj, self.kv_a_proj_with_mqa]
        outs = [None, None]
        if self.output_gate:
            denses.append(self.g_proj)
            outs.append(jnp.float32)
        return denses, outs

    def _project(self, x, positions, pre: dict | None = None):
        """x [B,T,d] -> q_nope [B,T,H,n], q_rope [B,T,H,r], c [B,T,R_kv] (normalised), k_rope [B,T,r].
        pre: `_decode_projections(x)`."""
        if self.q_lora:
            q_a = self.q_a_proj(x) if pre is None else pre["q"]
            q = decode_gemv.dense_group(q_a, [self.q_b_proj], norm=self.q_a_layernorm)[0]
        else:
            q = self.q_proj(x) if pre is None else pre["q"]
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope:]
        ckv = self.kv_a_proj_with_mqa(x) if pre is None else pre["kv_a"]
        c, k_rope = self.kv_a_layernorm(ckv[..., : self.kv_rank]), ckv[..., self.kv_rank:]
        if self.use_rope:
            q_rope = apply_rope(q_rope, positions, self.rope_theta)
            k_rope = apply_rope(k_rope, positions, self.rope_theta)
        return q_nope, q_rope, c, k_rope

    def _gate_out(self, o, x, pre: dict | None = None):
        """o [B,T,H,v] -> y [B,T,d]: o ⊙ σ(g_proj x) (sigmoid in fp32), then o_proj."""
        if self.output_gate:
            g = jax.nn.sigmoid(self.g_proj(x, out_dtype=jnp.float32) if pre is None else pre["g"])
            o = (o.astype(jnp.float32) * g).astype(self.compute)
        return self.o_proj(o)

    def __call__(self, x, *, segment_ids, positions, cache=None, ctx: DecodeContext | None = None,
                 max_logits: bool = False, residual=None):
        """x [B,T,d] (the input_layernorm output), segment_ids / positions [B,T] -> (y [B,T,d], cache).

        max_logits (static; training path only): also return each head's largest scaled
        pre-softmax logit over the batch and the pairs it may attend, [H] fp32 without a
        gradient (QK-Clip's statistic), as a third output.
        """
        if cache is not None and x.shape[1] == 1 and decode_gemv.active():
            out = self._decode_layer(x, segment_ids, cache, ctx, residual)  # two kernels around the attention
            if out is not None:
                return out
        if residual is not None:  # (decode only): the general path, then the add
            y, cache = self(x, segment_ids=segment_ids, positions=positions, cache=cache, ctx=ctx)
            return y + residual, cache
        pre = self._decode_projections(x) if cache is not None and x.shape[1] == 1 else None
        q_nope, q_rope, c, k_rope = self._project(x, positions, pre)
        scale = (self.nope + self.rope) ** -0.5
        if cache is None:
            mesh = cp.context_mesh()
            if not cp.splits(mesh, x.shape[1]):
                mesh = None
            if mesh is not None:
                y = self._context_parallel(q_nope, q_rope, c, k_rope, x, segment_ids, scale, mesh)
                if max_logits:  # QK-Clip's statistic (no gradient) from the whole row's keys
                    c_all, kr_all = cp.gather_tokens(c, mesh), cp.gather_tokens(k_rope, mesh)
                    k = self._keys(c_all, kr_all, self.kv_b_proj.kernel[...])
                    q = jnp.concatenate([q_nope, q_rope], axis=-1)
                    return y, None, causal_max_logits(q, k[0], scale=scale, segment_ids=segment_ids)
                return y, None
            kv = self.kv_b_proj(c)
            k_nope, v = kv[..., : self.nope], kv[..., self.nope:]
            k_rope_h = jnp.broadcast_to(k_rope[:, :, None, :], k_nope.shape[:3] + (self.rope,))
            q = jnp.concatenate([q_nope, q_rope], axis=-1)
            k = jnp.concatenate([k_nope, k_rope_h], axis=-1)
            o = causal_softmax_attention(q, k, v, scale=scale, segment_ids=segment_ids, impl=self.attn_impl)
            o = checkpoint_name(o, ATTENTION_OUT)  # kept by remat=save_dots (k3jax.ops.remat_names)
            y = self._gate_out(o, x)
            if max_logits:
                return y, None, causal_max_logits(q, k, scale=scale, segment_ids=segment_ids)
            return y, None
        if max_logits:
            raise ValueError("GatedMLA: max_logits is collected on the training path only (no cache)")
        if ctx is None:
            raise ValueError("GatedMLA: a cache needs a DecodeContext")
        view, single = LayerCache.of(cache)
        view = view.write_tokens("latent", c, ctx.index).write_tokens("k_rope", k_rope, ctx.index)
        if q_nope.shape[1] == 1:
            o = self._decode(q_nope, q_rope, view, ctx, segment_ids, scale)
        else:
            o = self._prefill(q_nope, q_rope, view, ctx, segment_ids, scale)
        return self._gate_out(o, x, pre), view.result(single)

    def _decode_layer(self, x, segment_ids, cache, ctx, residual=None):
        """A decode step (one token per row, the decode kernels on) in six launches: the input
        projections (one gemv), q_b with its norm (one gemv), `mla_decode_prep` (W_UK into the
        query, the latent's norm and the cache write), the latent attention, `mla_decode_finish`
        (the splits' merge, W_UV, the output gate) and o_proj. None where these kernels do not
        apply (RoPE, shapes they do not take): the caller takes the general path."""
        view, single = LayerCache.of(cache)
        lat, kr = view.stacked("latent"), view.stacked("k_rope")
        H, B = self.num_heads, x.shape[0]
        q_probe = jax.ShapeDtypeStruct((B, H, self.kv_rank), self.compute)
        if (self.use_rope or mla_layer.unsupported_reason(self.kv_rank, self.rope, self.nope, self.v_dim)
                or mla_decode.unsupported_reason(q_probe, lat, kr)):
            return None
        first, outs = self._input_projections()
        ys = decode_gemv.project(x, [d.kernel[...] for d in first], [d.compute for d in first])
        if ys is None:  # more rows than the gemv kernel takes: XLA's dots
            ys = [d(x, out_dtype=o) for d, o in zip(first, outs)]
        q, kv_a = ys[0], ys[1]
        if self.q_lora:
            norm = self.q_a_layernorm
            fast = decode_gemv.project(q, [self.q_b_proj.kernel[...]], [self.q_b_proj.compute], norm=norm.weight[...],
                                       eps=norm.eps, x_dtype=self.compute)
            q = fast[0] if fast is not None else self.q_b_proj(norm(q.astype(self.compute)))
        w, lw = decode_gemv.stacked(self.kv_b_proj.kernel[...])  # read in place (decode_gemv.stacked)
        gamma, lg = decode_gemv.stacked(self.kv_a_layernorm.weight[...])
        lo = jnp.zeros((B,), jnp.int32) if ctx.first_slot is None else ctx.first_slot
        q_lat, q_rope, meta, lat, kr = mla_layer.mla_decode_prep(
            q[:, 0], kv_a[:, 0], w, gamma, lat, kr, index=ctx.index, layer=view.layer, lo=lo, q_seg=segment_ids[:, 0],
            eps=self.kv_a_layernorm.eps, dtype=self.compute, layers=(lw, lg), interpret=interpret())
        o, m, l = mla_decode.latent_decode_partials(q_lat, q_rope, lat, kr, ctx.kv_segment_ids, meta,
                                                    scale=(self.nope + self.rope) ** -0.5,
                                                    split_multiple=mla_layer.SPLIT_CHUNK, interpret=interpret())
        g = ys[2][:, 0].reshape(B, -1) if self.output_gate else None
        out = mla_layer.mla_decode_finish(o, m, l, w, g, nope=self.nope, dtype=self.compute, layer=lw,
                                          interpret=interpret())
        view = view.put_stacked("latent", lat).put_stacked("k_rope", kr)
        return self.o_proj(out.reshape(B, 1, H, self.v_dim), residual=residual), view.result(single)

    def _kernels(self, why_not, *args) -> bool:
        """Whether the decode kernels run here (model.decode_impl), logging once why not."""
        if resolve_impl(self.decode_impl) != "pallas":
            return False
        why = why_not(*args)
        if why and self.decode_impl == "pallas":
            raise ValueError(f"model.decode_impl=pallas: the MLA kernel cannot run: {why}")
        if why:
            log_once(f"MLA decode: XLA path ({why})")
        return not why

    def _decode(self, q_nope, q_rope, view, ctx, segment_ids, scale):
        """One token per row: the absorbed form over the latent cache -> [B,1,H,v]."""
        w = self.kv_b_proj.kernel[...].astype(self.compute)  # [R_kv, H, n+v]
        w_uk, w_uv = w[..., : self.nope], w[..., self.nope:]
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk, preferred_element_type=jnp.float32).astype(self.compute)
        q_rope = q_rope.astype(self.compute)
        lat, kr = view.stacked("latent"), view.stacked("k_rope")
        if not self._kernels(mla_decode.unsupported_reason, q_lat, lat, kr):
            cache = {"latent": view.get("latent"), "k_rope": view.get("k_rope")}
            return self._absorbed(q_nope, q_rope, cache, ctx, segment_ids, scale)
        o_lat = mla_decode.latent_decode_attention(
            q_lat[:, 0], q_rope[:, 0], lat, kr, ctx.kv_segment_ids, segment_ids[:, 0], ctx.index, view.layer,
            scale=scale, lo=ctx.first_slot, interpret=interpret())
        o = jnp.einsum("bhr,rhv->bhv", o_lat.astype(self.compute), w_uv, preferred_element_type=jnp.float32)
        return o[:, None].astype(self.compute)

    def _prefill(self, q_nope, q_rope, view, ctx, segment_ids, scale):
        """A chunk of T > 1 tokens over the cache -> [B,T,H,v]: on the kernel path the expanded
        form (per-head keys and values from the latent, one GEMM; flash attention), else the
        absorbed form in blocks (`_absorbed`).

        Only the slots the chunk can see are expanded: the cache's first P slots, P the smallest
        of a few static sizes (`prefix_sizes`, x8 apart) holding index + T, one `lax.switch` branch each,
        so the work of a chunk follows its position, not the cache's allocated length."""
        lat, kr = view.get("latent"), view.get("k_rope")
        mesh = cp.context_mesh()
        shapes = [jax.ShapeDtypeStruct(s, self.compute) for s in
                  (q_nope.shape, q_rope.shape, lat.shape[:2] + q_nope.shape[2:], lat.shape[:2] + (self.num_heads,
                   self.v_dim), kr.shape)]
        if cp.splits(mesh, q_nope.shape[1]) or not self._kernels(mla_prefill.unsupported_reason, *shapes):
            return self._absorbed(q_nope, q_rope, {"latent": lat, "k_rope": kr}, ctx, segment_ids, scale)
        w = self.kv_b_proj.kernel[...].astype(self.compute)  # [R_kv, H, n+v]
        w_uk, w_uv = w[..., : self.nope], w[..., self.nope:]
        qn, qr = q_nope.astype(self.compute), q_rope.astype(self.compute)
        lat, kr = lat.astype(self.compute), kr.astype(self.compute)
        sizes = prefix_sizes(lat.shape[1], q_nope.shape[1])

        def attend(P, lat, kr, kv_seg, index, first_slot):
            lat, kr, kv_seg = lat[:, :P], kr[:, :P], kv_seg[:, :P]
            k_nope = jnp.einsum("bsr,rhd->bshd", lat, w_uk, preferred_element_type=self.compute)
            v = jnp.einsum("bsr,rhd->bshd", lat, w_uv, preferred_element_type=self.compute)
            return mla_prefill.expanded_prefill_attention(qn, qr, k_nope, v, kr, kv_seg, segment_ids, index,
                                                          first_slot, scale=scale, interpret=interpret())

        first = jnp.zeros(lat.shape[:1], jnp.int32) if ctx.first_slot is None else ctx.first_slot
        branch = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), ctx.index + q_nope.shape[1])
        return jax.lax.switch(jnp.minimum(branch, len(sizes) - 1),
                              [functools.partial(attend, P) for P in sizes],
                              lat, kr, ctx.kv_segment_ids, ctx.index, first)

    def _context_parallel(self, q_nope, q_rope, c, k_rope, x, segment_ids, scale, mesh):
        """Training path with tokens over mesh.context: gather the compressed latent and the
        shared rope key (576 values per token in K3), expand them to per-head keys and values on
        every shard, attend the shard's queries over them in blocks (k3jax.ops.context_attn).
        (Recomputing the expansion in the backward pass saved nothing in k3jax-plan at 1M: the
        peak is one layer's backward, which holds the expanded keys either way.)"""
        k, v = self._keys(cp.gather_tokens(c, mesh), cp.gather_tokens(k_rope, mesh), self.kv_b_proj.kernel[...])
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        o = cp.attention(q, k, v, segment_ids, scale=scale, mesh=mesh,
                         kv_segment_ids=cp.gather_tokens(segment_ids, mesh))
        return self._gate_out(o, x)

    def _keys(self, c, k_rope, w):
        """Latent c [B,S,R_kv] and rope key [B,S,r] -> per-head keys [B,S,H,n+r], values [B,S,H,v]
        (kv_b_proj's product with its kernel w, as a function of w)."""
        kv = jnp.tensordot(c.astype(self.compute), w.astype(self.compute), axes=1).astype(self.compute)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope:]
        k_rope_h = jnp.broadcast_to(k_rope[:, :, None, :], k_nope.shape[:3] + (self.rope,))
        return jnp.concatenate([k_nope, k_rope_h], axis=-1), v

    def _absorbed(self, q_nope, q_rope, cache, ctx, segment_ids, scale):
        """Attention in the latent space (the absorbed form): q̃_h = W_UK,hᵀ q^n_h, scores
        q̃·c + q^p·k^p, ō_h = Σ p c, o_h = W_UV,h ō_h. Products accumulate in fp32; softmax in fp32. -> [B,T,H,v]."""
        w = self.kv_b_proj.kernel[...].astype(self.compute)  # [R_kv, H, n+v]
        w_uk, w_uv = w[..., : self.nope], w[..., self.nope:]
        lat, kr = cache["latent"].astype(self.compute), cache["k_rope"].astype(self.compute)
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk, preferred_element_type=jnp.float32).astype(self.compute)
        T = q_nope.shape[1]
        if T > 1:
            # a prefill: an MQA with keys [c ; k^p] and values c over the whole cache, in blocks
            # (online softmax), never [T, S] scores; context-parallel when a mesh splits T
            args = (jnp.concatenate([q_lat, q_rope.astype(self.compute)], -1),
                    jnp.concatenate([lat, kr], -1)[:, :, None], lat[:, :, None])
            q_index = ctx.index + jnp.arange(T, dtype=jnp.int32)
            mesh = cp.context_mesh()
            if cp.splits(mesh, T):
                o_lat = cp.attention(*args, segment_ids, scale=scale, mesh=mesh, kv_segment_ids=ctx.kv_segment_ids,
                                     q_index=q_index)
            else:
                o_lat = blocked_attention(*args, q_index, jnp.arange(lat.shape[1], dtype=jnp.int32), segment_ids,
                                          ctx.kv_segment_ids, scale=scale)
            o = jnp.einsum("bthr,rhv->bthv", o_lat.astype(self.compute), w_uv, preferred_element_type=jnp.float32)
            return o.astype(self.compute)
        s = jnp.einsum("bthr,bsr->bhts", q_lat, lat, preferred_element_type=jnp.float32)
        s = s + jnp.einsum("bthp,bsp->bhts", q_rope, kr, preferred_element_type=jnp.float32)
        p = masked_softmax(s * scale, decode_mask(ctx, segment_ids)[:, None])
        # [B,H,T,R] order: XLA:CPU cannot run the bf16->fp32 dot that writes [B,T,H,R] directly
        o_lat = jnp.einsum("bhts,bsr->bhtr", p.astype(self.compute), lat, preferred_element_type=jnp.float32)
        o = jnp.einsum("bhtr,rhv->bthv", o_lat.astype(self.compute), w_uv, preferred_element_type=jnp.float32)
        return o.astype(self.compute)
