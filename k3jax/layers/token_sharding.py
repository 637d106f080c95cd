"""Sequence parallelism between layers: how the model pins its activations to the mesh.

The residual stream's batch axis is split over data x fsdp x expert and its token axis over
context and, where the tokens divide, tensor (`constrain_rows`); a layer reads its input's tokens
whole over tensor (`gather_tokens`). Parameters follow `k3jax.sharding.rules`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.ops.mesh_axes import BATCH_AXES, CONTEXT, TENSOR, TOKEN_AXES, active_mesh


def _token_split(T: int, mesh, sequence_parallel: bool) -> tuple[str, ...]:
    """The mesh axes a row's T tokens split over between layers: context, and tensor too where
    sequence parallelism is on and the tokens divide (the one rule `constrain_rows` and
    `flatten_tokens` share)."""
    C, t = mesh.shape[CONTEXT], mesh.shape[TENSOR]
    return (CONTEXT, TENSOR) if sequence_parallel and t > 1 and T % (C * t) == 0 else (CONTEXT,)


def _token_spec(x, row_axis: int, mesh, sequence_parallel: bool):
    spec = [None] * x.ndim
    spec[row_axis] = BATCH_AXES
    if x.ndim > row_axis + 1:
        axes = _token_split(x.shape[row_axis + 1], mesh, sequence_parallel)
        spec[row_axis + 1] = axes if len(axes) > 1 else axes[0]
    return P(*spec)


def constrain_rows(x, row_axis: int = 0):
    """Between layers: pin an activation's batch axis to data x fsdp x expert and the token axis
    after it to context, and, where the tokens divide, to tensor too (sequence parallelism), when
    a mesh is active, so weight shardings (FSDP on embed) never leak into the residual stream.

    Sequence parallelism (Megatron-SP): the residual stream, the AttnRes block buffer and what
    the backward saves of them hold 1/tensor of the tokens on each device instead of all of
    them on all `tensor` devices; a layer gathers its input's tokens (`gather_tokens`) and
    scatters its output's back, where the all-reduce of the row-parallel projections was (the
    same bytes: an all-reduce is a reduce-scatter plus an all-gather)."""
    mesh = active_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, _token_spec(x, row_axis, mesh, True))


def gather_tokens(x, row_axis: int = 0):
    """Inside a layer: the tokens of a [B, T, ...] activation whole over `tensor` (split over
    context only), as the tensor-parallel projections read them (see `constrain_rows`)."""
    mesh = active_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, _token_spec(x, row_axis, mesh, False))


def flat_token_axes(n: int, mesh, sequence_parallel: bool = True) -> tuple[str, ...]:
    """The mesh axes a flattened [B*T] token axis of n tokens splits over: the rows' axes, then
    context, then (sequence parallelism) tensor; the longest prefix of those that divides n (a
    decode step's few tokens stay whole where they do not split)."""
    axes = [a for a in TOKEN_AXES + ((TENSOR,) if sequence_parallel else ()) if mesh.shape[a] > 1]
    while axes and n % math.prod(mesh.shape[a] for a in axes):
        axes.pop()
    return tuple(axes)


def _device_blocks(B: int, T: int, mesh) -> tuple[int, int] | None:
    """(PB, PT): how many pieces the residual stream splits [B, T] into (`constrain_rows`: rows
    over data x fsdp x expert, tokens over context and, with sequence parallelism, tensor), or
    None where the flat order needs no reordering (one piece on one of the two axes, one row per
    piece, or shapes that do not divide: then `flat_token_axes` falls back as it does)."""
    PB = math.prod(mesh.shape[a] for a in BATCH_AXES)
    PT = math.prod(mesh.shape[a] for a in _token_split(T, mesh, True))
    if PB == 1 or PT == 1 or B % PB or T % PT or B == PB:
        return None
    return PB, PT


def flatten_tokens(x):
    """[B, T, ...] -> [B*T, ...], each device's tokens contiguous, in mesh order.

    A plain reshape puts row b's tokens at b*T...: split over data x fsdp x expert x context x
    tensor (`flat_token_axes`), its pieces are not the residual stream's pieces (rows split over
    the first three, tokens over the last two) once a device holds more than one row. Each MoE
    layer then moved every token twice, and for k3.yaml (4 rows of 4,096 per device, 2,048
    devices: a plain flat piece is half a row) XLA met the mismatch in the backward of the
    norms and the AttnRes mix around the MoE by all-gathering the whole micro-batch, f32
    [1024, 4096, 7168] (120 GB) a time, on every device (k3jax-plan, BENCHMARKS section 4d).
    Here the flat order is (row piece, token piece, row, token): every device's flat piece is
    exactly its residual-stream tokens, so both reshapes are local. The MoE is per token (its
    statistics are sums over tokens), so the order changes nothing it computes; without a
    mesh this is the plain reshape. `unflatten_tokens` is the inverse."""
    B, T = x.shape[:2]
    mesh = active_mesh()
    blocks = _device_blocks(B, T, mesh) if mesh is not None else None
    if blocks is None:
        return x.reshape((B * T,) + x.shape[2:])
    PB, PT = blocks
    rest = x.shape[2:]
    x = x.reshape((PB, B // PB, PT, T // PT) + rest)
    return jnp.swapaxes(x, 1, 2).reshape((B * T,) + rest)


def unflatten_tokens(y, B: int, T: int):
    """[B*T, ...] in `flatten_tokens`'s order -> [B, T, ...]."""
    mesh = active_mesh()
    blocks = _device_blocks(B, T, mesh) if mesh is not None else None
    if blocks is None:
        return y.reshape((B, T) + y.shape[1:])
    PB, PT = blocks
    rest = y.shape[1:]
    y = y.reshape((PB, PT, B // PB, T // PT) + rest)
    return jnp.swapaxes(y, 1, 2).reshape((B, T) + rest)


def constrain_tokens(x, sequence_parallel: bool = True):
    """A flattened token array [N, ...] (the MoE's rows) pinned to its tokens' devices: each
    token on the one device that holds it in the residual stream (`constrain_rows`), replicated
    over the rest. Pins what XLA would otherwise be free to replicate: a product of token-split
    activations with an FSDP-split weight (the router's [N, E] scores) can otherwise come out
    whole on every device."""
    mesh = active_mesh()
    if mesh is None:
        return x
    axes = flat_token_axes(x.shape[0], mesh, sequence_parallel)
    return jax.lax.with_sharding_constraint(x, P(axes or None, *([None] * (x.ndim - 1))))
