"""Linear attention (Katharopoulos et al.): ELU+1 features, additive state, no delta rule.

q, k [B,T,H,K]; v [B,T,H,V]. The feature map phi(x) = elu(x) + 1 is applied here to
q and k, then S <- S + phi(k) v^T and o = S^T (scale phi(q)), with the same segment
and initial-state semantics as KDA. It runs on the shared delta-rule code path with
the delta rule and the decay switched off.

normalize=True divides by phi(q).z with z = sum phi(k) (fla's `normalize`): z rides
along as one extra value column, so initial/final states are then [B,H,K,V+1].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.delta_rule import chunk_delta_rule, recurrent_delta_rule

NORMALIZE_EPS = 1e-6


def elu_feature_map(x):
    return jax.nn.elu(x.astype(jnp.promote_types(x.dtype, jnp.float32))) + 1.0


def _run(core, q, k, v, *, scale, initial_state, segment_ids, normalize, feature_map, **kw):
    if feature_map:
        q, k = elu_feature_map(q), elu_feature_map(k)
    if normalize:
        v32 = v.astype(jnp.promote_types(v.dtype, jnp.float32))
        v_ext = jnp.concatenate([v32, jnp.ones(v.shape[:-1] + (1,), v32.dtype)], -1)
        o, S = core(q, k, v_ext, None, None, decay=None, delta=False, scale=scale,
                    initial_state=initial_state, segment_ids=segment_ids, **kw)
        o = o[..., :-1] / (o[..., -1:] + NORMALIZE_EPS)
        return o.astype(v.dtype), S
    return core(q, k, v, None, None, decay=None, delta=False, scale=scale, initial_state=initial_state,
                segment_ids=segment_ids, **kw)


def chunk_linear_attn(q, k, v, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64,
                      normalize=False, feature_map=True):
    """Chunkwise linear attention. Returns (o [B,T,H,V], final_state fp32)."""
    return _run(chunk_delta_rule, q, k, v, scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                normalize=normalize, feature_map=feature_map, chunk_size=chunk_size, name="chunk_linear_attn")


def recurrent_linear_attn(q, k, v, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64,
                          normalize=False, feature_map=True):
    """Token-recurrent linear attention (decode and reference)."""
    del chunk_size
    return _run(recurrent_delta_rule, q, k, v, scale=scale, initial_state=initial_state,
                segment_ids=segment_ids, normalize=normalize, feature_map=feature_map,
                name="recurrent_linear_attn")
