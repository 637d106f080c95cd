"""GatedMLA: the training path against a float64 numpy forward of the expanded form (per-head
keys and values), and the absorbed cached path against the training path (prefill +
token-by-token decode, packed rows, RoPE ablation)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import MLAConfig, ModelConfig
from k3jax.layers.cache import DecodeContext
from k3jax.layers.mla import GatedMLA, mla_cache_bytes_per_token
from reference import doc_positions, rel_err, rope_np

B, T, D_MODEL = 2, 10, 32
MLA = MLAConfig(num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
# row 0: three documents, boundaries at 3 (inside the prefill) and 7 (inside the decode part)
SEG = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 9, 9, 9, 9]], np.int32)


def cfg(dtype="float32", **mla):
    # a wide init so attention is far from uniform (a weak test otherwise)
    return ModelConfig(d_model=D_MODEL, init_std=0.35, param_dtype=dtype, compute_dtype=dtype,
                       mla=dataclasses.replace(MLA, **mla))


def make(model_cfg, seed=0):
    m = GatedMLA(model_cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 100)
    # non-unit norm weights, so a norm that ignored its weight would fail
    for name in ("q_a_layernorm", "kv_a_layernorm"):
        if hasattr(m, name):
            w = getattr(m, name).weight
            w[...] = jnp.asarray(rng.uniform(0.5, 1.5, w[...].shape), w[...].dtype)
    return m


def inputs(seed=1, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, D_MODEL)), dtype)


# ---------------------------------------------------------------- float64 reference (expanded form)

def _np(p):
    return np.asarray(jnp.asarray(p[...], jnp.float32), np.float64)


def mla_reference(m, model_cfg, x, seg, pos):
    c = model_cfg.mla
    H, n, r, v, R = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    eps = model_cfg.rms_norm_eps
    x = np.asarray(x, np.float64)
    Bx, Tx, d = x.shape

    def rms(a, w):
        return a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + eps) * w

    if c.q_lora_rank:
        cq = rms(x @ _np(m.q_a_proj.kernel), _np(m.q_a_layernorm.weight))
        q = cq @ _np(m.q_b_proj.kernel).reshape(c.q_lora_rank, H * (n + r))
    else:
        q = x @ _np(m.q_proj.kernel).reshape(d, H * (n + r))
    q = q.reshape(Bx, Tx, H, n + r)
    ckv = x @ _np(m.kv_a_proj_with_mqa.kernel)
    kv_eps = c.kv_norm_eps or eps  # Kimi Linear's kv_a_layernorm keeps eps 1e-6
    lat = ckv[..., :R] / np.sqrt(np.mean(ckv[..., :R] ** 2, axis=-1, keepdims=True) + kv_eps) \
        * _np(m.kv_a_layernorm.weight)
    kp = ckv[..., R:]
    kv = (lat @ _np(m.kv_b_proj.kernel).reshape(R, H * (n + v))).reshape(Bx, Tx, H, n + v)
    kn, vv = kv[..., :n], kv[..., n:]
    qn, qp = q[..., :n], q[..., n:]
    if c.use_rope:
        qp, kp = rope_np(qp, pos, c.rope_theta), rope_np(kp, pos, c.rope_theta)
    o = np.zeros((Bx, Tx, H, v))
    for b in range(Bx):
        for t in range(Tx):
            ok = [s for s in range(t + 1) if seg[b, s] == seg[b, t]]
            for h in range(H):
                Q = np.concatenate([qn[b, t, h], qp[b, t, h]])
                s = np.array([Q @ np.concatenate([kn[b, j, h], kp[b, j]]) for j in ok]) / np.sqrt(n + r)
                p = np.exp(s - s.max())
                o[b, t, h] = (p / p.sum()) @ vv[b, ok, h]
    if c.output_gate:
        g = (x @ _np(m.g_proj.kernel).reshape(d, H * v)).reshape(Bx, Tx, H, v)
        o = o / (1 + np.exp(-g))
    return o.reshape(Bx, Tx, H * v) @ _np(m.o_proj.kernel).reshape(H * v, d), lat, kp


# ---------------------------------------------------------------- cached driver

def run_cached(m, x, seg, pos, chunks, max_len, cache_dtype=jnp.float32):
    """Feed [B,T] in chunks through the cache path, building each DecodeContext as the model would."""
    graphdef, state = nnx.split(m)

    @jax.jit
    def step(state, x, seg, pos, cache, ctx):
        return nnx.merge(graphdef, state)(x, segment_ids=seg, positions=pos, cache=cache, ctx=ctx)

    cache = m.init_cache(x.shape[0], max_len, cache_dtype)
    kv_seg = np.full((x.shape[0], max_len), -1, np.int32)
    ys, i = [], 0
    for n in chunks:
        kv_seg[:, i:i + n] = seg[:, i:i + n]
        prev = seg[:, i - 1] if i else np.full(x.shape[0], -1, np.int32)
        ctx = DecodeContext(jnp.int32(i), jnp.asarray(kv_seg), jnp.asarray(prev))
        y, cache = step(state, x[:, i:i + n], jnp.asarray(seg[:, i:i + n]), jnp.asarray(pos[:, i:i + n]), cache, ctx)
        ys.append(y)
        i += n
    return jnp.concatenate(ys, axis=1), cache


def train_call(m, x, seg, pos):
    y, cache = m(x, segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos))
    assert cache is None
    return y


# ---------------------------------------------------------------- tests

def test_param_names_shapes_axes():
    m = GatedMLA(cfg(), rngs=nnx.Rngs(0))
    got = {"/".join(map(str, k)): (v.get_value().shape, v.axes) for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
    assert got == {
        "q_a_proj/kernel": ((32, 16), ("embed", "lora")),
        "q_a_layernorm/weight": ((16,), ("lora",)),
        "q_b_proj/kernel": ((16, 2, 12), ("lora", "heads", "head_dim")),
        "kv_a_proj_with_mqa/kernel": ((32, 20), ("embed", "lora")),
        "kv_a_layernorm/weight": ((16,), ("lora",)),
        "kv_b_proj/kernel": ((16, 2, 16), ("lora", "heads", "head_dim")),
        "g_proj/kernel": ((32, 2, 8), ("embed", "heads", "head_dim")),
        "o_proj/kernel": ((2, 8, 32), ("heads", "head_dim", "embed")),
    }
    assert np.all(np.asarray(m.kv_a_layernorm.weight[...]) == 1.0)
    plain = GatedMLA(cfg(q_lora_rank=0, output_gate=False), rngs=nnx.Rngs(0))
    names = {k[0] for k, _ in nnx.to_flat_state(nnx.state(plain, nnx.Param))}
    assert names == {"q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"}
    assert plain.q_proj.kernel[...].shape == (32, 2, 12)


@pytest.mark.parametrize("variant", [{}, {"use_rope": True}, {"q_lora_rank": 0}, {"output_gate": False},
                                     # Kimi Linear's MLA; an eps far from rms_norm_eps, so ignoring it fails
                                     {"q_lora_rank": 0, "output_gate": False, "kv_norm_eps": 0.5}])
def test_training_path_matches_float64_reference(variant):
    c = cfg(**variant)
    m, x, pos = make(c), inputs(), doc_positions(SEG)
    ref, _, _ = mla_reference(m, c, x, SEG, pos)
    err = rel_err(train_call(m, x, SEG, pos), ref)
    print(f"mla train vs f64 {variant}: rel err {err:.2e}")
    assert err < 1e-5


def test_nope_ignores_positions_rope_is_relative():
    x, pos = inputs(), doc_positions(SEG)
    shuffled = np.random.default_rng(3).integers(0, 50, SEG.shape).astype(np.int32)
    m = make(cfg())
    np.testing.assert_array_equal(train_call(m, x, SEG, pos), train_call(m, x, SEG, shuffled))
    m = make(cfg(use_rope=True))
    y = train_call(m, x, SEG, pos)
    assert rel_err(train_call(m, x, SEG, pos + 17), y) < 1e-5  # a shared offset cancels in q·k
    assert rel_err(train_call(m, x, SEG, shuffled), y) > 1e-2


def test_output_gate_zero_kernel_halves_ungated():
    gated, ungated = make(cfg()), make(cfg(output_gate=False))
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        getattr(ungated, name).kernel[...] = getattr(gated, name).kernel[...]
    for name in ("q_a_layernorm", "kv_a_layernorm"):
        getattr(ungated, name).weight[...] = getattr(gated, name).weight[...]
    gated.g_proj.kernel[...] = jnp.zeros_like(gated.g_proj.kernel[...])
    x, pos = inputs(), doc_positions(SEG)
    y0, y1 = train_call(gated, x, SEG, pos), train_call(ungated, x, SEG, pos)
    assert float(jnp.abs(y1).max()) > 1e-2
    np.testing.assert_allclose(y0, 0.5 * y1, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("variant,seg,chunks", [
    ({}, np.zeros((B, T), np.int32), [4] + [1] * 6),
    ({}, SEG, [4] + [1] * 6),
    ({"use_rope": True}, SEG, [4] + [1] * 6),
    ({"q_lora_rank": 0}, SEG, [1] * 10),
    ({"use_rope": True}, SEG, [3, 4, 1, 2]),  # chunked prefill: T > 1 at index > 0
])
def test_absorbed_cache_path_matches_training_path(variant, seg, chunks):
    c = cfg(**variant)
    m, x, pos = make(c), inputs(), doc_positions(seg)
    y_train = train_call(m, x, seg, pos)
    y_cache, _ = run_cached(m, x, seg, pos, chunks, max_len=T + 3)  # spare empty slots must stay unseen
    err = rel_err(y_cache, y_train)
    print(f"mla cached vs train {variant} chunks={chunks}: rel err {err:.2e}")
    assert err < 1e-5
    ref, _, _ = mla_reference(m, c, x, seg, pos)
    assert rel_err(y_cache, ref) < 1e-5


def test_cache_holds_only_latent_and_shared_key():
    c = cfg(use_rope=True)
    m, x, pos = make(c), inputs(), doc_positions(SEG)
    S = T + 3
    assert mla_cache_bytes_per_token(c) == (16 + 4) * 2 and mla_cache_bytes_per_token(c, 4) == 80
    empty = m.init_cache(B, S, jnp.bfloat16)
    assert {k: (a.shape, a.dtype) for k, a in empty.items()} == {
        "latent": ((B, S, 16), jnp.bfloat16), "k_rope": ((B, S, 4), jnp.bfloat16)}
    _, cache = run_cached(m, x, SEG, pos, [6, 1, 1, 1, 1], S)
    assert sorted(cache) == ["k_rope", "latent"]
    assert cache["latent"].shape == (B, S, 16) and cache["k_rope"].shape == (B, S, 4)
    _, lat, kp = mla_reference(m, c, x, SEG, pos)  # the normalised latent and the rotated shared key
    assert rel_err(cache["latent"][:, :T], lat) < 1e-5 and rel_err(cache["k_rope"][:, :T], kp) < 1e-5
    assert not np.any(np.asarray(cache["latent"][:, T:])) and not np.any(np.asarray(cache["k_rope"][:, T:]))


def test_bfloat16_cache_path_close_to_training_path():
    m, x, pos = make(cfg("bfloat16")), inputs(dtype=jnp.bfloat16), doc_positions(SEG)
    y_train = nnx.jit(train_call)(m, x, SEG, pos)  # eager bf16 on CPU is slow
    y_cache, _ = run_cached(m, x, SEG, pos, [4] + [1] * 6, T, cache_dtype=jnp.bfloat16)
    assert y_cache.dtype == jnp.bfloat16
    err = rel_err(y_cache, y_train)
    print(f"mla bf16 cached vs train: rel err {err:.2e}")
    assert err < 3e-2


@pytest.mark.parametrize("variant", [{}, {"use_rope": True}, {"q_lora_rank": 0}])
def test_max_logits_are_the_masked_scaled_logits_max(variant):
    """QK-Clip's statistic: each head's largest scaled pre-softmax logit over the batch and
    the (causal, same-document) pairs it attends, against float64 numpy; the output is unchanged."""
    from reference import mla_logits_np
    c = cfg(**variant)
    m, x, pos = make(c), inputs(), doc_positions(SEG)
    y, cache, got = m(x, segment_ids=jnp.asarray(SEG), positions=jnp.asarray(pos), max_logits=True)
    assert cache is None and got.shape == (2,) and got.dtype == jnp.float32
    np.testing.assert_array_equal(y, train_call(m, x, SEG, pos))
    params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
    want = mla_logits_np(params, c.mla, x, SEG, pos, c.rms_norm_eps).max(axis=(0, 2, 3))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # the document mask matters here: without it (causal only) the max is another one
    causal_only = mla_logits_np(params, c.mla, x, np.zeros_like(SEG), pos, c.rms_norm_eps).max(axis=(0, 2, 3))
    assert np.all(causal_only >= want) and not np.allclose(causal_only, want)
    empty = m.init_cache(B, T, jnp.float32)
    ctx = DecodeContext(jnp.int32(0), jnp.asarray(SEG), jnp.full((B,), -1, jnp.int32))
    with pytest.raises(ValueError, match="training path only"):
        m(x, segment_ids=jnp.asarray(SEG), positions=jnp.asarray(pos), cache=empty, ctx=ctx, max_logits=True)
