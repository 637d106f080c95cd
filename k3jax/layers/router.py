"""Sigmoid top-k router with a selection-only bias (DeepSeek-V3 "noaux_tc"), optionally limited
to `moe.max_nodes_per_token` groups of experts (off for K3; `limit_nodes`).

The bias is not stored here: the model owns one `RouterBias` [num_moe_layers, E] and passes
each MoE layer its row, so Quantile Balancing updates every layer in one vectorised op and
the bias travels with the train state without being a parameter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.common import EMBED, EXPERT, normal_param
from k3jax.ops.router_logits import router_logits


class Router(nnx.Module):
    """scores = sigmoid(x W) [N,E]; top-k on scores + bias; weights from the unbiased scores."""

    def __init__(self, model_cfg, *, rngs: nnx.Rngs):
        moe = model_cfg.moe
        # fp32 storage regardless of param_dtype: routing decisions flip on tiny logit changes
        self.weight = normal_param(rngs, (model_cfg.d_model, moe.num_experts), (EMBED, EXPERT),
                                   model_cfg.init_std, jnp.float32)
        self.top_k = moe.top_k
        self.scaling = float(moe.routed_scaling_factor)
        self.max_nodes, self.nodes = moe.max_nodes_per_token, moe.expert_nodes

    def __call__(self, x, bias, *, with_cutoff: bool = False, logits=None):
        """x [N,d], bias [E] fp32 -> (topk_idx [N,k] int32, topk_weight [N,k] fp32, scores [N,E] fp32),
        and with `with_cutoff` also each token's (k+1)-th largest biased score [N] (Quantile
        Balancing's cutoff, `k3jax.layers.qb`), from the same top-(k+1) instead of a second
        top-k over the scores (the first k of a top-(k+1) are the top-k, ties included).
        logits [N,E] fp32: x W already computed (a decode step's gemv kernel, in fp32)."""
        # fp32-accurate on every backend (accelerators default to reduced-precision fp32 matmuls,
        # which would make expert selection depend on the backend); bf16 x on the tensor cores
        if logits is None:
            logits = router_logits(x, self.weight[...].astype(jnp.float32))
        scores = jax.nn.sigmoid(logits)
        # the bias only ranks experts (and gets no gradient: it is QB state)
        biased = scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
        if self.max_nodes:
            limited = limit_nodes(biased, self.nodes, self.max_nodes, self.top_k)
            _, topk_idx = jax.lax.top_k(limited, self.top_k)
            # QB's cutoff is over every expert, as without the limit
            vals = jax.lax.top_k(biased, self.top_k + 1)[0] if with_cutoff else None
        else:
            vals, topk_idx = jax.lax.top_k(biased, self.top_k + int(with_cutoff))
        topk_idx = topk_idx[:, :self.top_k].astype(jnp.int32)
        picked = jnp.take_along_axis(scores, topk_idx, axis=-1)
        topk_weight = picked / (jnp.sum(picked, axis=-1, keepdims=True) + 1e-20) * self.scaling
        if with_cutoff:
            return topk_idx, topk_weight, scores, jax.lax.stop_gradient(vals[:, self.top_k])
        return topk_idx, topk_weight, scores


def limit_nodes(biased, nodes: int, max_nodes: int, top_k: int):
    """Node-limited routing (DeepSeek-V3's M): biased [N,E] selection scores -> the same with
    every expert outside the token's `max_nodes` best of `nodes` contiguous groups at -inf. A
    group's score is the sum of its ceil(top_k / max_nodes) highest selection scores (DeepSeek-V3
    sums 2 for its k=8, M=4: the same rule); ties go to the lower group."""
    N, E = biased.shape
    per = E // nodes
    grouped = biased.reshape(N, nodes, per)
    best = jax.lax.top_k(grouped, min(per, -(-top_k // max_nodes)))[0].sum(-1)  # [N, nodes]
    _, keep = jax.lax.top_k(best, max_nodes)
    allowed = jnp.zeros((N, nodes), bool).at[jnp.arange(N)[:, None], keep].set(True)
    return jnp.where(jnp.repeat(allowed, per, axis=1), biased, -jnp.inf)
