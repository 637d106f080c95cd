"""The routed experts at small batch, reading only the routed experts' weights.

A decode step routes a handful of tokens (batch x top_k pairs: 8 of 64 experts at batch 1 for
k3-small). The grouped matmul of `routed_experts_dropless` lays its work out per expert and
streams every expert's weights; here each (token, expert) pair gathers its expert's w1, w3, w2
and runs its GLU MLP on its own. The products are written as elementwise multiplies summed in
fp32, not as batched matrix-vector dots, so XLA can fuse each gather into the reduction that
consumes it and read each routed weight once. Numerics as the grouped path: operands in the
compute dtype, fp32 accumulation, w1 / w3 outputs rounded to the compute dtype, w2 output fp32.

It pays while the pairs are few against the experts: `use_gathered` picks it when
tokens x top_k <= num_experts / 2 (a pair re-reads an expert another pair also routed to, so
past that point the grouped matmul's one read per expert wins).
"""

from __future__ import annotations

import jax.numpy as jnp

from k3jax.layers.activations import apply_glu

F32 = jnp.float32


def use_gathered(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether `routed_experts_gathered` reads fewer weight bytes than a grouped matmul."""
    return 2 * num_tokens * top_k <= num_experts


def routed_experts_gathered(z, topk_idx, topk_weight, w1, w3, w2, glu, compute_dtype=F32):
    """z [N,l], topk_idx [N,k] int, topk_weight [N,k] fp32, w1/w3 [E,l,H], w2 [E,H,l] -> u [N,l] fp32,
    the routing-weighted sum of each token's experts (as `routed_experts_dropless`)."""
    cd = compute_dtype
    N, k = topk_idx.shape
    experts = topk_idx.reshape(-1)  # pair p = (token p // k, slot p % k)
    zp = jnp.repeat(z.astype(cd), k, axis=0).astype(F32)  # [P, l]

    def project(x, w):  # x [P, a] fp32, w [E, a, b] -> [P, b] fp32: sum_a x * w[expert]
        return jnp.sum(x[:, :, None] * w.astype(cd)[experts].astype(F32), axis=1)

    h = apply_glu(glu, project(zp, w1).astype(cd), project(zp, w3).astype(cd))
    out = project(h.astype(F32), w2)  # [P, l]
    return jnp.einsum("nk,nkl->nl", topk_weight.astype(F32), out.reshape(N, k, -1))
