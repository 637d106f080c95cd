"""Rotary position embedding, rotate-half (GPT-NeoX) layout.

Channel i is paired with channel i + D/2 and the pair is rotated by positions * theta^(-2i/D).
Angles are computed on the fly from the positions (no table), so packed documents need
nothing beyond their within-document positions.
"""

from __future__ import annotations

import jax.numpy as jnp


def rope_angles(positions, dim: int, theta: float):
    """positions [B,T] int -> angles [B,T,dim/2] fp32."""
    inv_freq = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    return positions.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(x, positions, theta: float):
    """x [B,T,H,D] or [B,T,D], positions [B,T] -> same shape and dtype as x (fp32 inside)."""
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"apply_rope: head dim must be even, got {D}")
    if positions.shape != x.shape[:2]:
        raise ValueError(f"apply_rope: positions must be [B,T] = {x.shape[:2]}, got {positions.shape}")
    ang = rope_angles(positions, D, theta)
    if x.ndim == 4:
        ang = ang[:, :, None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : D // 2], x32[..., D // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
