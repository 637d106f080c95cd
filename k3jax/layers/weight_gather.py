"""FSDP at a layer's entry: its weights gathered over the storage-only mesh axes before use.

Parameters are stored split over every non-data device (`k3jax.sharding.rules`: embed, latent
and lora over fsdp x expert x context) and over `tensor` where tensor parallelism splits their
computation (heads, mlp, vocab). A layer's matmuls want the first kind gathered: left to itself,
XLA's SPMD partitioner sometimes does the opposite for a product of token-split activations with
an FSDP-split weight, and gathers the *activations* instead. Compiled for configs/k3.yaml on
2,048 H200s (2026-12-01), the shared experts' and AttnRes's backward gathered whole micro-batches
of the residual stream on every device (f32[1024, 4096, 7168], 120 GB, and bf16[4194304, 7168]),
583 GB of temporaries in all. Pinning each weight of the layer to its compute layout (only the
tensor-parallel splits kept) at the top of the scanned layer body makes the FSDP pattern
explicit: one all-gather of the layer's weights on the way in (again in the recompute) and, by
transposition, a reduce-scatter of their gradients on the way out, as MaxText and Levanter do.

The routed experts' weights (leading logical axis `expert`) are left to the MoE layer, whose
expert-parallel exchange places them itself (`k3jax.layers.expert_parallel`).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax.ops.mesh_axes import EXPERT, TENSOR, TENSOR_SPLIT_NAMES, active_mesh


def compute_spec(shape: tuple[int, ...], axes: tuple, mesh) -> P:
    """The PartitionSpec a weight of `shape` with logical `axes` (for its trailing dims) is used
    in: `tensor` on the first dimension whose name tensor parallelism splits and which it
    divides, every other dimension whole."""
    lead = len(shape) - len(axes)
    spec, used = [None] * len(shape), False
    t = mesh.shape.get(TENSOR, 1)
    for i, name in enumerate(axes):
        if not used and t > 1 and name in TENSOR_SPLIT_NAMES and shape[lead + i] % t == 0:
            spec[lead + i], used = TENSOR, True
    return P(*spec)


def gather_layer_weights(state: nnx.State) -> nnx.State:
    """`state` (one layer's parameters, as the scan body gets them) with every parameter that
    carries `axes` metadata pinned to `compute_spec`, except the routed experts' weights. No
    mesh (or one device): unchanged."""
    mesh = active_mesh()
    if mesh is None:
        return state

    def pin(var):
        axes = tuple(var.get_metadata().get("axes", ()))
        value = var.get_value()
        if not axes or axes[0] == EXPERT or not hasattr(value, "shape"):
            return var
        return var.replace(jax.lax.with_sharding_constraint(value, compute_spec(value.shape, axes, mesh)))

    return jax.tree.map(pin, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
