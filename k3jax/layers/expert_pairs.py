"""The (token, expert) pairs of top-k routing: sorted by expert, so each expert's rows are
contiguous for the grouped matmuls, and combined back into one row per token.

Used by both expert dispatches: single-device (`k3jax.layers.moe`) and expert-parallel
(`k3jax.layers.expert_parallel`).

The sort is a permutation, and every move of rows through it is written as a gather in both
directions (custom VJPs): autodiff of a gather is a scatter-add, which XLA must assume has
colliding indices (atomics; for the dispatch each token's k rows really do collide), and
which the 2026-12-01 profile of k3-small put at 39 ms of a 744 ms step
(benchmarks/results/k3-small-2026-12-01/README.md). Here the inverse permutation comes from a
scatter of unique indices (no second sort), and a token's k pair gradients are summed by a gather
and a reduction, in fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def sort_pairs(topk_idx):
    """topk_idx [N,k] int -> (order [N*k], experts [N*k], tokens [N*k]): the flat pair indices
    sorted by expert (stable, so an expert's pairs keep token order), then each sorted pair's
    expert and token."""
    k = topk_idx.shape[-1]
    flat = topk_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, flat[order], order // k


def inverse_permutation(order):
    """order [R], a permutation of 0..R-1 -> inv [R] with inv[order[i]] = i (a scatter of
    unique indices: no sort, no collisions)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)


@jax.custom_vjp
def unsort(rows, order):
    """rows [R, ...] in the order given by the permutation `order` [R] -> the original order
    (rows[inv], inv the inverse permutation); its gradient is the gather d[order]."""
    return rows[inverse_permutation(order)]


def _unsort_fwd(rows, order):
    return unsort(rows, order), order


def _unsort_bwd(order, d):
    return d[order], None


unsort.defvjp(_unsort_fwd, _unsort_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dispatch_rows(x, order, k: int):
    """x [N, ...] one row per token, order [N*k] from `sort_pairs` -> [N*k, ...]: row i is x of
    sorted pair i's token (x[order // k]). Gradient: each token's k pair rows summed in fp32
    (a gather through the inverse permutation), not a colliding scatter-add."""
    return x[order // k]


def _dispatch_fwd(x, order, k):
    return x[order // k], order


def _dispatch_bwd(k, order, d):
    n = d.shape[0] // k
    per_token = d[inverse_permutation(order)].reshape((n, k) + d.shape[1:])
    return jnp.sum(per_token.astype(jnp.float32), axis=1).astype(d.dtype), None


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


def combine_pairs(per_pair, order, topk_weight):
    """per_pair [N*k, l] results in sorted-pair order (from `sort_pairs`), topk_weight [N,k] ->
    the routing-weighted sum per token [N, l] fp32.

    Un-sorting and summing the k slots of each token gives what a scatter-add would, but
    deterministically (no duplicate-index atomics) and as a gather in both passes; the sum
    over k is elementwise (not a batched matmul with K = k)."""
    n, k = topk_weight.shape
    slots = unsort(per_pair, order).reshape(n, k, -1).astype(jnp.float32)
    return jnp.sum(topk_weight.astype(jnp.float32)[..., None] * slots, axis=1)
