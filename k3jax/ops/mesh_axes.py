"""The mesh's axis names, and the mesh a caller set, for every floor of the package.

Axis order is outermost-first: `data` (pure data parallelism, params replicated) spans the
slowest links (across hosts / slices), `tensor` the fastest (inside a node), so tensor
collectives stay on NVLink / ICI. The batch is split over data x fsdp x expert: every
device sees different rows; `context` splits each row's tokens into contiguous shards (its
all-gathers of states and latents sit next to `tensor`, on the fast links); expert-parallel
all-to-alls run over `expert`. Building a mesh from a config is `k3jax.sharding.mesh`'s job;
operators, layers and the model only read names and the active mesh from here.
"""

from __future__ import annotations

import math

import jax

AXES = ("data", "fsdp", "expert", "context", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")
EXPERT = "expert"  # expert parallelism: routed experts split over it, tokens exchanged over it
CONTEXT = "context"  # splits each row's tokens into contiguous shards (layers/context_parallel.py)
TENSOR = "tensor"  # Megatron-style splits of widths (heads, MLP hidden, vocab)
TOKEN_AXES = BATCH_AXES + (CONTEXT,)  # a flattened [B*T] token axis: rows, then shards of a row
# the logical parameter axes tensor parallelism splits (k3jax.sharding.rules maps each to
# `tensor`); every other split of a parameter only spreads its storage (FSDP) and is gathered
# before use (k3jax.layers.weight_gather)
TENSOR_SPLIT_NAMES = ("vocab", "heads", "mlp", "expert_mlp")


def active_mesh(required_axes: tuple[str, ...] = AXES):
    """The abstract mesh set with `jax.set_mesh`, or None when there is none, it has one device,
    or it lacks an axis of `required_axes` (the model's layers need all of AXES; a kernel run
    per shard takes any axis names)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or math.prod(mesh.shape.values()) == 1:
        return None
    if mesh.are_all_axes_manual:  # inside a shard_map: the caller already runs per shard
        return None
    if not set(required_axes) <= set(mesh.axis_names):
        return None
    return mesh


def fit_axes(mesh, names, dim: int):
    """The leading mesh axes of `names` (those of size > 1 in `mesh`) whose product divides dim,
    or None: how a kernel run per shard splits one dimension (the axes that do not divide it
    replicate it)."""
    axes = [a for a in names if a in mesh.shape and mesh.shape[a] > 1]
    while axes and dim % math.prod(mesh.shape[a] for a in axes):
        axes.pop()
    return tuple(axes) if axes else None


def row_head_axes(mesh, rows: int, heads: int):
    """(row axes, head axes): how an operator independent per row and per head (or channel) is
    split over `mesh` when run per shard, as the layers' activations lie: rows over the batch
    axes, heads over `tensor` (`fit_axes`: an axis that does not divide its dimension replicates
    it)."""
    return fit_axes(mesh, BATCH_AXES, rows), fit_axes(mesh, (TENSOR,), heads)
