"""The backward of a row normaliser x -> x * rsqrt(reduce(x^2) + eps), in one place: the norms'
hand-written VJPs (`k3jax.layers.norms`) and the short-conv kernel, which takes KDA's q/k l2
norm's backward inside it (`k3jax.ops.short_conv_grad`), both call `scaled_vjp`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def row_factor(x32, eps: float, mean: bool):
    """rsqrt(reduce(x^2) + eps) over the last axis, keepdims, fp32."""
    red = jnp.mean if mean else jnp.sum
    return jax.lax.rsqrt(red(x32 * x32, axis=-1, keepdims=True) + eps)


def scaled_vjp(x, g, eps: float, mean: bool):
    """d/dx of x * r(x), r = rsqrt(reduce(x^2) + eps), against the fp32 cotangent g, in x's
    dtype; also returns r.

        r (g - xhat * red(g * xhat)) = r g - x r^3 red(g * x)       (xhat = x r)

    The right side's two row reductions, red(x^2) for r and red(g * x), are independent: one
    pass over x and g (a multi-output reduction), then one elementwise pass. The left side ran
    on XLA:GPU as three passes over x (r, then <g, xhat> waiting on it, then dx). The residual
    is x alone: under remat a saved r ([..., 1]) cost a separate reduction kernel in the
    recomputed forward instead (glue_regions.py --micro, 2026-12-01)."""
    x32 = x.astype(F32)
    r = row_factor(x32, eps, mean)
    s = jnp.sum(g * x32, axis=-1, keepdims=True)
    if mean:
        s = s / x.shape[-1]
    return (r * g - x32 * (r * r * r * s)).astype(x.dtype), r
