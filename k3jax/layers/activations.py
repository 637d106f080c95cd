"""Gated FFN activations and the gated MLP (dense FFN, shared experts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.common import EMBED, MLP, Dense, Dtypes


def situ_glu(a, b, beta: float = 4.0, linear_beta: float | None = 25.0):
    """SiTU-GLU: [beta tanh(a/beta) sigmoid(a)] * [beta' tanh(b/beta')], in fp32.

    Near 0 it is SwiGLU; |out| <= beta * beta'. linear_beta=None makes the up half the identity.
    """
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    gate = beta * jnp.tanh(a32 / beta) * jax.nn.sigmoid(a32)
    up = b32 if linear_beta is None else linear_beta * jnp.tanh(b32 / linear_beta)
    return (gate * up).astype(a.dtype)


def swiglu(a, b):
    return (jax.nn.silu(a.astype(jnp.float32)) * b.astype(jnp.float32)).astype(a.dtype)


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

    def __call__(self, x):
        return self.down_proj(apply_glu(self.glu, self.gate_proj(x), self.up_proj(x)))
