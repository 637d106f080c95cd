"""A decode step's Block AttnRes site and the RMSNorm after it, in one kernel per token.

    h = attnres_norm(blocks, num_blocks, prefix, (gamma_attn, w_attn), gamma, eps_attn=..., eps_norm=...)

Per token (k3jax/layers/attnres.py, `attn_res_mix`; k3jax/layers/norms.py, `rms_norm`):

    logit_i = <V_i, q> * rsqrt(mean(V_i^2) + eps_attn)     over the n valid blocks and the prefix
    mix     = sum_i softmax(logit)_i V_i                     fp32, cast to the prefix's dtype
    h       = cast(mix * rsqrt(mean(mix^2) + eps_norm)) * cast(gamma)     in the prefix's dtype

XLA runs this as five kernels per site at a decode step's one token (the logits' reductions, the
softmax's scalars, the mix, the norm's statistic, the norm): here one program per token reads
the NB blocks and the prefix once, in chunks of BD channels, and keeps the mix in registers
between the mix and the norm. Grid (tokens,).

Shapes: blocks [NB, N, d] (the block buffer, N tokens), num_blocks int32 scalar (valid blocks),
prefix [N, d]; the site's pseudo-query q = gamma_attn * w_attn, both [d] fp32, and the norm's
gamma [d] -> h [N, d] in prefix's dtype. d must be a multiple of 16. Each of the three vectors
may be given stacked, [L, d], with its layer (`layers`): a stage's stacked parameters, read in
place (see gemv.py).

`attnres_norm_reference` is the plain form (the formulas above in XLA, as the layers write them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from k3jax.ops.decode_kernels.common import block_dividing, index_operands

F32 = jnp.float32
TUNING = {"block_d": 512, "warps": 4}


def unsupported_reason(blocks, prefix) -> str | None:
    d = prefix.shape[-1]
    if block_dividing(d, (512, 256, 128, 64, 32, 16)) is None:
        return f"d_model={d} is not a multiple of 16"
    if blocks.shape[1:] != prefix.shape:
        return f"blocks {blocks.shape} do not match the prefix {prefix.shape}"
    return None


def _kernel(*refs, n_idx, pos, NB, d, BD, eps_attn, eps_norm):
    """refs: n_idx index operands [1] (the layers of gamma_attn, w_attn, gamma at `pos`); n_ref
    [1]; blocks_ref [NB, d]; prefix_ref [d]; ga_ref, wa_ref, g_ref [L, d]; o_ref [d]."""
    idx_refs = refs[:n_idx]
    n_ref, blocks_ref, prefix_ref, ga_ref, wa_ref, g_ref, o_ref = refs[n_idx:]
    n = n_ref[0]
    la, lw, lg = (idx_refs[p][0] for p in pos)
    dt = prefix_ref.dtype
    chunks = [pl.ds(c * BD, BD) for c in range(d // BD)]
    qs = [ga_ref[la, c].astype(F32) * wa_ref[lw, c].astype(F32) for c in chunks]

    def logit(load):
        dot, ss = jnp.zeros((), F32), jnp.zeros((), F32)
        for c, q in zip(chunks, qs):
            v = load(c).astype(F32)
            dot, ss = dot + jnp.sum(v * q), ss + jnp.sum(v * v)
        return dot * jax.lax.rsqrt(ss / d + eps_attn)

    lp = logit(lambda c: prefix_ref[c])
    lb = [jnp.where(i < n, logit(lambda c, i=i: blocks_ref[i, c]), -jnp.inf) for i in range(NB)]
    m = lp
    for lv in lb:
        m = jnp.maximum(m, lv)
    eb = [jnp.exp(lv - m) for lv in lb]
    ep = jnp.exp(lp - m)
    z = ep
    for e in eb:
        z = z + e
    inv_z = 1.0 / z
    wb, wp = [e * inv_z for e in eb], ep * inv_z
    hs, ss = [], jnp.zeros((), F32)
    for c in chunks:
        out = wp * prefix_ref[c].astype(F32)
        for i in range(NB):  # the order of attn_res_mix's sum
            out = out + wb[i] * blocks_ref[i, c].astype(F32)
        h = out.astype(dt).astype(F32)
        hs.append(h)
        ss = ss + jnp.sum(h * h)
    r = jax.lax.rsqrt(ss / d + eps_norm)
    for c, h in zip(chunks, hs):
        o_ref[c] = ((h * r).astype(dt) * g_ref[lg, c].astype(dt)).astype(o_ref.dtype)


def attnres_norm(blocks, num_blocks, prefix, query, gamma, *, eps_attn: float, eps_norm: float, layers=None,
                 interpret: bool = False):
    """The kernel (module docstring). blocks [NB, N, d], prefix [N, d], query = (gamma_attn,
    w_attn), gamma: [d] or [L, d] with layers = (3 int32 scalars) -> [N, d]."""
    why = unsupported_reason(blocks, prefix)
    if why:
        raise ValueError(f"attnres_norm: {why}")
    NB, N, d = blocks.shape
    BD = block_dividing(d, (TUNING["block_d"], 256, 128, 64, 32, 16))
    vecs = [v.reshape(-1, d) for v in (*query, gamma)]
    idx, pos = index_operands(layers or (0, 0, 0))
    kernel = functools.partial(_kernel, n_idx=len(idx), pos=tuple(pos), NB=NB, d=d, BD=BD, eps_attn=float(eps_attn),
                               eps_norm=float(eps_norm))
    full = lambda *shape: pl.BlockSpec(shape, lambda t: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((N, d), prefix.dtype),
        grid=(N,),
        in_specs=[full(1)] * len(idx) + [full(1), pl.BlockSpec((NB, None, d), lambda t: (0, t, 0)),
                  pl.BlockSpec((None, d), lambda t: (t, 0))] + [full(*v.shape) for v in vecs],
        out_specs=pl.BlockSpec((None, d), lambda t: (t, 0)),
        compiler_params=pltr.CompilerParams(num_warps=TUNING["warps"], num_stages=1),
        interpret=interpret, name="attnres_norm",
    )(*idx, jnp.reshape(num_blocks, (1,)).astype(jnp.int32), blocks, prefix, *vecs)


def attnres_norm_reference(blocks, num_blocks, prefix, query, gamma, *, eps_attn: float, eps_norm: float,
                           layers=None):
    """The plain form: the formulas of the module docstring in XLA."""
    layers = layers or (0, 0, 0)
    ga, wa, g = (v.reshape(-1, prefix.shape[-1])[i] for v, i in zip((*query, gamma), layers))
    q = ga.astype(F32) * wa.astype(F32)

    def logit(v):
        v32 = v.astype(F32)
        return jnp.sum(v32 * q, axis=-1) * jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1) + eps_attn)

    lb = jnp.where((jnp.arange(blocks.shape[0]) < num_blocks)[:, None], logit(blocks), -jnp.inf)
    w = jax.nn.softmax(jnp.concatenate([logit(prefix)[None], lb]), axis=0)
    mix = jnp.einsum("s...,s...d->...d", w, jnp.concatenate([prefix[None], blocks]).astype(F32),
                     precision=jax.lax.Precision.HIGHEST).astype(prefix.dtype)
    m32 = mix.astype(F32)
    r = jax.lax.rsqrt(jnp.mean(m32 * m32, axis=-1, keepdims=True) + eps_norm)
    return (m32 * r).astype(prefix.dtype) * g.astype(prefix.dtype)
