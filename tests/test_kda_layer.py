"""The KDA layer (and its lineage kinds) against a numpy float64 re-implementation of its
per-token definition (short conv, q/k/beta/gate preprocessing, recurrence, gated output norm),
using the module's own parameter arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import KDAConfig, ModelConfig
from k3jax.layers.cache import DecodeContext
from k3jax.layers.kda import DeltaMixer
from k3jax.layers.norms import RMSNorm, l2_normalize, rms_normalize
from reference import delta_rule_loop, rel_err

B, T, D = 2, 19, 24
H, K = 2, 8


def cfg_for(**kda):
    return ModelConfig(d_model=D, compute_dtype="float32", kda=KDAConfig(num_heads=H, head_dim=K, chunk_size=16, **kda))


def p(var):
    return np.asarray(var[...], np.float64)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def ref_conv(x, w, seg):
    """Depthwise causal conv + SiLU; inputs of an earlier segment count as 0."""
    W = w.shape[0]
    y = np.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for i in range(W):
                s = t - (W - 1) + i
                if s >= 0 and seg[b, s] == seg[b, t]:
                    y[b, t] += w[i] * x[b, s]
    return y * sigmoid(y)


def ref_layer(m: DeltaMixer, x, seg, kind):
    x = np.asarray(x, np.float64)
    feats = []
    for name in "qkv":
        h = x @ p(getattr(m, f"{name}_proj").kernel)
        h = ref_conv(h, p(getattr(m, f"{name}_conv1d").weight), seg)
        feats.append(h.reshape(B, T, H, K))
    q, k, v = feats
    if kind != "linear":
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    g = None
    if kind == "kda":
        z = (x @ p(m.f_a_proj.kernel) @ p(m.f_b_proj.kernel)).reshape(B, T, H, K) + p(m.dt_bias).reshape(H, K)
        A = np.exp(p(m.A_log))[:, None]
    elif kind == "gated_deltanet":
        z = x @ p(m.a_proj.kernel) + p(m.dt_bias)
        A = np.exp(p(m.A_log))
    if kind in ("kda", "gated_deltanet"):
        g = -5.0 * sigmoid(A * z) if m.gate_form == "lower_bound" else -A * np.log1p(np.exp(z))
    beta = sigmoid(x @ p(m.b_proj.kernel)) if kind != "linear" else None
    if kind == "linear":
        q, k = np.where(q > 0, q + 1, np.exp(q)), np.where(k > 0, k + 1, np.exp(k))
    decay = {"kda": "channel", "gated_deltanet": "scalar"}.get(kind)
    o, _ = delta_rule_loop(q, k, v, g, beta, segment_ids=seg, decay=decay, delta=kind != "linear")
    if hasattr(m, "g_proj"):
        G = x @ p(m.g_proj.kernel)
    else:
        G = x @ p(m.g_a_proj.kernel) @ p(m.g_b_proj.kernel)
        if hasattr(m, "g_bias"):  # fla's KDA layer: a bias on g_proj.1
            G = G + p(m.g_bias)
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + 1e-5) * p(m.o_norm) * sigmoid(G.reshape(B, T, H, K))
    return o.reshape(B, T, H * K) @ p(m.o_proj.kernel)


@pytest.mark.parametrize("kind,kw", [
    ("kda", dict()),                                                # K3: bounded gate, full-rank output gate
    ("kda", dict(gate="softplus", output_gate="low_rank")),         # Kimi Linear
    ("kda", {"gate": "softplus", "output_gate": "low_rank", "output_gate_bias": True}),  # fla KDAForCausalLM
    ("gated_deltanet", dict()),
    ("deltanet", dict()),
    ("linear", dict()),
])
def test_layer_matches_numpy(kind, kw):
    m = DeltaMixer(cfg_for(**kw), kind, rngs=nnx.Rngs(0))
    if hasattr(m, "g_bias"):  # zero at init: give it values a missing bias would not match
        m.g_bias[...] = jax.random.normal(jax.random.PRNGKey(3), m.g_bias[...].shape)
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, D))
    seg = np.array([[0] * 7 + [1] * 12, [0] * T])
    y, _ = m(x, segment_ids=jnp.asarray(seg))
    assert rel_err(y, ref_layer(m, x, seg, kind)) < 2e-5


def test_cached_prefill_and_decode_equal_one_pass():
    m = DeltaMixer(cfg_for(), "kda", rngs=nnx.Rngs(2))
    x = jax.random.normal(jax.random.PRNGKey(3), (B, T, D))
    seg = jnp.array([[0] * 7 + [1] * 12, [0] * 15 + [1] * 4])  # row 1 starts a document in the decode part
    full, _ = m(x, segment_ids=seg)
    cache = m.init_cache(B, T, jnp.float32)
    T1 = 10
    ctx = DecodeContext(jnp.int32(0), jnp.zeros((B, T), jnp.int32), jnp.full((B,), -1))
    y1, cache = m(x[:, :T1], segment_ids=seg[:, :T1], cache=cache, ctx=ctx)
    outs = [y1]
    for t in range(T1, T):
        ctx = DecodeContext(jnp.int32(t), jnp.zeros((B, T), jnp.int32), seg[:, t - 1])
        y, cache = m(x[:, t:t + 1], segment_ids=seg[:, t:t + 1], cache=cache, ctx=ctx)
        outs.append(y)
    np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=2e-6)
    assert cache["state"].shape == (B, H, K, K) and cache["state"].dtype == jnp.float32
    assert cache["conv_q"].shape == (B, 3, H * K)


def test_norms_and_l2():
    x = np.random.default_rng(0).standard_normal((3, 5))
    np.testing.assert_allclose(l2_normalize(jnp.asarray(x)), x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6),
                               rtol=1e-6)
    np.testing.assert_allclose(rms_normalize(jnp.asarray(x), 1e-5), x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5),
                               rtol=1e-6)
    norm = RMSNorm(5, eps=1e-5, axis_name=None)
    norm.weight[...] = jnp.arange(1.0, 6.0)
    np.testing.assert_allclose(norm(jnp.asarray(x, jnp.float32)),
                               x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * np.arange(1, 6), rtol=1e-5)
    assert norm(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16
