"""Muon's orthogonalisation, batched by shape: one chain of batched matmuls per matrix shape.

optax.contrib.muon runs Newton-Schulz per parameter (a vmap over that parameter's stacked
layers, experts or heads): k3-small's per-head Muon is 119 parameters, 119 chains of 15
matmuls plus their elementwise work, most of them small. Here every Muon parameter's
matrices are brought to [*batch, fan_in, fan_out] (batch axes first, then the reduction axes
merged, then the output axes merged), and all matrices of one [fan_in, fan_out] are stacked
into one array and orthogonalised together: k3-small per head runs 15 chains (its 2,880
expert matrices in two, [768, 512] and [512, 768]), each a batched matmul over every layer,
expert and head of that shape. (Before: 21 chains, one per whole [*batch, rows, cols], so the
1-layer and 3-layer stages of one shape were two.)

Grouping and sharding. Off a mesh (or on one device), a leaf whose sharding is known (its
partition spec given) has its batch axes flattened and is concatenated with every other leaf
of its [rows, cols]; a leaf whose sharding is not known (no specs) is stacked along a new
leading axis with the leaves of the same batch shape only, so the grouping moves no data
between devices whatever their sharding. Under an active mesh with specs, the leaves go in
buckets of the same per-device piece and split (`train.muon_mesh`): each matrix is
orthogonalised once, whole, on one device, the work spread over every device that holds a
piece or a copy of it, and the results sent back where the pieces came from.

Tall matrices (fan_in > fan_out) are not transposed: their chain runs the iteration on the
other side, X <- X (aI + bA + cA^2) with A = X^T X, which is exactly the transpose of the wide
iteration optax runs on X^T. So tall and wide matrices of one pair of sizes are two chains
(k3-small's w1/w3 and w2 experts), and no transposed copy of any momentum is made. (On a mesh
each piece is rearranged locally before its exchange anyway: there a tall matrix is turned wide,
and tall and wide matrices of one pair of sizes share a bucket.)

One Newton-Schulz step is three matmuls and one elementwise pass over an m x m matrix
(m = the short side): A = X X^T, A2 = A A, P = aI + bA + cA2, X <- P X. Folding a into P
removes the m x n pass of aX + (bA + cA2)X (two bf16 reads and a write of X's size each
step: on k3-small's 512 x 768 expert matrices half the bytes the step's matmuls move). The
Frobenius normalisation is folded into the first step: ||X||^2 = trace(X X^T), so the first
Gram matrix (kept in fp32) is scaled by s^2, s = 1 / (||X|| + eps), and the first P by s;
the momentum is cast to the chain's dtype once, unscaled (rounding to bf16 is relative, so
it rounds as the scaled one would), with no separate pass over it for its norm. The steps
are unrolled: XLA:GPU syncs a while loop's predicate with the host every iteration unless
the loop runs as a CUDA-graph conditional.

Numerics (`dtype`):
- bfloat16 (the default), as Moonlight's and Kimi K2's Muon run it: the norm in fp32, then
  every iterate X, its Gram matrix A, A^2 and P in bf16, matmuls accumulating in fp32 (XLA's
  GPU and TPU matmuls of bf16 operands do; the first Gram matrix is returned in fp32 for the
  norm); P is computed in fp32 from the bf16 A and A^2 and rounded once. bf16 is exact enough
  because the quintic (3.4445, -4.7750, 2.0315) only pushes singular values into about
  [0.7, 1.2], not to 1: the update lies within a few percent (relative Frobenius norm) of the
  float64 iteration's, the quintic's slope of 3.4 near zero amplifying each iterate's 2^-9
  rounding. Measured on XLA:CPU (the shapes of tests/test_muon.py, Gaussian): at most 0.041 for
  4x6 to 7x4 over 20 seeds, 0.016 at 96x64, 0.012 at 256x384; the previous form (aX + QX in
  bf16, three roundings of X's size a step) 0.16, 0.057 and 0.037. Muon's scale
  (0.2 sqrt(max(m, n))) is applied in fp32.
- float32 (optimizer.muon_dtype=float32): optax.contrib.muon's iteration (default matmul
  precision), to fp32 rounding; the tests compare it with optax's and with a float64 reference.

The state is optax's `MuonState` (count, mu, ns_coeffs), so `muon` below has the very state
tree optax.contrib.muon has: checkpoints do not depend on which one ran.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, MuonState

from train.muon_mesh import mesh_buckets, orthogonalize_bucket, placement

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # optax's (and Keller Jordan's) quintic
F32 = jnp.float32


class _Layout(NamedTuple):
    """How one parameter maps to [*batch, fan_in, fan_out] and back."""
    perm: tuple[int, ...]        # batch axes, then the reduction axes, then the output axes
    flat: tuple[int, ...]        # [*batch, fan_in, fan_out]
    transposed: bool             # fan_in > fan_out: a tall matrix (its chain works on the right)
    nred: int = 1                # how many of perm's axes after the batch axes are reduction axes

    @property
    def matrix(self) -> tuple[int, int]:
        return self.flat[-2], self.flat[-1]

    @property
    def batch(self) -> tuple[int, ...]:
        return self.flat[:-2]


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
    """x -> [*batch, fan_in, fan_out] (a transpose only where the batch axes are not leading
    or the reduction axes not before the output axes)."""
    return jnp.transpose(x, lay.perm).reshape(lay.flat)


def from_matrices(y, lay: _Layout, shape):
    inverse = tuple(sorted(range(len(lay.perm)), key=lambda i: lay.perm[i]))
    return y.reshape(tuple(shape[a] for a in lay.perm)).transpose(inverse)


def _gram(x, tall: bool, out_dtype=None):
    """x [..., r, c] -> X X^T [..., r, r] (wide) or X^T X [..., c, c] (tall)."""
    eq = "...ji,...jk->...ik" if tall else "...ij,...kj->...ik"
    return jnp.einsum(eq, x, x, preferred_element_type=out_dtype)


def _trace(a):
    """a [..., k, k] -> its traces [..., 1, 1]: a strided slice of the diagonal (k elements read,
    where jnp.trace masks and reads all k^2)."""
    k = a.shape[-1]
    diag = a.reshape(a.shape[:-2] + (k * k,))[..., :: k + 1]
    return jnp.sum(diag, axis=-1)[..., None, None]


def newton_schulz(x, *, steps: int, coeffs=NS_COEFFS, eps: float = 1e-8, dtype=jnp.bfloat16):
    """x [..., rows, cols]: each matrix divided by (its Frobenius norm + eps), then `steps`
    iterations X <- P X with P = aI + bA + cA^2, A = X X^T (wide, rows <= cols), or X <- X P
    with A = X^T X (tall: the transposed wide iteration), in `dtype` (see the module
    docstring). The normalisation is folded into the first step (the first A scaled by s^2,
    the first P by s, s = 1 / (sqrt(trace(A)) + eps)). Returns [..., rows, cols] in `dtype`."""
    tall = x.shape[-2] > x.shape[-1]
    k = min(x.shape[-2:])
    x = x.astype(dtype)
    a, b, c = coeffs
    eye = jnp.eye(k, dtype=F32)
    gram = _gram(x, tall, F32)  # fp32 out: the norm and the first scaled A are rounded once
    sq = _trace(gram)  # ||X||_F^2 [..., 1, 1], fp32
    s = 1.0 / (jnp.sqrt(sq) + eps)
    if steps == 0:
        return (x.astype(F32) * s).astype(dtype)
    gram = (gram * (s * s)).astype(dtype)  # A of the normalised X
    for i in range(steps):
        if i:
            gram = _gram(x, tall)
        sq_gram = jnp.einsum("...ij,...jk->...ik", gram, gram)
        # P = aI + bA + cA^2, in fp32 from the bf16 products, rounded once
        poly = a * eye + b * gram.astype(F32) + c * sq_gram.astype(F32)
        if i == 0:
            poly = poly * s  # X here is the unnormalised momentum
        poly = poly.astype(dtype)
        x = jnp.einsum("...ij,...jk->...ik", x, poly) if tall else jnp.einsum("...ij,...jk->...ik", poly, x)
    return x


def _grouping_key(lay: _Layout, known: bool) -> tuple:
    """The chain key of one leaf off a mesh: ("flat", rows, cols) when its sharding is known
    (its partition spec given: flattened to [-1, rows, cols] and concatenated with every such
    leaf of its (rows, cols)), else ("stacked", batch shape, rows, cols) (stacked on a new
    leading axis with leaves of the same batch shape only: whatever sharding they have stays
    where it is, so the grouping moves no data between devices)."""
    if known:
        return ("flat",) + lay.matrix
    return ("stacked", lay.batch) + lay.matrix


def orthogonalize(leaves, dims, *, steps: int, coeffs=NS_COEFFS, eps: float = 1e-8, dtype=jnp.bfloat16,
                  specs=None):
    """Newton-Schulz on every matrix of every leaf (`dims[i]` says leaf i's matrices). Returns
    the orthogonalised leaves, each in its own shape and dtype.

    specs: None, or one logical PartitionSpec per leaf (k3jax.sharding.rules' names, before
    fitting to a mesh). Under an active mesh with specs, the leaves go in buckets that
    orthogonalise each matrix once, on one device (`train.muon_mesh`); otherwise all matrices
    of one [rows, cols] run as one chain (see the module docstring). Without specs the leaves'
    shardings are unknown here: only leaves of one batch shape are stacked together (on a new
    axis, whatever their sharding)."""
    groups = plan_groups(leaves, dims, specs)
    out = [None] * len(leaves)
    run = lambda m: newton_schulz(m, steps=steps, coeffs=coeffs, eps=eps, dtype=dtype)  # noqa: E731
    for bucket in groups.buckets:
        pls = [groups.placements[i] for i in bucket.leaves]
        for i, y in zip(bucket.leaves, orthogonalize_bucket([leaves[i] for i in bucket.leaves], pls, bucket, run,
                                                            dtype)):
            out[i] = y
    for (kind, *_), idx in groups.chains.items():
        lays = [groups.layouts[i] for i in idx]
        mats = [to_matrices(leaves[i], lay).astype(dtype) for i, lay in zip(idx, lays)]
        if kind == "flat":
            sizes = [math.prod(lay.batch) for lay in lays]
            ortho = run(jnp.concatenate([m.reshape((-1,) + lay.matrix) for m, lay in zip(mats, lays)]))
            parts = jnp.split(ortho, list(itertools.accumulate(sizes))[:-1])
        else:
            parts = run(jnp.stack(mats))
        for j, (i, lay) in enumerate(zip(idx, lays)):
            out[i] = from_matrices(parts[j], lay, leaves[i].shape).astype(leaves[i].dtype)
    return out


class Groups(NamedTuple):
    layouts: list                # one _Layout per leaf
    chains: dict                 # group key -> leaf indices, one Newton-Schulz chain each (off a mesh)
    buckets: list                # on a mesh: train.muon_mesh.Bucket, each matrix orthogonalised once
    placements: dict             # leaf index -> train.muon_mesh.Placement (leaves in buckets)


def plan_groups(leaves, dims, specs=None, mesh=None) -> Groups:
    """Which leaves share a chain or a bucket (see `orthogonalize`); leaves are arrays or
    ShapeDtypeStructs. mesh: the mesh to plan for (anything with `.shape` and `.axis_names`,
    an AbstractMesh for the planner); default the active one."""
    lays = [layout(x, d) for x, d in zip(leaves, dims)]
    if mesh is None:
        from k3jax.ops.mesh_axes import active_mesh

        mesh = active_mesh(())
    elif math.prod(mesh.shape.values()) == 1:
        mesh = None
    if mesh is not None and specs is not None:
        from k3jax.sharding.rules import fit_spec

        sizes = dict(mesh.shape)
        pls = {i: placement(x.shape, lay, fit_spec(s, x.shape, mesh), sizes, tuple(mesh.axis_names))
               for i, (x, lay, s) in enumerate(zip(leaves, lays, specs))}
        buckets = mesh_buckets([pls[i] for i in range(len(leaves))], sizes)
        return Groups(lays, {}, buckets, pls)
    chains: dict[tuple, list[int]] = {}
    for i, lay in enumerate(lays):
        chains.setdefault(_grouping_key(lay, specs is not None), []).append(i)
    return Groups(lays, chains, [], {})


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
    PartitionSpec (None for AdamW leaves): on a mesh, each matrix is orthogonalised once, on one
    device, without any leaf being gathered whole (`orthogonalize`, `train.muon_mesh`)."""
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
