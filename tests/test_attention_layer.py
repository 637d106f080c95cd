"""SoftmaxAttention (RoPE, GQA, the optional short convs on q/k/v) and apply_rope against float64
numpy written here, and the cached decode path against the full forward."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import AttentionConfig, ModelConfig
from k3jax.layers.attention import SoftmaxAttention
from k3jax.layers.cache import DecodeContext
from k3jax.layers.rope import apply_rope
from reference import doc_positions, rel_err, rope_np, softmax_attention_loop

B, T, D_MODEL, THETA = 2, 10, 32, 500.0
SEG = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [4, 4, 4, 4, 4, 4, 7, 7, 7, 7]], np.int32)


def cfg(num_heads=4, num_kv_heads=0, head_dim=0):
    return ModelConfig(d_model=D_MODEL, init_std=0.35, compute_dtype="float32",
                       attention=AttentionConfig(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                                 head_dim=head_dim, rope_theta=THETA))


VARIANTS = {"mha": dict(num_heads=4), "gqa": dict(num_heads=4, num_kv_heads=2, head_dim=6),
            "mqa": dict(num_heads=4, num_kv_heads=1)}


def inputs(seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, D_MODEL)), jnp.float32)


def attention_reference(m, x, seg, pos):
    w = {n: np.asarray(getattr(m, n).kernel[...], np.float64) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    x = np.asarray(x, np.float64)
    H, Hkv, D = w["q_proj"].shape[1], w["k_proj"].shape[1], w["q_proj"].shape[2]
    q = rope_np(np.einsum("btd,dhe->bthe", x, w["q_proj"]), pos, THETA)
    k = rope_np(np.einsum("btd,dhe->bthe", x, w["k_proj"]), pos, THETA)
    v = np.einsum("btd,dhe->bthe", x, w["v_proj"])
    o = np.zeros((B, T, H, D))
    for b in range(B):
        for t in range(T):
            ok = [s for s in range(t + 1) if seg[b, s] == seg[b, t]]
            for h in range(H):
                g = h * Hkv // H  # consecutive query heads share a kv head
                s = np.array([q[b, t, h] @ k[b, j, g] for j in ok]) / np.sqrt(D)
                p = np.exp(s - s.max())
                o[b, t, h] = (p / p.sum()) @ v[b, ok, g]
    return np.einsum("bthe,hed->btd", o, w["o_proj"])


def run_cached(m, x, seg, pos, chunks, max_len):
    graphdef, state = nnx.split(m)

    @jax.jit
    def step(state, x, seg, pos, cache, ctx):
        return nnx.merge(graphdef, state)(x, segment_ids=seg, positions=pos, cache=cache, ctx=ctx)

    cache = m.init_cache(B, max_len, jnp.float32)
    kv_seg = np.full((B, max_len), -1, np.int32)
    ys, i = [], 0
    for n in chunks:
        kv_seg[:, i:i + n] = seg[:, i:i + n]
        prev = seg[:, i - 1] if i else np.full(B, -1, np.int32)
        ctx = DecodeContext(jnp.int32(i), jnp.asarray(kv_seg), jnp.asarray(prev))
        y, cache = step(state, x[:, i:i + n], jnp.asarray(seg[:, i:i + n]), jnp.asarray(pos[:, i:i + n]), cache, ctx)
        ys.append(y)
        i += n
    return jnp.concatenate(ys, axis=1), cache


def test_apply_rope_matches_complex_rotation():
    rng = np.random.default_rng(0)
    pos = rng.integers(0, 1000, (B, T)).astype(np.int32)
    for shape in ((B, T, 3, 8), (B, T, 6)):
        x = rng.standard_normal(shape)
        got = apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), 10000.0)
        err = rel_err(got, rope_np(x, pos, 10000.0))
        print(f"rope {shape}: rel err {err:.2e}")
        assert got.shape == shape and err < 1e-5
    x = jnp.asarray(rng.standard_normal((B, T, 2, 4)), jnp.bfloat16)
    assert apply_rope(x, jnp.asarray(pos), 10.0).dtype == jnp.bfloat16
    np.testing.assert_array_equal(apply_rope(x, jnp.zeros((B, T), jnp.int32), 10.0), x)  # position 0: identity


def test_param_shapes_axes():
    m = SoftmaxAttention(cfg(**VARIANTS["gqa"]), rngs=nnx.Rngs(0))
    got = {"/".join(map(str, k)): (v.get_value().shape, v.axes) for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
    assert got == {"q_proj/kernel": ((32, 4, 6), ("embed", "heads", "head_dim")),
                   "k_proj/kernel": ((32, 2, 6), ("embed", "heads", "head_dim")),
                   "v_proj/kernel": ((32, 2, 6), ("embed", "heads", "head_dim")),
                   "o_proj/kernel": ((4, 6, 32), ("heads", "head_dim", "embed"))}
    assert SoftmaxAttention(cfg(), rngs=nnx.Rngs(0)).q_proj.kernel[...].shape == (32, 4, 8)  # head_dim 0 -> d/H


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_matches_float64_reference(name):
    m, x, pos = SoftmaxAttention(cfg(**VARIANTS[name]), rngs=nnx.Rngs(0)), inputs(), doc_positions(SEG)
    y, cache = m(x, segment_ids=jnp.asarray(SEG), positions=jnp.asarray(pos))
    assert cache is None
    err = rel_err(y, attention_reference(m, x, SEG, pos))
    print(f"softmax attn {name} vs f64: rel err {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("name,chunks", [("mha", [4] + [1] * 6), ("gqa", [4] + [1] * 6), ("mqa", [3, 4, 1, 2])])
def test_cached_decode_matches_full_forward(name, chunks):
    m, x, pos = SoftmaxAttention(cfg(**VARIANTS[name]), rngs=nnx.Rngs(0)), inputs(), doc_positions(SEG)
    y_full, _ = m(x, segment_ids=jnp.asarray(SEG), positions=jnp.asarray(pos))
    y_cache, cache = run_cached(m, x, SEG, pos, chunks, max_len=T + 3)
    Hkv, D = m.k_proj.kernel[...].shape[1:]
    assert cache["k"].shape == cache["v"].shape == (B, T + 3, Hkv, D)
    err = rel_err(y_cache, y_full)
    print(f"softmax attn {name} cached vs full: rel err {err:.2e}")
    assert err < 1e-5
    assert rel_err(y_cache, attention_reference(m, x, SEG, pos)) < 1e-5


# ---- model.attention.conv_size: the linear rungs' short conv on q, k, v before RoPE ----------


def conv_silu_np(x, w, seg):
    """Causal depthwise conv + SiLU by its definition: y[t, c] = SiLU(sum_i w[i, c] x[t-W+1+i, c]),
    taps before t's segment start counting as 0. x [B,T,P], w [W,P], seg [B,T]; float64."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    B_, T_, P = x.shape
    W = w.shape[0]
    y = np.zeros_like(x)
    for b in range(B_):
        for t in range(T_):
            for i in range(W):
                s = t - W + 1 + i
                if s >= 0 and seg[b, s] == seg[b, t]:
                    y[b, t] += w[i] * x[b, s]
    return y / (1.0 + np.exp(-y))


