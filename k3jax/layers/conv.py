"""Causal depthwise short convolution + SiLU (fla ShortConvolution), with segment resets.

y_t[c] = SiLU( sum_{i<W} w[i, c] * x_{t-W+1+i}[c] ), where inputs before the start of
the current segment count as 0. The decode state is the last W-1 pre-conv inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.common import CONV, HEADS, uniform_param
from k3jax.segments import segment_counter


class ShortConv(nnx.Module):
    """Depthwise causal conv over the channel axis of x [B,T,P]; weight [W, P] in fp32."""

    def __init__(self, channels: int, size: int, *, rngs: nnx.Rngs):
        # PyTorch Conv1d's default init (the K3 init is not public): U(-1/sqrt(W), 1/sqrt(W))
        bound = size ** -0.5
        self.weight = uniform_param(rngs, (size, channels), (CONV, HEADS), -bound, bound)
        self.size = size

    def __call__(self, x, segment_ids, window=None):
        """x [B,T,P]; segment_ids [B,T]; window [B,W-1,P] of earlier inputs of the same
        segment as x's first token (zeros when it starts a new one), or None.

        Returns (SiLU(conv(x)) in x's dtype, the next window [B,W-1,P] in x's dtype).
        """
        return short_conv(self.weight[...], x, segment_ids, window)


def short_conv(weight, x, segment_ids, window=None):
    """The module's computation as a function of its weight [W,P] (context parallelism runs it
    per shard, with the upstream shard's last inputs as the window)."""
    B, T, P = x.shape
    W = weight.shape[0]
    w = weight.astype(jnp.float32)
    if window is None:
        window = jnp.zeros((B, W - 1, P), x.dtype)
    xp = jnp.concatenate([window.astype(jnp.float32), x.astype(jnp.float32)], axis=1)  # [B, W-1+T, P]
    r = segment_counter(segment_ids)
    r_ext = jnp.concatenate([jnp.zeros((B, W - 1), r.dtype), r], axis=1)  # window rows: segment 0
    acc = jnp.zeros((B, T, P), jnp.float32)
    for i in range(W):  # tap i reads x_{t-(W-1)+i}
        src = jax.lax.dynamic_slice_in_dim(xp, i, T, axis=1)
        same = jax.lax.dynamic_slice_in_dim(r_ext, i, T, axis=1) == r
        acc = acc + jnp.where(same[..., None], src, 0.0) * w[i]
    y = jax.nn.silu(acc).astype(x.dtype)
    # the next call continues x's last segment: keep only that segment's inputs
    tail, tail_r = xp[:, -(W - 1):], r_ext[:, -(W - 1):]
    next_window = jnp.where((tail_r == r[:, -1:])[..., None], tail, 0.0).astype(x.dtype)
    return y, next_window
