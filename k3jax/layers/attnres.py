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
from jax.ad_checkpoint import checkpoint_name

from k3jax.layers import decode_gemv
from k3jax.layers.common import EMBED, fill_param
from k3jax.layers.norms import rms_normalize
from k3jax.ops.attnres_mix import attn_res_site, resolve_impl
from k3jax.ops.decode_kernels import attnres_norm
from k3jax.ops.decode_kernels.common import interpret
from k3jax.ops.remat_names import ATTNRES_OUT


def attn_res_mix(blocks, num_blocks, prefix, query, eps: float, impl: str = "xla"):
    """blocks [NB,B,T,d]; num_blocks int32 scalar (valid slots); prefix [B,T,d]; query [d] fp32.

    Returns [B,T,d] in prefix's dtype. With num_blocks == 0 it returns prefix exactly.
    `attn_res_pass` is the same mix with the sources passed through (what the model uses);
    impl: "xla" | "kernel" | "interpret" (`k3jax.ops.attnres_mix`)."""
    return attn_res_pass(blocks, num_blocks, prefix, query, eps, impl)[0]


def attn_res_pass(blocks, num_blocks, prefix, query, eps: float, impl: str = "xla"):
    """-> (out, blocks): `k3jax.ops.attnres_mix.attn_res_site`. Use the returned blocks
    downstream: their cotangent then reaches this site's backward, which adds its share in
    place (no fresh [NB,B,T,d] cotangent per site). The output carries the checkpoint name
    ATTNRES_OUT: remat=save_dots keeps it (k3jax.ops.remat_names)."""
    out, blocks = attn_res_site(blocks, num_blocks, prefix, query, eps, impl)
    return checkpoint_name(out, ATTNRES_OUT), blocks


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

    def __init__(self, d_model: int, *, eps: float, impl: str = "auto"):
        self.norm = nnx.Dict(weight=fill_param((d_model,), (EMBED,), 1.0))
        self.proj = nnx.Dict(kernel=fill_param((d_model, 1), (EMBED, None), 0.0))
        self.eps = eps
        self.impl = impl  # model.attn_res_impl

    def __call__(self, blocks, num_blocks, prefix):
        """The mix [B,T,d]."""
        return self.mix(blocks, num_blocks, prefix)[0]

    def mix(self, blocks, num_blocks, prefix):
        """-> (out, blocks): `attn_res_pass` (use the returned blocks)."""
        query = self.norm["weight"][...] * self.proj["kernel"][...][:, 0]
        return attn_res_pass(blocks, num_blocks, prefix, query, self.eps, resolve_impl(self.impl, blocks, prefix))

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
    return _write_slot(blocks, num_blocks, prefix), num_blocks + 1


@jax.custom_vjp
def _write_slot(blocks, slot, prefix):
    return jax.lax.dynamic_update_index_in_dim(blocks, prefix.astype(blocks.dtype), slot, axis=0)


def _write_slot_fwd(blocks, slot, prefix):
    return _write_slot(blocks, slot, prefix), (slot, jnp.zeros((), prefix.dtype))  # the dtype, as a residual


def _write_slot_bwd(res, d_blocks):
    """The prefix's cotangent is the slot's; the buffer's cotangent passes back unchanged, where
    autodiff would zero the slot first (a dynamic-update-slice on the running cotangent that
    XLA:GPU ran as a copy of the whole buffer: 0.8 GB a push in k3-small's step, next to the
    AttnRes kernel updating it in place). Leaving the slot is exact for every gradient that
    reaches a parameter: before the push the slot is empty, every site masks it (a slot >= its
    count gets a zero share, and the kernels do not touch it), and the buffer it came from is
    the model's constant zeros."""
    slot, like = res
    return d_blocks, None, jax.lax.dynamic_index_in_dim(d_blocks, slot, axis=0, keepdims=False).astype(like.dtype)


_write_slot.defvjp(_write_slot_fwd, _write_slot_bwd)


def push_block_if(push, blocks, num_blocks, prefix):
    """`push_block` and a zeroed prefix where the traced bool `push` holds, else all unchanged:
    the slot at num_blocks is rewritten with its own contents when not pushing (one slot's read
    and write, no [NB,...] select). Returns (blocks, num_blocks, prefix)."""
    slot = jnp.minimum(num_blocks, blocks.shape[0] - 1)
    old = jax.lax.dynamic_index_in_dim(blocks, slot, axis=0, keepdims=False)
    blocks = jax.lax.dynamic_update_index_in_dim(blocks, jnp.where(push, prefix.astype(blocks.dtype), old), slot,
                                                 axis=0)
    return blocks, num_blocks + push.astype(num_blocks.dtype), jnp.where(push, jnp.zeros_like(prefix), prefix)
