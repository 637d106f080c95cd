"""Grouped matmul for dropless MoE: rows sorted by group, each group times its own weight.

    x [M,D] (rows of group g contiguous, groups in order), w [G,D,F], group_sizes [G] int
    -> y [M,F];  y[r] = x[r] @ w[g(r)], and 0 for rows past sum(group_sizes).

Two fast forms of the same function:

* `ragged`: `jax.lax.ragged_dot`. Native grouped GEMM on TPU.
* `blocked`: every group is padded up to a multiple of `block` rows, so each block of
  `block` rows belongs to one group and the product is one batched matmul
  [nb,block,D] x [nb,D,F] over blocks, with the block's weight gathered. The default on
  GPU and CPU, where XLA (as of jax 0.10/0.11) rewrites ragged_dot into a dense dot over
  *all* groups: G times the FLOPs and a [G, M, F]-sized buffer (k3-small, 64 experts:
  98 GB vs 9 GB on an H200 at 32k tokens; 132 vs 44 GiB of XLA:CPU temporaries per
  4096-token sequence). Padding costs at most G*(block-1) rows, and the weight
  gather nb*D*F elements; block 512 was the fastest at k3-small's shapes on an H200 (BENCHMARKS.md).

`grouped_matmul_reference` is the naive per-row form the tests compare both against.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Impl = Literal["auto", "ragged", "blocked"]


def default_impl() -> str:
    return "ragged" if jax.default_backend() == "tpu" else "blocked"


def grouped_matmul(x, w, group_sizes, *, impl: Impl = "auto", block: int = 512, preferred_element_type=None):
    """x [M,D], w [G,D,F], group_sizes [G] int32 (sum <= M) -> [M,F] in preferred_element_type."""
    impl = default_impl() if impl == "auto" else impl
    if impl == "ragged":
        return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=preferred_element_type)
    if impl == "blocked":
        return grouped_matmul_blocked(x, w, group_sizes, block=block, preferred_element_type=preferred_element_type)
    raise ValueError(f"grouped_matmul impl must be auto, ragged or blocked, got {impl!r}")


def grouped_matmul_blocked(x, w, group_sizes, *, block: int = 512, preferred_element_type=None):
    """The padded-block form (see module docstring). Shapes as `grouped_matmul`."""
    M, D = x.shape
    G, _, F = w.shape
    block = max(1, min(block, M))
    nb = -(-(M + G * (block - 1)) // block)  # enough blocks for the worst-case padding
    sizes = group_sizes.astype(jnp.int32)
    padded = -(-sizes // block) * block
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    # each padded slot p reads source row starts[g] + (p - padded_starts[g]) when that is
    # inside group g, else zero; a gather (not a scatter) so its transpose has unique indices
    slot = jnp.arange(nb * block, dtype=jnp.int32)
    slot_group = jnp.minimum(jnp.searchsorted(padded_ends, slot, side="right"), G - 1).astype(jnp.int32)
    offset = slot - padded_starts[slot_group]
    valid = (offset < sizes[slot_group]) & (slot < padded_ends[-1])
    src = jnp.where(valid, starts[slot_group] + offset, 0)
    xb = jnp.where(valid[:, None], x[src], jnp.zeros((), x.dtype)).reshape(nb, block, D)
    block_group = slot_group[::block]
    yb = jnp.einsum("nbd,ndf->nbf", xb, w[block_group], preferred_element_type=preferred_element_type)
    # row r of group g sits at padded slot padded_starts[g] + (r - starts[g])
    row = jnp.arange(M, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), G - 1).astype(jnp.int32)
    dest = padded_starts[row_group] + row - starts[row_group]
    in_a_group = row < ends[-1]
    y = yb.reshape(nb * block, F)[jnp.where(in_a_group, dest, 0)]
    return jnp.where(in_a_group[:, None], y, jnp.zeros((), y.dtype))


def grouped_matmul_reference(x, w, group_sizes, *, preferred_element_type=None):
    """Naive form: gather each row's weight matrix ([M,D,F] in memory; tests only)."""
    M = x.shape[0]
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(M)
    g = jnp.minimum(jnp.searchsorted(ends, row, side="right"), w.shape[0] - 1)
    y = jnp.einsum("md,mdf->mf", x, w[g], preferred_element_type=preferred_element_type)
    return jnp.where((row < ends[-1])[:, None], y, jnp.zeros((), y.dtype))
