"""Kimi Delta Attention: the delta rule with a per-channel (fine-grained) decay.

    chunk_kda(q, k, v, g, beta)      training / prefill (chunkwise WY form)
    recurrent_kda(q, k, v, g, beta)  decode and reference (token scan)

q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K] log-decay (<= 0); beta [B,T,H];
initial_state / final state [B,H,K,V] fp32; o in v's dtype. q and k are used as
given (the layer l2-normalises them); `scale` (default K**-0.5) multiplies q.
segment_ids [B,T]: the state is reset to zero before every token whose id differs
from the previous token's (packed documents); initial_state applies at t = 0.
"""

from __future__ import annotations

from k3jax.ops.delta_rule import chunk_delta_rule, recurrent_delta_rule


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64,
              state_pass="auto", decay_bound=None, impl="auto", tuning=None):
    """Chunkwise-parallel KDA. Returns (o [B,T,H,V], final_state [B,H,K,V] fp32).

    decay_bound: a lower bound on g the caller guarantees (K3's gate: -5). It lets the
    intra-chunk scores factor without a runtime branch, and it is what the fused GPU kernels
    need. impl: "auto" (fused kernels on GPU when the inputs allow, else XLA), "pallas" or
    "xla"; state_pass: how XLA's form crosses chunks ("scan", "associative" or "auto");
    tuning: kernel launch parameters. See `k3jax.ops.delta_rule.chunk_delta_rule`."""
    return chunk_delta_rule(q, k, v, g, beta, decay="channel", delta=True, scale=scale,
                            initial_state=initial_state, segment_ids=segment_ids,
                            chunk_size=chunk_size, state_pass=state_pass, decay_bound=decay_bound,
                            impl=impl, tuning=tuning, name="chunk_kda")


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64,
                  state_pass="auto", decay_bound=None, impl="auto", tuning=None):
    """Token-recurrent KDA (decode path and reference). `chunk_size`, `state_pass`, `impl` and
    `tuning` are accepted and unused, so the two forms are interchangeable; g is clamped at
    decay_bound."""
    del chunk_size, state_pass, impl, tuning
    return recurrent_delta_rule(q, k, v, g, beta, decay="channel", delta=True, scale=scale,
                                initial_state=initial_state, segment_ids=segment_ids, decay_bound=decay_bound,
                                name="recurrent_kda")
