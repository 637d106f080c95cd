"""RMSNorm (fp32 inside), the weightless RMS normaliser and the l2 norm of KDA q/k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.common import fill_param


def rms_normalize(x, eps: float):
    """x * rsqrt(mean(x^2) + eps) over the last axis, in fp32 (no weight)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def l2_normalize(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) in fp32: the eps sits inside the *sum* (fla's l2norm)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """y = w * cast_in(normalize(x)): the statistics in fp32, the normalised
    value cast back to x's dtype before the weight, as the K3 release does."""

    def __init__(self, dim: int, *, eps: float, axis_name: str | None):
        self.weight = fill_param((dim,), (axis_name,), 1.0)
        self.eps = eps

    def __call__(self, x, out_dtype=None):
        y = rms_normalize(x, self.eps).astype(x.dtype) * self.weight[...].astype(x.dtype)
        return y.astype(out_dtype or x.dtype)
