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
    return _Layout(batch + red + out, tuple(x.shape[a] for a in batch) + (m, n), m > n)


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


def orthogonalize(leaves, dims, *, steps: int, coeffs=NS_COEFFS, eps: float = 1e-8, dtype=jnp.bfloat16):
    """Newton-Schulz on every matrix of every leaf (`dims[i]` says leaf i's matrices), leaves
    whose matrices share one [*batch, rows, cols] shape stacked into one chain. Returns the
    orthogonalised leaves, each in its own shape and dtype."""
    lays = [layout(x, d) for x, d in zip(leaves, dims)]
    groups: dict[tuple, list[int]] = {}
    for i, lay in enumerate(lays):
        groups.setdefault(lay.key, []).append(i)
    out = [None] * len(leaves)
    for idx in groups.values():
        mats = jnp.stack([to_matrices(leaves[i], lays[i]).astype(dtype) if dtype != F32
                          else to_matrices(leaves[i], lays[i]) for i in idx])
        ortho = newton_schulz(mats, steps=steps, coeffs=coeffs, eps=eps, dtype=dtype)
        for j, i in enumerate(idx):
            out[i] = from_matrices(ortho[j], lays[i], leaves[i].shape).astype(leaves[i].dtype)
    return out


def _is_dims(x) -> bool:
    return isinstance(x, MuonDimensionNumbers)


def scale_by_batched_muon(weight_dimension_numbers, *, ns_steps: int = 5, beta: float = 0.95, eps: float = 1e-8,
                          nesterov: bool = True, dtype=jnp.bfloat16) -> optax.GradientTransformation:
    """optax.contrib.scale_by_muon (frobenius preconditioning, optional Nesterov) with
    `orthogonalize` in place of its per-parameter Newton-Schulz. weight_dimension_numbers: a
    tree of MuonDimensionNumbers (or a callable params -> that tree; masked leaves allowed)."""

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
        ortho = orthogonalize(leaves, dims, steps=ns_steps, eps=eps, dtype=dtype)
        return jax.tree.unflatten(treedef, ortho), MuonState(count=count_inc, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(init_fn, update_fn)


def muon(learning_rate, *, dimension_numbers, ns_steps: int = 5, beta: float = 0.95, eps: float = 1e-8,
         weight_decay: float = 0.0, weight_decay_mask=None, consistent_rms: float | None = 0.2,
         dtype=jnp.bfloat16) -> optax.GradientTransformation:
    """Drop-in for optax.contrib.muon(nesterov=True, muon_weight_dimension_numbers=...) on a
    tree where every leaf is a Muon matrix or masked out by the caller's partition: the same
    transformations (momentum and Newton-Schulz, the shape scale, decoupled decay, the
    learning rate) under the same `partition` labels, so the state tree is optax's."""
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

    return optax.partition(
        transforms={
            "muon": optax.chain(
                scale_by_batched_muon(muon_dims, ns_steps=ns_steps, beta=beta, eps=eps, nesterov=True, dtype=dtype),
                scale_by_shape(weight_dimension_numbers=muon_dims, consistent_rms=consistent_rms),
                optax.add_decayed_weights(weight_decay, weight_decay_mask),
                optax.scale_by_learning_rate(learning_rate)),
            # never receives a leaf here (the caller routes AdamW parameters elsewhere); kept so
            # the state tree is optax.contrib.muon's
            "adam": optax.adamw(learning_rate=learning_rate, eps=eps, weight_decay=0.0, nesterov=True),
        },
        param_labels=labels)
