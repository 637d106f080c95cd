"""RMSNorm (fp32 inside), the weightless RMS normaliser and the l2 norm of KDA q/k.

Each has a hand-written VJP (the `*_reference` functions are the plain forms, whose autodiff
the tests compare them with). The backward is one pass of two independent row reductions
over x and g (mean(x^2) and <g, x>), then one elementwise pass for dx: under plain autodiff
XLA split the same work over more passes and kept fp32 intermediates between them (about
90 GB of traffic per k3-small step in its norms, the largest glue after the kernels).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.common import fill_param
from k3jax.ops.norm_vjp import scaled_vjp

F32 = jnp.float32


def rms_normalize_reference(x, eps: float):
    """x * rsqrt(mean(x^2) + eps) over the last axis, in fp32 (no weight)."""
    x32 = x.astype(F32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def l2_normalize_reference(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) in fp32: the eps sits inside the *sum* (fla's l2norm)."""
    x32 = x.astype(F32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_norm_reference(x, weight, eps: float):
    """w * cast_in(normalize(x)): the statistics in fp32, the normalised value cast back to
    x's dtype before the weight (cast to x's dtype too), as the K3 release does."""
    return rms_normalize_reference(x, eps).astype(x.dtype) * weight.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def rms_normalize(x, eps: float):
    """x * rsqrt(mean(x^2) + eps) over the last axis, in fp32 (no weight)."""
    return rms_normalize_reference(x, eps)


rms_normalize.defvjp(lambda x, eps: (rms_normalize_reference(x, eps), x),
                     lambda eps, x, g: (scaled_vjp(x, g.astype(F32), eps, True)[0],))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def l2_normalize(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) in fp32: the eps sits inside the *sum* (fla's l2norm)."""
    return l2_normalize_reference(x, eps)


l2_normalize.defvjp(lambda x, eps: (l2_normalize_reference(x, eps), x),
                    lambda eps, x, g: (scaled_vjp(x, g.astype(F32), eps, False)[0],))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, weight, eps: float):
    """`rms_norm_reference` with its own VJP: dx as the reference's autodiff (the cotangent
    times the weight in x's dtype, then the normaliser's derivative in fp32); dw summed in
    fp32 (autodiff sums in x's dtype)."""
    return rms_norm_reference(x, weight, eps)


def _rms_norm_fwd(x, weight, eps):
    return rms_norm_reference(x, weight, eps), (x, weight)


def _rms_norm_bwd(eps, res, dy):
    x, weight = res
    g = (dy * weight.astype(dy.dtype)).astype(F32)
    dx, r = scaled_vjp(x, g, eps, True)
    lead = tuple(range(x.ndim - 1))
    xhat = (x.astype(F32) * r).astype(x.dtype).astype(F32)  # as the forward rounded it
    dw = jnp.sum(dy.astype(F32) * xhat, axis=lead)
    return dx, dw.astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class RMSNorm(nnx.Module):
    """y = w * cast_in(normalize(x)): the statistics in fp32, the normalised
    value cast back to x's dtype before the weight, as the K3 release does."""

    def __init__(self, dim: int, *, eps: float, axis_name: str | None):
        self.weight = fill_param((dim,), (axis_name,), 1.0)
        self.eps = eps

    def __call__(self, x, out_dtype=None):
        return rms_norm(x, self.weight[...], self.eps).astype(out_dtype or x.dtype)
