"""Logical-axis rules: the one place that maps named tensor dimensions to mesh axes.

Every parameter carries `axes` metadata (one logical name per dimension; stacked layer
dims in front are unnamed and never sharded). A logical name maps to a tuple of mesh
axes; a mesh axis already used by an earlier dimension of the same tensor is skipped, so
e.g. the router [embed, expert] shards embed over fsdp only.

    embed      -> fsdp, expert, context   FSDP: weights and optimizer state over every non-tensor,
                                  non-data device (context shards hold different tokens of the same
                                  rows, so like fsdp they gather the weights they use)
    vocab, heads, mlp, expert_mlp -> tensor   tensor parallelism (Megatron-style)
    expert     -> expert          expert parallelism
    latent     -> fsdp, context   the latent side of expert weights
    lora       -> fsdp, expert, context   low-rank bottlenecks (MLA q/kv up-projections, KDA gate ranks)
    batch      -> data, fsdp, expert   activations: every device gets different rows
    (the token axis of [B, T, ...] activations and batches -> context: contiguous shards of a row)

Activations inside the model are pinned to these axes by `k3jax.layers.token_sharding`.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.ops.mesh_axes import BATCH_AXES, CONTEXT
from k3jax.tree_paths import plain_path

RULES: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "embed": ("fsdp", "expert", "context"),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "mlp": ("tensor",),
    "expert_mlp": ("tensor",),
    "expert": ("expert",),
    "latent": ("fsdp", "context"),
    "head_dim": (),
    "lora": ("fsdp", "expert", "context"),
    "conv": (),
}


def logical_to_spec(axes, ndim: int, mesh=None) -> P:
    """PartitionSpec for a tensor of `ndim` dims whose trailing dims are named `axes`.

    Mesh axes of size 1 are dropped, and a dimension is only sharded over mesh axes whose
    product divides it when `mesh` and shapes are known (see `param_specs`)."""
    lead = ndim - len(axes)
    if lead < 0:
        raise ValueError(f"{len(axes)} axis names for a {ndim}-d tensor")
    used: set[str] = set()
    spec = [None] * lead
    for name in axes:
        if name is not None and name not in RULES:
            raise KeyError(f"logical axis {name!r} has no sharding rule in k3jax/sharding/rules.py")
        mesh_axes = tuple(a for a in (RULES.get(name, ()) if name else ()) if a not in used)
        used.update(mesh_axes)
        spec.append(mesh_axes if len(mesh_axes) > 1 else (mesh_axes[0] if mesh_axes else None))
    return P(*spec)


def fit_spec(spec: P, shape, mesh) -> P:
    """Drop mesh axes (innermost first) that do not divide a dimension, so every config works
    on every mesh; a dropped axis means replication along it, never an error."""
    out = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = [] if entry is None else ([entry] if isinstance(entry, str) else list(entry))
        axes = [a for a in axes if mesh.shape[a] > 1]
        while axes and dim % _prod(mesh, axes):
            axes.pop()
        out.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    return P(*out)


def _prod(mesh, axes) -> int:
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


def param_specs(state: nnx.State, mesh=None) -> dict:
    """PartitionSpecs for every variable of an nnx.State, as a pure nested dict.

    Raises KeyError naming the parameter if one has no `axes` metadata."""
    flat = {}
    for path, var in nnx.to_flat_state(state):
        meta = var.get_metadata()
        shape = var.get_value().shape
        if "axes" not in meta:
            if isinstance(var, nnx.Param):
                raise KeyError(f"parameter {'/'.join(map(str, path))} has no logical axes")
            flat[path] = P()  # non-parameter state (the QB bias): small, replicated
            continue
        spec = logical_to_spec(tuple(meta["axes"]), len(shape))
        flat[path] = fit_spec(spec, shape, mesh) if mesh is not None else spec
    return nnx.traversals.unflatten_mapping(flat)


def batch_sharding(mesh, ndim: int = 2) -> NamedSharding:
    """Rows of a [batch, seq, ...] array over data x fsdp x expert, its tokens over context."""
    if ndim < 2:
        return NamedSharding(mesh, P(RULES["batch"]))
    return NamedSharding(mesh, P(RULES["batch"], CONTEXT, *([None] * (ndim - 2))))


def state_shardings(mesh, spec, tx, abstract_state: dict) -> dict:
    """NamedShardings for the whole train state: params by the rules, optimizer moments like
    the parameter they belong to (same key-path suffix and shape), everything else replicated."""
    del tx  # the optimizer state's layout is read from the abstract state itself
    named = lambda s: NamedSharding(mesh, s)  # noqa: E731
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    params_sh = jax.tree.map(named, param_specs(spec.params, mesh), is_leaf=is_spec)
    rest_sh = jax.tree.map(named, param_specs(spec.rest, mesh), is_leaf=is_spec)
    replicated = NamedSharding(mesh, P())
    by_path = {}
    for path, sh in jax.tree_util.tree_flatten_with_path(params_sh)[0]:
        by_path[plain_path(path)] = sh
    shapes = {plain_path(path): leaf.shape
              for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state["params"])[0]}

    def moment(path, leaf):
        keys = plain_path(path)
        for i in range(len(keys)):
            if keys[i:] in by_path and shapes[keys[i:]] == leaf.shape:
                return by_path[keys[i:]]
        return replicated

    opt_sh = jax.tree_util.tree_map_with_path(moment, abstract_state["opt_state"])
    return {"params": params_sh, "rest": rest_sh, "opt_state": opt_sh, "step": replicated, "rng": replicated}
