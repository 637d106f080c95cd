"""The rest of the lineage (gated DeltaNet, DeltaNet, linear attention, softmax attention)
against float64 loops, with and without packed segments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import (causal_softmax_attention, chunk_deltanet, chunk_gated_deltanet, chunk_linear_attn,
                       naive_causal_softmax_attention, recurrent_deltanet, recurrent_gated_deltanet,
                       recurrent_linear_attn)
from reference import delta_rule_loop, rel_err, softmax_attention_loop

B, T, H, K, V = 2, 45, 2, 8, 12
f32 = lambda x: jnp.asarray(x, jnp.float32)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, V))
    g = -3.0 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    s0 = rng.standard_normal((B, H, K, V))
    seg = np.sort(rng.integers(0, 3, (B, T)), axis=1)
    return q, k, v, g, beta, s0, seg


@pytest.mark.parametrize("packed", [False, True])
def test_gated_deltanet(data, packed):
    q, k, v, g, beta, s0, seg = data
    seg = seg if packed else None
    ref_o, ref_S = delta_rule_loop(q, k, v, g, beta, initial_state=s0, segment_ids=seg, decay="scalar")
    for fn in (chunk_gated_deltanet, recurrent_gated_deltanet):
        o, S = jax.jit(fn, static_argnames="chunk_size")(
            *map(f32, (q, k, v, g, beta)), initial_state=f32(s0),
            segment_ids=None if seg is None else jnp.asarray(seg), chunk_size=16)
        assert rel_err(o, ref_o) < 2e-6 and rel_err(S, ref_S) < 2e-6, fn.__name__


def test_gated_deltanet_equals_kda_with_broadcast_gate(data):
    """One scalar decay per head is KDA with that decay repeated over K (the shared code path)."""
    from k3jax.ops import chunk_kda
    q, k, v, g, beta, s0, _ = data
    o1, S1 = chunk_gated_deltanet(*map(f32, (q, k, v, g, beta)), initial_state=f32(s0), chunk_size=32)
    g_k = np.repeat(g[..., None], K, axis=-1)
    o2, S2 = chunk_kda(*map(f32, (q, k, v, g_k, beta)), initial_state=f32(s0), chunk_size=32)
    np.testing.assert_allclose(o1, o2, atol=2e-6)
    np.testing.assert_allclose(S1, S2, atol=2e-6)


def test_deltanet(data):
    q, k, v, _, beta, s0, seg = data
    ref_o, ref_S = delta_rule_loop(q, k, v, None, beta, initial_state=s0, segment_ids=seg, decay=None)
    for fn in (chunk_deltanet, recurrent_deltanet):
        o, S = fn(*map(f32, (q, k, v, beta)), initial_state=f32(s0), segment_ids=jnp.asarray(seg), chunk_size=16)
        assert rel_err(o, ref_o) < 2e-6 and rel_err(S, ref_S) < 2e-6, fn.__name__


def _elu1(x):
    return np.where(x > 0, x + 1.0, np.exp(x))


@pytest.mark.parametrize("normalize", [False, True])
def test_linear_attention(data, normalize):
    q, k, v, _, _, s0, seg = data
    fq, fk = _elu1(q), _elu1(k)
    if normalize:
        v_ext = np.concatenate([v, np.ones(v.shape[:-1] + (1,))], -1)
        s0_ext = np.concatenate([s0, np.abs(s0[..., :1])], -1)  # a positive key-sum column
        o_ext, ref_S = delta_rule_loop(fq, fk, v_ext, initial_state=s0_ext, segment_ids=seg, decay=None,
                                       delta=False)
        ref_o = o_ext[..., :-1] / (o_ext[..., -1:] + 1e-6)
        init = s0_ext
    else:
        ref_o, ref_S = delta_rule_loop(fq, fk, v, initial_state=s0, segment_ids=seg, decay=None, delta=False)
        init = s0
    for fn in (chunk_linear_attn, recurrent_linear_attn):
        o, S = fn(*map(f32, (q, k, v)), initial_state=f32(init), segment_ids=jnp.asarray(seg), chunk_size=16,
                  normalize=normalize)
        assert rel_err(o, ref_o) < 5e-6 and rel_err(S, ref_S) < 2e-6, (fn.__name__, rel_err(o, ref_o))


def test_linear_attention_has_no_delta_rule(data):
    """Sanity of the reference itself: additive state = sum of phi(k) v^T."""
    q, k, v, _, _, _, _ = data
    _, S = chunk_linear_attn(*map(f32, (q, k, v)), chunk_size=16)
    expect = np.einsum("bthk,bthv->bhkv", _elu1(k), v)
    np.testing.assert_allclose(S, expect, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_softmax_attention(data, kv_heads):
    q, _, _, _, _, _, seg = data
    rng = np.random.default_rng(1)
    k = rng.standard_normal((B, T, kv_heads, K))
    v = rng.standard_normal((B, T, kv_heads, K))
    ref = softmax_attention_loop(q, k, v, segment_ids=seg)
    fast = causal_softmax_attention(*map(f32, (q, k, v)), segment_ids=jnp.asarray(seg))
    naive = naive_causal_softmax_attention(*map(f32, (q, k, v)), segment_ids=jnp.asarray(seg))
    assert rel_err(fast, ref) < 1e-5 and rel_err(naive, ref) < 1e-5
    ref_plain = softmax_attention_loop(q, k, v)
    assert rel_err(causal_softmax_attention(*map(f32, (q, k, v))), ref_plain) < 1e-5
    # value head dim different from the key head dim (MLA: 192 vs 128), both ways
    for dv in (5, 11):
        v2 = rng.standard_normal((B, T, kv_heads, dv))
        ref2 = softmax_attention_loop(q, k, v2, segment_ids=seg)
        out2 = causal_softmax_attention(*map(f32, (q, k, v2)), segment_ids=jnp.asarray(seg))
        assert out2.shape[-1] == dv and rel_err(out2, ref2) < 1e-5
