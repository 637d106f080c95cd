"""Muon's orthogonalisation, batched by shape: one chain of batched matmuls per matrix shape.

optax.contrib.muon runs Newton-Schulz per parameter (a vmap over that parameter's stacked
layers, experts or heads): k3-small's per-head Muon is 119 parameters, 119 chains of 15
matmuls plus their elementwise work, most of them small. Here every Muon parameter's
matrices are brought to one layout, [*batch, rows, cols] with rows <= cols (the wide side,
as optax transposes tall matrices), and the parameters whose layout has the same shape are
stacked and orthogonalised together: 21 chains for k3-small per head, each a batched matmul
over every layer, expert and head of that shape.

Parameters are stacked along a new leading axis, never concatenated along a batch axis: a
batch axis sharded over the mesh (experts over `expert`, stacked layers) stays sharded as it
is, so the stacking moves no data between devices.

Numerics (`dtype`):
- bfloat16 (the default): the Frobenius normalisation in fp32, then every Newton-Schulz
  iterate, its Gram matrix and the polynomial in bf16 (matmuls accumulate in fp32), as
  Moonlight's and Kimi K2's Muon run it. The update differs from the fp32 iteration by a
  few percent (relative Frobenius norm: 0.04 at 256x384, 0.06 at 64x128, up to 0.13 for 4x6;
  tests/test_muon.py): the quintic's slope of 3.4 near zero amplifies each iterate's bf16
  rounding. Its scale (0.2 sqrt(max(m, n))) is applied in fp32.
- float32: the same iteration as optax.contrib.muon's (default matmul precision), to
  rounding; the tests compare it with a float64 reference.

The state is optax's `MuonState` (count, mu, ns_coeffs), so `muon` below has the very state
tree optax.contrib.muon has: checkpoints do not depend on which one ran.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, MuonState

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # optax's (and Keller Jordan's) quintic
F32 = jnp.float32


class _Layout(NamedTuple):
    """How one parameter maps to [*batch, rows, cols] (rows <= cols) and back."""
    perm: tuple[int, ...]        # batch axes, then the reduction axes, then the output axes
    flat: tuple[int, ...]        # [*batch, fan_in, fan_out]
    transposed: bool             # fan_in > fan_out: the matrices are [fan_out, fan_in]
    nred: int = 1                # how many of perm's axes after the batch axes are reduction axes

    @property
    def key(self) -> tuple[int, ...]:
        """The shape the matrices are orthogonalised in: stacked with every parameter of the same key."""
        *batch, m, n = self.flat
        return (*batch, n, m) if self.transposed else self.flat


def _axes(x, axis) -> tuple[int, ...]:
    return tuple(a % x.ndim for a in ((axis,) if isinstance(axis, int) else axis))


def layout(x, dims: MuonDimensionNumbers) -> _Layout:
    """x's matrices as optax.contrib.muon sees them (`MuonDimensionNumbers`: every axis that is
    neither reduction nor output is a batch axis)."""
    red, out = _axes(x, dims.reduction_axis), _axes(x, dims.output_axis)
    if set(red) & set(out) or x.ndim < 2:
        raise ValueError(f"Muon: reduction axes {red} and output axes {out} of a {x.shape} array")
    batch = tuple(a for a in range(x.ndim) if a not in red + out)
    m, n = math.prod(x.shape[a] for a in red), math.prod(x.shape[a] for a in out)
    return _Layout(batch + red + out, tuple(x.shape[a] for a in batch) + (m, n), m > n, len(red))


def to_matrices(x, lay: _Layout):
    y = jnp.transpose(x, lay.perm).reshape(lay.flat)
    return jnp.swapaxes(y, -1, -2) if lay.transposed else y


def from_matrices(y, lay: _Layout, shape):
    if lay.transposed:
        y = jnp.swapaxes(y, -1, -2)
    inverse = tuple(sorted(range(len(lay.perm)), key=lambda i: lay.perm[i]))
    return y.reshape(tuple(shape[a] for a in lay.perm)).transpose(inverse)


def newton_schulz(x, *, steps: int, coeffs=NS_COEFFS, eps: float = 1e-8, dtype=jnp.bfloat16):
    """x [..., rows, cols] (rows <= cols): each matrix divided by (its Frobenius norm + eps),
    then `steps` iterations X <- aX + (bA + cA^2) X with A = X X^T, in `dtype` (see the module
    docstring). Returns [..., rows, cols] in `dtype`."""
    x32 = x.astype(F32)
    norm = jnp.sqrt(jnp.sum(x32 * x32, axis=(-2, -1), keepdims=True))
    x = (x32 / (norm + eps)).astype(dtype)
    a, b, c = coeffs

    def step(_, x):
        gram = jnp.einsum("...ij,...kj->...ik", x, x)
        poly = b * gram + c * jnp.einsum("...ij,...jk->...ik", gram, gram)
        return a * x + jnp.einsum("...ij,...jk->...ik", poly, x)

    return jax.lax.fori_loop(0, steps, step, x)


def orthogonalize(leaves, dims, *, steps: int, coeffs=NS_COEFFS, eps: float = 1e-8, dtype=jnp.bfloat16,
                  specs=None):
    """Newton-Schulz on every matrix of every leaf (`dims[i]` says leaf i's matrices), leaves
    whose matrices share one [*batch, rows, cols] shape stacked into one chain. Returns the
    orthogonalised leaves, each in its own shape and dtype.

    specs: None, or one logical PartitionSpec per leaf (k3jax.sharding.rules' names, before
    fitting to a mesh). Under an active mesh, a leaf whose fitted spec splits its matrix
    dimensions (FSDP, tensor) is orthogonalised by `_orthogonalize_spread` (whole matrices
    spread over the devices that hold its pieces) instead of being gathered whole on every
    device."""
    lays = [layout(x, d) for x, d in zip(leaves, dims)]
    out = [None] * len(leaves)
    run = lambda m: newton_schulz(m, steps=steps, coeffs=coeffs, eps=eps, dtype=dtype)  # noqa: E731
    groups: dict[tuple, list[int]] = {}
    for i, lay in enumerate(lays):
        fitted = _split_matrix_spec(leaves[i], lay, specs[i] if specs is not None else None)
        if fitted is not None:
            out[i] = _orthogonalize_spread(leaves[i], lay, fitted, run, dtype)
        else:
            groups.setdefault(lay.key, []).append(i)
    for idx in groups.values():
        mats = jnp.stack([to_matrices(leaves[i], lays[i]).astype(dtype) if dtype != F32
                          else to_matrices(leaves[i], lays[i]) for i in idx])
        ortho = run(mats)
        for j, i in enumerate(idx):
            out[i] = from_matrices(ortho[j], lays[i], leaves[i].shape).astype(leaves[i].dtype)
    return out


def _split_matrix_spec(x, lay: _Layout, logical_spec):
    """The mesh spec of leaf x (its logical spec fitted to the active mesh) when it splits one
    of x's matrix (reduction or output) dimensions over the mesh; None otherwise (no mesh, no
    spec, or only batch dimensions split: those matrices are whole on their devices already)."""
    if logical_spec is None:
        return None
    from k3jax.ops.mesh_axes import active_mesh
    from k3jax.sharding.rules import _fit

    mesh = active_mesh(())
    if mesh is None:
        return None
    spec = _fit(logical_spec, x.shape, mesh)
    nbatch = len(lay.flat) - 2
    matrix_dims = lay.perm[nbatch:]
    entries = tuple(spec) + (None,) * (x.ndim - len(spec))
    return spec if any(entries[d] is not None for d in matrix_dims) else None


def _mesh_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _orthogonalize_spread(x, lay: _Layout, spec, run, dtype):
    """`run` (Newton-Schulz over [b, rows, cols]) on leaf x, split over the mesh by `spec`
    along some matrix dimensions, without gathering x whole anywhere.

    Newton-Schulz needs whole matrices, but FSDP and tensor parallelism split the parameters
    along their matrix dimensions: left to itself, XLA gathers each stacked parameter whole on
    every device (K3's expert w1 on 2,048 H200s: 217 GB per device). Here, per device (a
    shard_map with the leaf's own spec), the local matrices' pieces are flattened to one batch
    axis, padded with zero matrices (Newton-Schulz maps zero to zero) to a multiple of G, the
    number of devices along the mesh axes that split the matrix dimensions, and exchanged by
    all-to-alls over those axes (batch split, matrix dimension concatenated; an axis's minor
    mesh axis first, so the concatenation is in global order): each device then holds
    ceil(local batch / G) whole matrices, orthogonalises them, and the inverse all-to-alls put
    every piece back where it was. Memory stays at about the local shard; the bytes moved are
    twice the shard."""
    from jax.sharding import PartitionSpec as P

    nbatch = len(lay.flat) - 2
    entries = tuple(spec) + (None,) * (x.ndim - len(spec))
    # the transposed leaf's dims: batch, reduction, output; each matrix dim with its mesh axes
    # listed minor first (the order the gathers must run in)
    # (axis of the per-device array [b, *reduction dims, *output dims], mesh axis)
    exchanges = [(1 + k, a) for k, d in enumerate(lay.perm[nbatch:]) for a in reversed(_mesh_axes(entries[d]))]
    group = math.prod(jax.sharding.get_abstract_mesh().shape[a] for _, a in exchanges)

    def per_device(local):
        t = jnp.transpose(local, lay.perm)
        batch_shape = t.shape[:nbatch]
        t = t.reshape((-1,) + t.shape[nbatch:])  # [b, *reduction dims, *output dims]
        b = t.shape[0]
        pad = (-b) % group
        if pad:
            t = jnp.concatenate([t, jnp.zeros((pad,) + t.shape[1:], t.dtype)])
        for dim, axis in exchanges:  # batch split over the axis, that matrix dim gathered
            t = jax.lax.all_to_all(t, axis, 0, dim, tiled=True)
        whole = t.shape
        m = math.prod(whole[1:1 + lay.nred])
        mats = t.reshape(whole[0], m, -1)
        mats = mats.astype(dtype) if dtype != F32 else mats
        if lay.transposed:
            mats = jnp.swapaxes(mats, -1, -2)
        mats = run(mats)
        if lay.transposed:
            mats = jnp.swapaxes(mats, -1, -2)
        t = mats.reshape(whole).astype(local.dtype)
        for dim, axis in reversed(exchanges):
            t = jax.lax.all_to_all(t, axis, dim, 0, tiled=True)
        t = t[:b].reshape(batch_shape + t.shape[1:])
        inverse = tuple(sorted(range(len(lay.perm)), key=lambda i: lay.perm[i]))
        return jnp.transpose(t, inverse)

    spec = P(*entries)
    return jax.shard_map(per_device, in_specs=spec, out_specs=spec, check_vma=False)(x)


def _is_dims(x) -> bool:
    return isinstance(x, MuonDimensionNumbers)


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def scale_by_batched_muon(weight_dimension_numbers, *, ns_steps: int = 5, beta: float = 0.95, eps: float = 1e-8,
                          nesterov: bool = True, dtype=jnp.bfloat16, partition_specs=None) -> optax.GradientTransformation:
    """optax.contrib.scale_by_muon (frobenius preconditioning, optional Nesterov) with
    `orthogonalize` in place of its per-parameter Newton-Schulz. weight_dimension_numbers: a
    tree of MuonDimensionNumbers (or a callable params -> that tree; masked leaves allowed);
    partition_specs: None, or a tree (or callable) like it of the leaves' logical
    PartitionSpecs (see `orthogonalize`)."""

    def init_fn(params):
        return MuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params),
                         ns_coeffs=jnp.asarray(NS_COEFFS))

    def update_fn(updates, state, params=None):
        del params
        dims_tree = weight_dimension_numbers(updates) if callable(weight_dimension_numbers) \
            else weight_dimension_numbers
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count_inc = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta, optax.safe_increment(count_inc)),
                                  optax.tree.bias_correction(updates, beta, count_inc))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count_inc)
        leaves, treedef = jax.tree.flatten(mu_hat)
        dims = jax.tree.leaves(dims_tree, is_leaf=_is_dims)  # masked entries have no leaves
        if len(dims) != len(leaves):
            raise ValueError(f"Muon: {len(leaves)} updates but {len(dims)} dimension numbers")
        specs = None
        if partition_specs is not None:
            specs_tree = partition_specs(updates) if callable(partition_specs) else partition_specs
            specs = jax.tree.leaves(specs_tree, is_leaf=_is_spec)
            if len(specs) != len(leaves):
                raise ValueError(f"Muon: {len(leaves)} updates but {len(specs)} partition specs")
        ortho = orthogonalize(leaves, dims, steps=ns_steps, eps=eps, dtype=dtype, specs=specs)
        return jax.tree.unflatten(treedef, ortho), MuonState(count=count_inc, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(init_fn, update_fn)


def muon(learning_rate, *, dimension_numbers, ns_steps: int = 5, beta: float = 0.95, eps: float = 1e-8,
         weight_decay: float = 0.0, weight_decay_mask=None, consistent_rms: float | None = 0.2,
         dtype=jnp.bfloat16, partition_specs=None) -> optax.GradientTransformation:
    """Drop-in for optax.contrib.muon(nesterov=True, muon_weight_dimension_numbers=...) on a
    tree where every leaf is a Muon matrix or masked out by the caller's partition: the same
    transformations (momentum and Newton-Schulz, the shape scale, decoupled decay, the
    learning rate) under the same `partition` labels, so the state tree is optax's.
    partition_specs: None, or a tree (or callable) like dimension_numbers of each leaf's logical
    PartitionSpec (None for AdamW leaves): on a mesh, matrices split over it are orthogonalised
    without being gathered whole (`orthogonalize`)."""
    from optax.contrib._muon import scale_by_shape  # the per-parameter 0.2 sqrt(max(m, n)) scale

    def labels(params):
        dims = dimension_numbers(params) if callable(dimension_numbers) else dimension_numbers
        return jax.tree.map(lambda d, x: jax.tree.map(lambda _: "adam" if d is None else "muon", x), dims, params,
                            is_leaf=lambda x: x is None or _is_dims(x))

    def muon_dims(params):
        dims = dimension_numbers(params) if callable(dimension_numbers) else dimension_numbers
        mask = jax.tree.map(lambda label: label == "muon", labels(params))
        return jax.tree.map(lambda d, m: jax.tree.map(lambda keep: d if keep else optax.MaskedNode(), m), dims, mask,
                            is_leaf=lambda x: x is None or _is_dims(x) or isinstance(x, optax.MaskedNode))

    def muon_specs(params):
        specs = partition_specs(params) if callable(partition_specs) else partition_specs
        return jax.tree.map(lambda s, label: s if label == "muon" else optax.MaskedNode(), specs, labels(params),
                            is_leaf=lambda x: x is None or _is_spec(x))

    return optax.partition(
        transforms={
            "muon": optax.chain(
                scale_by_batched_muon(muon_dims, ns_steps=ns_steps, beta=beta, eps=eps, nesterov=True, dtype=dtype,
                                      partition_specs=None if partition_specs is None else muon_specs),
                scale_by_shape(weight_dimension_numbers=muon_dims, consistent_rms=consistent_rms),
                optax.add_decayed_weights(weight_decay, weight_decay_mask),
                optax.scale_by_learning_rate(learning_rate)),
            # never receives a leaf here (the caller routes AdamW parameters elsewhere); kept so
            # the state tree is optax.contrib.muon's
            "adam": optax.adamw(learning_rate=learning_rate, eps=eps, weight_decay=0.0, nesterov=True),
        },
        param_labels=labels)