def conv_attention_reference(m, x, seg, pos):
    """The projections, each one's conv + SiLU (conv_silu_np), RoPE, then plain attention."""
    w = {n: np.asarray(getattr(m, n).kernel[...], np.float64) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    x = np.asarray(x, np.float64)
    H, Hkv, D = w["q_proj"].shape[1], w["k_proj"].shape[1], w["q_proj"].shape[2]
    proj = {}
    for n, heads in (("q", H), ("k", Hkv), ("v", Hkv)):
        h = np.einsum("btd,dhe->bthe", x, w[f"{n}_proj"]).reshape(B, T, heads * D)
        proj[n] = conv_silu_np(h, getattr(m, f"{n}_conv1d").weight[...], seg).reshape(B, T, heads, D)
    q, k = rope_np(proj["q"], pos, THETA), rope_np(proj["k"], pos, THETA)
    o = softmax_attention_loop(q, k, proj["v"], segment_ids=seg)
    return np.einsum("bthe,hed->btd", o, w["o_proj"])


def conv_cfg(name, conv_size=4):
    c = cfg(**VARIANTS[name])
    return dataclasses.replace(c, attention=dataclasses.replace(c.attention, conv_size=conv_size))


@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_short_conv_forward_matches_float64_reference(name):
    m, x, pos = SoftmaxAttention(conv_cfg(name), rngs=nnx.Rngs(0)), inputs(), doc_positions(SEG)
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    assert (m.q_conv1d.weight[...].shape, m.k_conv1d.weight[...].shape) == ((4, H * D), (4, Hkv * D))
    y, _ = m(x, segment_ids=jnp.asarray(SEG), positions=jnp.asarray(pos))
    err = rel_err(y, conv_attention_reference(m, x, SEG, pos))
    print(f"softmax attn + conv {name} vs f64: rel err {err:.2e}")
    assert err < 1e-5
    # the conv changes the output (the reference without it is far off), and the projections are
    # drawn as without the convs: switching them on adds parameters, it does not reseed the rest
    assert rel_err(y, attention_reference(m, x, SEG, pos)) > 0.1
    plain = SoftmaxAttention(cfg(**VARIANTS[name]), rngs=nnx.Rngs(0))
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        np.testing.assert_array_equal(getattr(plain, n).kernel[...], getattr(m, n).kernel[...])


def test_short_conv_cached_decode_matches_full_forward():
    """Prefill and decode carry each conv's last W-1 inputs and give the full forward's outputs.
    Chunks of 3, 4, 1, 2 tokens over SEG: one starts a new document with several tokens (row 0
    at 3), one with a single token (row 0 at 7), one crosses a boundary inside it (row 1 at 6)."""
    m, x, pos = SoftmaxAttention(conv_cfg("gqa"), rngs=nnx.Rngs(0)), inputs(), doc_positions(SEG)
    y_full, _ = m(x, segment_ids=jnp.asarray(SEG), positions=jnp.asarray(pos))
    y_cache, cache = run_cached(m, x, SEG, pos, [3, 4, 1, 2], max_len=T + 3)
    P = m.num_kv_heads * m.head_dim
    assert cache["conv_q"].shape == (B, 3, m.num_heads * m.head_dim) and cache["conv_v"].shape == (B, 3, P)
    err = rel_err(y_cache, y_full)
    print(f"softmax attn + conv gqa cached vs full: rel err {err:.2e}")
    assert err < 1e-5
    assert rel_err(y_cache, conv_attention_reference(m, x, SEG, pos)) < 1e-5
    # the window left behind is the last 3 projected v inputs of each row's last document
    v_in = np.einsum("btd,dhe->bthe", np.asarray(x, np.float64),
                     np.asarray(m.v_proj.kernel[...], np.float64)).reshape(B, T, P)
    np.testing.assert_allclose(np.asarray(cache["conv_v"]), v_in[:, -3:], rtol=1e-5, atol=1e-6)


def test_conv_size_is_checked():
    bad = ModelConfig(layer_pattern="4*softmax", attention=AttentionConfig(conv_size=-1))
    assert [k for k, _ in bad.check()] == ["attention.conv_size"]
    assert ModelConfig(layer_pattern="4*kda", attention=AttentionConfig(conv_size=-1)).check() == []  # unused


def test_short_conv_context_parallel_equals_one_device():
    """Tokens split over mesh.context=4, each conv taking its halo from the upstream shard
    (k3jax.layers.context_parallel.short_conv, whose backward the KDA layers' tests cover): one
    packed row's outputs, documents starting inside a shard and on its edge, equal the one-device run's."""
    from k3jax.config import load_config
    from k3jax.sharding import make_mesh

    m = SoftmaxAttention(conv_cfg("gqa"), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)
    seg = jnp.asarray([[1] * 5 + [2] * 11 + [3] * 16, [5] * 32], jnp.int32)
    pos = jnp.asarray(doc_positions(np.asarray(seg)))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, D_MODEL))
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, segment_ids=seg, positions=pos)[0])
    want = forward(state, x)
    tiny = Path(__file__).resolve().parents[1] / "configs" / "k3-tiny.yaml"
    mesh_cfg = load_config(tiny, ["mesh.data=1", "mesh.context=4", "mesh.num_devices=4"]).mesh
    with jax.set_mesh(make_mesh(mesh_cfg)):
        got = forward(state, x)
    assert rel_err(got, want) < 2e-6, rel_err(got, want)
