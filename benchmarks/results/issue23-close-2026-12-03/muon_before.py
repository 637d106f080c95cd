"""train/muon.py's one-device Newton-Schulz as it was before the issue-23 round (commit
8295de7), kept so benchmarks/optimizer_step.py can time the old and new paths in one process.

What it did: the leaves grouped by their whole [*batch, rows, cols] layout (k3-small per head:
21 chains; the 1-layer and 3-layer stages of one matrix shape were two chains), tall matrices
transposed to wide (a transposed copy), the momentum normalised in fp32 by a separate pass,
and the 5 steps in a `fori_loop` (a while loop on GPU), each step
X <- aX + (bA + cA^2) X: three matmuls, an m x m and an m x n elementwise pass.

`install()` puts it in place of train.muon.orthogonalize (one device only: no spread path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import train.muon as muon_mod

F32 = jnp.float32


def newton_schulz_before(x, *, steps, coeffs=muon_mod.NS_COEFFS, eps=1e-8, dtype=jnp.bfloat16):
    """x [..., rows, cols] (rows <= cols), as the old train/muon.py ran it."""
    x32 = x.astype(F32)
    norm = jnp.sqrt(jnp.sum(x32 * x32, axis=(-2, -1), keepdims=True))
    x = (x32 / (norm + eps)).astype(dtype)
    a, b, c = coeffs

    def step(_, x):
        gram = jnp.einsum("...ij,...kj->...ik", x, x)
        poly = b * gram + c * jnp.einsum("...ij,...jk->...ik", gram, gram)
        return a * x + jnp.einsum("...ij,...jk->...ik", poly, x)

    return jax.lax.fori_loop(0, steps, step, x)


def orthogonalize_before(leaves, dims, *, steps, coeffs=muon_mod.NS_COEFFS, eps=1e-8, dtype=jnp.bfloat16,
                         specs=None):
    del specs  # one device
    lays = [muon_mod.layout(x, d) for x, d in zip(leaves, dims)]
    groups: dict[tuple, list[int]] = {}
    for i, lay in enumerate(lays):
        key = lay.batch + (lay.matrix[::-1] if lay.transposed else lay.matrix)
        groups.setdefault(key, []).append(i)
    out = [None] * len(leaves)
    for idx in groups.values():
        mats = []
        for i in idx:
            m = muon_mod.to_matrices(leaves[i], lays[i])
            mats.append((jnp.swapaxes(m, -1, -2) if lays[i].transposed else m).astype(dtype))
        ortho = newton_schulz_before(jnp.stack(mats), steps=steps, coeffs=coeffs, eps=eps, dtype=dtype)
        for j, i in enumerate(idx):
            y = jnp.swapaxes(ortho[j], -1, -2) if lays[i].transposed else ortho[j]
            out[i] = muon_mod.from_matrices(y, lays[i], leaves[i].shape).astype(leaves[i].dtype)
    return out


def install():
    """Use the old path in train.muon (returns a function that restores the new one)."""
    saved = muon_mod.orthogonalize
    muon_mod.orthogonalize = orthogonalize_before
    return lambda: setattr(muon_mod, "orthogonalize", saved)
