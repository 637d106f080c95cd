"""DeltaNet and gated DeltaNet: the KDA code path with a coarser (or no) decay.

gated DeltaNet: g [B,T,H], one log-decay per head (broadcast over K).
DeltaNet: no decay. Shapes and segment/initial-state semantics as in `k3jax.ops.kda`.
"""

from __future__ import annotations

from k3jax.ops.delta_rule import chunk_delta_rule, recurrent_delta_rule


def chunk_gated_deltanet(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                         chunk_size=64, decay_bound=None, impl="auto", tuning=None):
    """Gated DeltaNet, chunkwise. With a static decay_bound (the lower_bound gate) the fused
    GPU kernels run it as KDA with the per-head gate broadcast over K."""
    return chunk_delta_rule(q, k, v, g, beta, decay="scalar", delta=True, scale=scale,
                            initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size,
                            decay_bound=decay_bound, impl=impl, tuning=tuning, name="chunk_gated_deltanet")


def recurrent_gated_deltanet(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
                             chunk_size=64, decay_bound=None, impl="auto", tuning=None):
    del chunk_size, impl, tuning
    return recurrent_delta_rule(q, k, v, g, beta, decay="scalar", delta=True, scale=scale,
                                initial_state=initial_state, segment_ids=segment_ids, decay_bound=decay_bound,
                                name="recurrent_gated_deltanet")


def chunk_deltanet(q, k, v, beta, *, scale=None, initial_state=None, segment_ids=None,
                   chunk_size=64, impl="auto", tuning=None):
    """DeltaNet (no decay), chunkwise; the fused GPU kernels run it with a zero gate."""
    return chunk_delta_rule(q, k, v, None, beta, decay=None, delta=True, scale=scale,
                            initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size,
                            impl=impl, tuning=tuning, name="chunk_deltanet")


def recurrent_deltanet(q, k, v, beta, *, scale=None, initial_state=None, segment_ids=None,
                       chunk_size=64, impl="auto", tuning=None):
    """DeltaNet (no decay), token-recurrent."""
    del chunk_size, impl, tuning
    return recurrent_delta_rule(q, k, v, None, beta, decay=None, delta=True, scale=scale,
                                initial_state=initial_state, segment_ids=segment_ids, name="recurrent_deltanet")
