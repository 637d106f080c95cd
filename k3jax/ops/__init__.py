"""Pure sequence-mixing operators (no Flax). Each fast form has its reference beside it."""

from k3jax.ops.deltanet import (chunk_deltanet, chunk_gated_deltanet, recurrent_deltanet,
                                recurrent_gated_deltanet)
from k3jax.ops.kda import chunk_kda, recurrent_kda
from k3jax.ops.linear_attn import chunk_linear_attn, recurrent_linear_attn
from k3jax.ops.softmax_attn import causal_softmax_attention, naive_causal_softmax_attention

__all__ = [
    "causal_softmax_attention", "chunk_deltanet", "chunk_gated_deltanet", "chunk_kda", "chunk_linear_attn",
    "naive_causal_softmax_attention", "recurrent_deltanet", "recurrent_gated_deltanet", "recurrent_kda",
    "recurrent_linear_attn",
]
