"""Block Attention Residuals (arXiv 2603.15031): softmax attention over depth.

A site mixes the completed block representations b_0..b_{n-1} and the current
in-block partial sum p, per token:

    logit_i = <rmsnorm(V_i), gamma * w>   (weightless norm, fp32)
    out     = sum_i softmax(logit)_i V_i  (the RAW sources)

The blocks live in a fixed buffer [NB, B, T, d] with a count n (so the state can be
carried through a scan over layers); slots >= n are masked out. The pseudo-query
gamma * w starts at zero (w = 0), so the first step averages the sources.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers import decode_gemv
from k3jax.layers.common import EMBED, fill_param
from k3jax.layers.norms import rms_normalize
from k3jax.ops.decode_kernels import attnres_norm
from k3jax.ops.decode_kernels.common import interpret


def attn_res_mix(blocks, num_blocks, prefix, query, eps: float):
    """blocks [NB,B,T,d]; num_blocks int32 scalar (valid slots); prefix [B,T,d]; query [d] fp32.

    Returns [B,T,d] in prefix's dtype. With num_blocks == 0 it returns prefix exactly.

    Written as elementwise products and reductions, never as a dot_general: each source's
    logit <rmsnorm(V), q> is <V, q> * rsqrt(mean(V^2) + eps), two fp32 reductions over one
    read of V in its own dtype (no normalised fp32 copy of the blocks), and the mix is an
    unrolled sum over the NB slots, one elementwise pass that reads each block once. As
    einsums, XLA:GPU ran the depth contraction as fp32 (TF32) batched GEMMs with K = NB and
    materialised the normalised blocks in fp32 for a GEMV (BENCHMARKS.md section 4).
    """
    q = query.astype(jnp.float32)

    def logit(v):
        v32 = v.astype(jnp.float32)
        return jnp.sum(v32 * q, axis=-1) * jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1) + eps)

    lb, lp = logit(blocks), logit(prefix)  # [NB,B,T], [B,T]
    valid = (jnp.arange(blocks.shape[0]) < num_blocks)[:, None, None]
    lb = jnp.where(valid, lb, -jnp.inf)
    m = jnp.maximum(jnp.max(lb, axis=0), lp)
    eb, ep = jnp.exp(lb - m), jnp.exp(lp - m)
    inv_z = 1.0 / (jnp.sum(eb, axis=0) + ep)
    wb, wp = eb * inv_z, ep * inv_z
    out = wp[..., None] * prefix.astype(jnp.float32)
    for i in range(blocks.shape[0]):  # NB is static and small (K3: 8)
        out = out + wb[i][..., None] * blocks[i].astype(jnp.float32)
    return out.astype(prefix.dtype)


def attn_res_mix_reference(blocks, num_blocks, prefix, query, eps: float):
    """The plain form (normalise in fp32, then einsums): what `attn_res_mix` computes."""
    q = query.astype(jnp.float32)
    lb = jnp.einsum("nbtd,d->nbt", rms_normalize(blocks, eps), q)
    lp = jnp.einsum("btd,d->bt", rms_normalize(prefix, eps), q)
    valid = (jnp.arange(blocks.shape[0]) < num_blocks)[:, None, None]
    lb = jnp.where(valid, lb, -jnp.inf)
    m = jnp.maximum(jnp.max(lb, axis=0), lp)
    eb, ep = jnp.exp(lb - m), jnp.exp(lp - m)
    z = jnp.sum(eb, axis=0) + ep
    mixed = jnp.einsum("nbt,nbtd->btd", eb / z, blocks.astype(jnp.float32))
    out = mixed + (ep / z)[..., None] * prefix.astype(jnp.float32)
    return out.astype(prefix.dtype)


class AttnResSite(nnx.Module):
    """One AttnRes site: `norm.weight` gamma [d] (init 1) and `proj.kernel` w [d, 1] (init 0)."""

    def __init__(self, d_model: int, *, eps: float):
        self.norm = nnx.Dict(weight=fill_param((d_model,), (EMBED,), 1.0))
        self.proj = nnx.Dict(kernel=fill_param((d_model, 1), (EMBED, None), 0.0))
        self.eps = eps

    def __call__(self, blocks, num_blocks, prefix):
        query = self.norm["weight"][...] * self.proj["kernel"][...][:, 0]
        return attn_res_mix(blocks, num_blocks, prefix, query, self.eps)

    def mix_norm(self, blocks, num_blocks, prefix, norm):
        """norm(self(blocks, num_blocks, prefix)) for the RMSNorm module `norm`: in a decode step
        (k3jax.layers.decode_gemv) one kernel per token (k3jax/ops/decode_kernels/attnres_norm.py),
        else the two plain calls."""
        if decode_gemv.active() and attnres_norm.unsupported_reason(blocks, prefix) is None:
            NB, d = blocks.shape[0], prefix.shape[-1]
            N = math.prod(prefix.shape[:-1])
            # the parameters in place in their stage's stacked arrays (decode_gemv.stacked)
            (ga, la), (wa, lw), (g, lg) = (decode_gemv.stacked(v) for v in (
                self.norm["weight"][...], self.proj["kernel"][...], norm.weight[...]))
            out = attnres_norm.attnres_norm(blocks.reshape(NB, N, d), num_blocks, prefix.reshape(N, d), (ga, wa), g,
                                            eps_attn=self.eps, eps_norm=norm.eps, layers=(la, lw, lg),
                                            interpret=interpret())
            return out.reshape(prefix.shape)
        return norm(self(blocks, num_blocks, prefix))


def push_block(blocks, num_blocks, prefix):
    """Close the current block: write prefix into slot num_blocks."""
    blocks = jax.lax.dynamic_update_index_in_dim(blocks, prefix.astype(blocks.dtype), num_blocks, axis=0)
    return blocks, num_blocks + 1


def push_block_if(push, blocks, num_blocks, prefix):
    """`push_block` and a zeroed prefix where the traced bool `push` holds, else all unchanged:
    the slot at num_blocks is rewritten with its own contents when not pushing (one slot's read
    and write, no [NB,...] select). Returns (blocks, num_blocks, prefix)."""
    slot = jnp.minimum(num_blocks, blocks.shape[0] - 1)
    old = jax.lax.dynamic_index_in_dim(blocks, slot, axis=0, keepdims=False)
    blocks = jax.lax.dynamic_update_index_in_dim(blocks, jnp.where(push, prefix.astype(blocks.dtype), old), slot,
                                                 axis=0)
    return blocks, num_blocks + push.astype(num_blocks.dtype), jnp.where(push, jnp.zeros_like(prefix), prefix)
