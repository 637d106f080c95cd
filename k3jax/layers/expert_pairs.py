"""The (token, expert) pairs of top-k routing: sorted by expert, so each expert's rows are
contiguous for the grouped matmuls, and combined back into one row per token.

Used by both expert dispatches: single-device (`k3jax.layers.moe`) and expert-parallel
(`k3jax.layers.expert_parallel`).
"""

from __future__ import annotations

import jax.numpy as jnp


def sort_pairs(topk_idx):
    """topk_idx [N,k] int -> (order [N*k], experts [N*k], tokens [N*k]): the flat pair indices
    sorted by expert (stable, so an expert's pairs keep token order), then each sorted pair's
    expert and token."""
    k = topk_idx.shape[-1]
    flat = topk_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, flat[order], order // k


def unsort(rows, order):
    """rows [R, ...] in the order given by `order` [R] -> the original order (a gather by the
    inverse permutation)."""
    return rows[jnp.argsort(order)]


def combine_pairs(per_pair, order, topk_weight):
    """per_pair [N*k, l] results in sorted-pair order (from `sort_pairs`), topk_weight [N,k] ->
    the routing-weighted sum per token [N, l] fp32.

    Un-sorting and summing the k slots of each token gives what a scatter-add would, but
    deterministically (no duplicate-index atomics) and as a gather in the forward pass."""
    n, k = topk_weight.shape
    slots = unsort(per_pair, order).reshape(n, k, -1)
    return jnp.einsum("nk,nkl->nl", topk_weight.astype(jnp.float32), slots)
