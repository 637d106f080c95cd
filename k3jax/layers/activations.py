"""Gated FFN activations and the gated MLP (dense FFN, shared experts)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers import decode_gemv
from k3jax.layers.common import EMBED, MLP, Dense, Dtypes
from k3jax.ops.glu_grad import glu_grads_f32


def situ_glu_reference(a, b, beta: float = 4.0, linear_beta: float | None = 25.0):
    """SiTU-GLU: [beta tanh(a/beta) sigmoid(a)] * [beta' tanh(b/beta')], in fp32.

    Near 0 it is SwiGLU; |out| <= beta * beta'. linear_beta=None makes the up half the identity.
    The plain form (autodiff's backward); `situ_glu` is the same function with its own VJP.
    """
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    gate = beta * jnp.tanh(a32 / beta) * jax.nn.sigmoid(a32)
    up = b32 if linear_beta is None else linear_beta * jnp.tanh(b32 / linear_beta)
    return (gate * up).astype(a.dtype)


def swiglu_reference(a, b):
    return (jax.nn.silu(a.astype(jnp.float32)) * b.astype(jnp.float32)).astype(a.dtype)


# Hand-written VJPs: the backward recomputes the transcendentals from a and b in one
# elementwise pass (reads a, b and the cotangent, writes da and db in their dtype). Under
# autodiff XLA kept tanh and sigmoid of every expert row in fp32 between the passes, 8
# extra bytes per element written and read again (k3-small: 134 M elements per MoE layer).
# The backward's a and b pass through an optimization barrier: otherwise XLA merges its
# tanh/sigmoid with those of the forward recomputed for the down projection's backward
# (the same expressions) and stores them in fp32 again.


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def situ_glu(a, b, beta: float = 4.0, linear_beta: float | None = 25.0):
    """SiTU-GLU (see `situ_glu_reference`), in fp32, result in a's dtype."""
    return situ_glu_reference(a, b, beta, linear_beta)


def _situ_fwd(a, b, beta, linear_beta):
    return situ_glu_reference(a, b, beta, linear_beta), (a, b)


def _situ_bwd(beta, linear_beta, res, g):
    a, b = jax.lax.optimization_barrier(res)
    da, db = glu_grads_f32(("situ", beta, linear_beta), a.astype(jnp.float32), b.astype(jnp.float32),
                           g.astype(jnp.float32))
    return da.astype(a.dtype), db.astype(b.dtype)


situ_glu.defvjp(_situ_fwd, _situ_bwd)


@jax.custom_vjp
def swiglu(a, b):
    """silu(a) * b in fp32, result in a's dtype."""
    return swiglu_reference(a, b)


def _swiglu_fwd(a, b):
    return swiglu_reference(a, b), (a, b)


def _swiglu_bwd(res, g):
    a, b = jax.lax.optimization_barrier(res)
    da, db = glu_grads_f32(("swiglu", None, None), a.astype(jnp.float32), b.astype(jnp.float32),
                           g.astype(jnp.float32))
    return da.astype(a.dtype), db.astype(b.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def glu_spec(model_cfg) -> tuple:
    """A hashable description of the model's GLU, stored on modules (no closures in graphdefs)."""
    return (model_cfg.activation, model_cfg.situ_beta, model_cfg.situ_linear_beta)


def apply_glu(spec: tuple, a, b):
    name, beta, linear_beta = spec
    return situ_glu(a, b, beta, linear_beta) if name == "situ" else swiglu(a, b)


class GatedMLP(nnx.Module):
    """down(act(gate x, up x)): the dense layer-0 FFN and the fused shared experts."""

    def __init__(self, d_model: int, hidden: int, model_cfg, *, rngs: nnx.Rngs):
        dt = Dtypes.of(model_cfg)
        std = model_cfg.init_std
        self.gate_proj = Dense(d_model, hidden, (EMBED, MLP), rngs=rngs, std=std, dtypes=dt)
        self.up_proj = Dense(d_model, hidden, (EMBED, MLP), rngs=rngs, std=std, dtypes=dt)
        self.down_proj = Dense(hidden, d_model, (MLP, EMBED), rngs=rngs, std=std, dtypes=dt)
        self.glu = glu_spec(model_cfg)

    def __call__(self, x, pre=None, addends=()):
        """x [..., d] -> [..., d]; pre: (gate x, up x) already computed (fp32 or the compute
        dtype), e.g. in one gemv launch with other projections of x; addends: [..., d] arrays
        added to the output one after the other (a residual stream's adds). In a decode step the
        GLU and the adds run inside the down projection's gemv kernel."""
        cd = self.gate_proj.compute
        if pre is None and addends:  # the GLU rounds its inputs: the kernel's fp32 outputs serve as they are
            pre = decode_gemv.project(x, [self.gate_proj.kernel[...], self.up_proj.kernel[...]], [cd, cd])
        if pre is None:
            pre = decode_gemv.dense_group(x, [self.gate_proj, self.up_proj])  # one launch in a decode step
        if addends:
            fast = decode_gemv.project(pre[0], [self.down_proj.kernel[...]], [self.down_proj.compute], x_dtype=cd,
                                       glu=self.glu, x2=pre[1], addends=list(addends), round_dtype=cd)
            if fast is not None:
                return fast[0]
        y = self.down_proj(apply_glu(self.glu, *(t.astype(cd) for t in pre)))
        for a in addends:  # an addend may be an fp32 projection the kernel would round: round it here too
            y = y + a.astype(y.dtype)
        return y
