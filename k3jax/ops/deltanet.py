"""DeltaNet and gated DeltaNet: the KDA code path with a coarser (or no) decay.

gated DeltaNet: g [B,T,H], one log-decay per head (broadcast over K).
DeltaNet: no decay. Shapes and segment/initial-state semantics as in `k3jax.ops.kda`.
"""

from __future__ import annotations

from k3jax.ops.delta_rule import chunk_delta_rule, recurrent_delta_rule


def chunk_gated_deltanet(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                           chunk_size=64):
    return chunk_delta_rule(q, k, v, g, beta, decay="scalar", delta=True, scale=scale,
                            initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size,
                            name="chunk_gated_deltanet")


def recurrent_gated_deltanet(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                               chunk_size=64):
    del chunk_size
    return recurrent_delta_rule(q, k, v, g, beta, decay="scalar", delta=True, scale=scale,
                                initial_state=initial_state, segment_ids=segment_ids,
                                name="recurrent_gated_deltanet")


def chunk_deltanet(q, k, v, beta, *, scale=None, initial_state=None, segment_ids=None,
                             chunk_size=64):
    """DeltaNet (no decay), chunkwise."""
    return chunk_delta_rule(q, k, v, None, beta, decay=None, delta=True, scale=scale,
                            initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size,
                            name="chunk_deltanet")


def recurrent_deltanet(q, k, v, beta, *, scale=None, initial_state=None, segment_ids=None,
                                 chunk_size=64):
    """DeltaNet (no decay), token-recurrent."""
    del chunk_size
    return recurrent_delta_rule(q, k, v, None, beta, decay=None, delta=True, scale=scale,
                                initial_state=initial_state, segment_ids=segment_ids, name="recurrent_deltanet")
