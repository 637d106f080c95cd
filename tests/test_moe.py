"""Router, GLUs, dropless expert dispatch and the Stable LatentMoE layer against float64 numpy."""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import ModelConfig, MoEConfig
from k3jax.layers.activations import apply_glu, glu_spec, situ_glu, swiglu
from k3jax.layers.moe import StableLatentMoE, routed_experts_dense_reference, routed_experts_dropless
from k3jax.layers.router import Router

E, K = 8, 2


def make_cfg(init_std=0.3, **moe_kw):
    moe = dict(num_experts=E, top_k=K, expert_hidden=16, latent_dim=16, num_shared_experts=1)
    moe.update(moe_kw)
    # a large init_std so scores spread, GLUs leave their linear range and the norm matters
    return ModelConfig(d_model=32, compute_dtype="float32", init_std=init_std, moe=MoEConfig(**moe))


def np_sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, np.float64)))  # no exp overflow


def np_glu(a, b, activation="situ", beta=4.0, linear_beta=25.0):
    if activation == "swiglu":
        return a * np_sigmoid(a) * b
    up = b if linear_beta is None else linear_beta * np.tanh(b / linear_beta)
    return beta * np.tanh(a / beta) * np_sigmoid(a) * up


def np_route(x, w, bias, k, scale):
    s = np_sigmoid(np.asarray(x, np.float64) @ np.asarray(w, np.float64))
    idx = np.argsort(-(s + bias), axis=-1, kind="stable")[:, :k]
    picked = np.take_along_axis(s, idx, -1)
    return idx, picked / (picked.sum(-1, keepdims=True) + 1e-20) * scale, s


def f64(v):
    return np.asarray(v[...], np.float64)


def np_moe_layer(m, cfg, x, bias):
    """Stable LatentMoE per token in float64 from the module's parameters: z = W_down x,
    u = sum_e p_e W2_e act(W1_e z, W3_e z), y = W_up RMSNorm(u) + shared(x). x [N,d] -> [N,d]."""
    moe, act = cfg.moe, (cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)
    x = np.asarray(x, np.float64)
    idx, p, _ = np_route(x, f64(m.gate.weight), np.asarray(bias, np.float64), moe.top_k,
                         moe.routed_scaling_factor)
    w1, w3, w2 = f64(m.experts.w1), f64(m.experts.w3), f64(m.experts.w2)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        z = x[t] @ f64(m.routed_expert_down_proj.kernel) if moe.latent_dim else x[t]
        u = sum(p[t, j] * (np_glu(z @ w1[e], z @ w3[e], *act) @ w2[e]) for j, e in enumerate(idx[t]))
        if moe.latent_dim and moe.latent_norm:
            u = u / np.sqrt(np.mean(u * u) + cfg.rms_norm_eps) * f64(m.routed_expert_norm.weight)
        out[t] = u @ f64(m.routed_expert_up_proj.kernel) if moe.latent_dim else u
        if m.shared_experts is not None:
            sh = m.shared_experts
            out[t] += np_glu(x[t] @ f64(sh.gate_proj.kernel), x[t] @ f64(sh.up_proj.kernel), *act) @ f64(
                sh.down_proj.kernel)
    return out


@pytest.mark.parametrize("scale", [1.0, 2.446])
def test_router_matches_numpy(scale):
    cfg = make_cfg(routed_scaling_factor=scale)
    router = Router(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    bias = rng.normal(0, 0.3, E).astype(np.float32)
    idx, w, s = jax.jit(lambda x, b: router(x, b))(jnp.asarray(x), jnp.asarray(bias))
    want_idx, want_w, want_s = np_route(x, f64(router.weight), bias, K, scale)
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-5)
    assert idx.dtype == jnp.int32 and w.dtype == jnp.float32
    # the bias must change some selections, and must not enter the weights
    unbiased_idx = np.argsort(-want_s, axis=-1, kind="stable")[:, :K]
    assert (np.sort(unbiased_idx, -1) != np.sort(want_idx, -1)).any()
    biased = np.take_along_axis(want_s + bias, want_idx, -1)
    assert not np.allclose(np.asarray(w), biased / biased.sum(-1, keepdims=True) * scale, rtol=1e-3)


def test_node_limited_routing_matches_numpy():
    """moe.max_nodes_per_token=2 of expert_nodes=4 groups: each group scores the sum of its
    ceil(k/M) highest biased scores, the token keeps its 2 best groups (ties: the lower), and
    its top-k lies inside them; the weights still come from the unbiased scores."""
    k, nodes, M = 4, 4, 2
    cfg = make_cfg(top_k=k, max_nodes_per_token=M, expert_nodes=nodes)
    router = Router(cfg, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    bias = rng.normal(0, 0.3, E).astype(np.float32)
    idx, w, s = jax.jit(lambda x, b: router(x, b))(jnp.asarray(x), jnp.asarray(bias))
    sc = np_sigmoid(x.astype(np.float64) @ f64(router.weight))
    biased = sc + bias
    per = E // nodes
    group = np.sort(biased.reshape(64, nodes, per), -1)[..., ::-1][..., :2].sum(-1)
    best = np.argsort(-group, axis=-1, kind="stable")[:, :M]
    allowed = np.zeros((64, E), bool)
    for t in range(64):
        for g in best[t]:
            allowed[t, g * per:(g + 1) * per] = True
    want = np.argsort(-np.where(allowed, biased, -np.inf), axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.asarray(idx), want)
    picked = np.take_along_axis(sc, want, -1)
    np.testing.assert_allclose(np.asarray(w), picked / picked.sum(-1, keepdims=True), rtol=1e-5)
    assert max(len(set(r // per)) for r in np.asarray(idx)) == M
    plain_router = Router(make_cfg(top_k=k), rngs=nnx.Rngs(1))
    plain = jax.jit(lambda x, b: plain_router(x, b)[0])(jnp.asarray(x), jnp.asarray(bias))
    assert max(len(set(r // per)) for r in np.asarray(plain)) > M  # the limit changes routing here


def test_node_limited_routing_config_rules():
    from k3jax.config import ConfigError, load_config
    base = ["model.moe.num_experts=16", "model.moe.top_k=4"]
    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "k3-tiny.yaml")
    with pytest.raises(ConfigError, match="expert_nodes"):
        load_config(tiny, base + ["model.moe.max_nodes_per_token=2"])
    with pytest.raises(ConfigError, match="max_nodes_per_token"):
        load_config(tiny, base + ["model.moe.max_nodes_per_token=1", "model.moe.expert_nodes=8"])  # 2 < top_k
    from k3jax.kernel_paths import kernel_lines
    on = load_config(tiny, base + ["model.moe.max_nodes_per_token=2", "model.moe.expert_nodes=4"])
    assert any("node-limited: each token's experts lie on at most 2 of 4 nodes" in x for x in kernel_lines(on.model))
    assert not any("node-limited" in x for x in kernel_lines(load_config(tiny, base).model))  # a run says so at start


def test_router_cutoff_from_its_own_top_k_plus_one():
    """with_cutoff: the same routing, and each token's (k+1)-th largest biased score (numpy);
    the histogram statistics given that cutoff equal those that compute it themselves."""
    from k3jax.layers import qb
    router = Router(make_cfg(), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    bias = jnp.asarray(rng.normal(0, 0.3, E), jnp.float32)
    idx, w, s = router(x, bias)
    idx2, w2, s2, cut = router(x, bias, with_cutoff=True)
    for a, b in ((idx, idx2), (w, w2), (s, s2)):
        np.testing.assert_array_equal(a, b)
    want = -np.sort(-(np.asarray(s, np.float64) + np.asarray(bias)), axis=-1)[:, K]
    np.testing.assert_allclose(cut, want, rtol=1e-6)
    kw = dict(top_k=K, estimator="histogram", bins=64, value_range=1.0)
    mask = jnp.arange(64) < 60
    for key, v in qb.routing_stats(s, idx, bias, mask, **kw).items():
        np.testing.assert_array_equal(v, qb.routing_stats(s, idx, bias, mask, cutoff=cut, **kw)[key], err_msg=key)


def test_situ_and_swiglu_match_numpy():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 256)).astype(np.float32) * 3
    np.testing.assert_allclose(np.asarray(situ_glu(a, b)), np_glu(a, b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(situ_glu(a, b, 2.0, None)), np_glu(a, b, "situ", 2.0, None),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(swiglu(a, b)), np_glu(a, b, "swiglu"), rtol=1e-5, atol=1e-6)
    big_a, big_b = a * 1e3, b * 1e3
    out = np.asarray(situ_glu(big_a, big_b))
    np.testing.assert_allclose(out, np_glu(big_a.astype(np.float64), big_b), rtol=1e-5, atol=1e-6)
    assert np.all(np.abs(out) <= 4.0 * 25.0 + 1e-4) and np.abs(out).max() > 90.0
    # near zero SiTU is SwiGLU; with linear_beta None the up half is unbounded
    small = a * 1e-2, b * 1e-2
    np.testing.assert_allclose(np.asarray(situ_glu(*small)), np_glu(*small, "swiglu"), rtol=1e-3, atol=1e-9)
    assert np.abs(np.asarray(situ_glu(big_a, big_b, 4.0, None))).max() > 1e3


def test_glu_vjps_equal_autodiff_of_the_plain_forms():
    """situ_glu / swiglu's hand-written backward against autodiff of their plain forms: fp32
    inputs to rounding, bf16 inputs to one bf16 rounding; linear_beta=None too; a wide range
    of inputs (tanh saturated)."""
    from k3jax.layers.activations import situ_glu_reference, swiglu_reference
    rng = np.random.default_rng(5)
    a, b = (jnp.asarray(rng.standard_normal((4, 64)) * 6, jnp.float32) for _ in range(2))
    g = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    cases = [(functools.partial(situ_glu, beta=4.0, linear_beta=25.0), functools.partial(situ_glu_reference, beta=4.0,
              linear_beta=25.0)), (functools.partial(situ_glu, beta=2.0, linear_beta=None),
              functools.partial(situ_glu_reference, beta=2.0, linear_beta=None)), (swiglu, swiglu_reference)]
    for fn, ref in cases:
        for dt, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
            x, y, c = a.astype(dt), b.astype(dt), g.astype(dt)
            np.testing.assert_array_equal(np.asarray(fn(x, y), np.float32), np.asarray(ref(x, y), np.float32))
            got = jax.vjp(fn, x, y)[1](c)
            want = jax.vjp(ref, x, y)[1](c)
            for u, v in zip(got, want):
                assert u.dtype == dt
                u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
                assert np.abs(u - v).max() <= tol * np.abs(v).max(), (fn, dt)


def _routing_case(seed, n_tok=12, width=16, hidden=16, n_exp=E, k=K):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n_tok, width)).astype(np.float32)
    # experts 2 and n-1 get no token: empty groups in the middle and at the end
    allowed = np.array([e for e in range(n_exp) if e not in (2, n_exp - 1)])
    idx = np.stack([rng.choice(allowed, k, replace=False) for _ in range(n_tok)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (n_tok, k)).astype(np.float32)
    ws = [rng.standard_normal(s).astype(np.float32) * 0.5
          for s in ((n_exp, width, hidden), (n_exp, width, hidden), (n_exp, hidden, width))]
    return [jnp.asarray(v) for v in (z, idx, wts, *ws)]


@pytest.mark.parametrize("glu,gmm", [(("situ", 4.0, 25.0), "ragged"), (("swiglu", 4.0, 25.0), "blocked")])
def test_dropless_equals_dense_reference_and_numpy(glu, gmm):
    z, idx, wts, w1, w3, w2 = _routing_case(2)
    assert np.bincount(np.asarray(idx).ravel(), minlength=E).min() == 0
    dropless = functools.partial(routed_experts_dropless, glu=glu, gmm=gmm, gmm_block=4)
    got = jax.jit(dropless)(z, idx, wts, w1, w3, w2)
    ref = routed_experts_dense_reference(z, idx, wts, w1, w3, w2, glu)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    zz, W1, W3, W2 = (np.asarray(v, np.float64) for v in (z, w1, w3, w2))
    want = np.stack([sum(float(wts[t, j]) * (np_glu(zz[t] @ W1[e], zz[t] @ W3[e], *glu) @ W2[e])
                         for j, e in enumerate(np.asarray(idx[t]))) for t in range(z.shape[0])])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gmm", ["ragged", "blocked"])
def test_dropless_gradients_equal_dense_reference(gmm):
    z, idx, wts, w1, w3, w2 = _routing_case(3)
    glu = ("situ", 4.0, 25.0)
    cot = jax.random.normal(jax.random.key(0), (z.shape[0], z.shape[1]))

    def loss(fn):
        return lambda z, wts, w1, w3, w2: jnp.sum(fn(z, idx, wts, w1, w3, w2, glu) * cot)

    args = (z, wts, w1, w3, w2)
    dropless = functools.partial(routed_experts_dropless, gmm=gmm, gmm_block=3)
    got = jax.jit(jax.grad(loss(dropless), argnums=range(5)))(*args)
    want = jax.grad(loss(routed_experts_dense_reference), argnums=range(5))(*args)
    for name, g, r in zip(("z", "weights", "w1", "w3", "w2"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5, err_msg=name)
        assert np.abs(np.asarray(r)).max() > 1e-3, name


def test_pair_moves_are_gathers_equal_to_plain_indexing():
    """expert_pairs' dispatch, unsort and combine (custom VJPs whose backward is a gather) against
    plain indexing and an einsum under autodiff (scatter-add transposes): values and gradients,
    and no scatter-add in the backward of the dispatch."""
    from k3jax.layers.expert_pairs import combine_pairs, dispatch_rows, inverse_permutation, sort_pairs, unsort
    rng = np.random.default_rng(4)
    n, k, l = 6, 3, 5
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(n)]), jnp.int32)
    order, experts, tokens = sort_pairs(idx)
    np.testing.assert_array_equal(np.asarray(inverse_permutation(order))[np.asarray(order)], np.arange(n * k))
    x, rows = jnp.asarray(rng.standard_normal((n, l)), jnp.float32), jnp.asarray(rng.standard_normal((n * k, l)))
    w = jnp.asarray(rng.random((n, k)), jnp.float32)
    c1, c2 = jnp.asarray(rng.standard_normal((n * k, l))), jnp.asarray(rng.standard_normal((n, l)))

    def plain(x, rows, w):
        slots = rows[jnp.argsort(order)].reshape(n, k, l)
        return x[tokens], rows[jnp.argsort(order)], jnp.einsum("nk,nkl->nl", w, slots)

    def fused(x, rows, w):
        return dispatch_rows(x, order, k), unsort(rows, order), combine_pairs(rows, order, w)

    def loss(fn, x, rows, w):
        a, b, c = fn(x, rows, w)
        return jnp.sum(a * c1) + jnp.sum(b * c1) + jnp.sum(c * c2)

    for got, want in zip(fused(x, rows, w), plain(x, rows, w)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    got = jax.grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2))(x, rows, w)
    want = jax.grad(lambda *a: loss(plain, *a), argnums=(0, 1, 2))(x, rows, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    hlo = jax.jit(jax.grad(lambda x: jnp.sum(dispatch_rows(x, order, k) * c1))).lower(x).as_text()
    # one scatter: the inverse permutation's, of unique indices (the plain form's is a scatter-add)
    assert hlo.count("\"stablehlo.scatter\"(") == 1 and hlo.count("unique_indices = true") == 1
    # bf16 rows: the k pair gradients of a token are summed in fp32, then rounded once
    xb = x.astype(jnp.bfloat16)
    gb = jax.grad(lambda x: jnp.sum(dispatch_rows(x, order, k).astype(jnp.float32) * c1))(xb)
    assert gb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(gb, np.float32), np.asarray(want[0]), rtol=1e-2, atol=1e-2)


LAYER_CASES = {
    "latent": {},
    "no_latent": dict(latent_dim=0),
    "latent_no_norm": dict(latent_norm=False),
    "no_shared_scaled": dict(num_shared_experts=0, routed_scaling_factor=2.446),
    "wide_shared": dict(shared_hidden=24),
}


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_matches_numpy(case):
    cfg = make_cfg(**LAYER_CASES[case])
    m = StableLatentMoE(cfg, rngs=nnx.Rngs(1))
    assert (m.shared_experts is None) == (case == "no_shared_scaled")
    assert (m.routed_expert_down_proj is None) == (case == "no_latent")
    if case == "wide_shared":
        assert m.shared_experts.gate_proj.kernel.shape == (32, 24)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 6, 32)).astype(np.float32)
    bias = rng.normal(0, 0.3, E).astype(np.float32)
    y, stats = nnx.jit(lambda m, x, b: m(x, b))(m, jnp.asarray(x), jnp.asarray(bias))
    want = np_moe_layer(m, cfg, x.reshape(-1, 32), bias).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
    assert np.abs(want).max() > 0.1


def test_layer_swiglu_and_stats_with_mask():
    cfg = dataclasses.replace(make_cfg(qb_estimator="histogram", qb_bins=64), activation="swiglu")
    m = StableLatentMoE(cfg, rngs=nnx.Rngs(2))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 5, 32)).astype(np.float32)
    bias = rng.normal(0, 0.3, E).astype(np.float32)
    mask = np.ones((2, 5), bool)
    mask[1, 3:] = False
    y, stats = m(jnp.asarray(x), jnp.asarray(bias), token_mask=jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(y), np_moe_layer(m, cfg, x.reshape(-1, 32), bias).reshape(x.shape),
                               rtol=1e-4, atol=1e-5)
    idx, _, _ = np_route(x.reshape(-1, 32), f64(m.gate.weight), bias, K, 1.0)
    load = np.bincount(idx[mask.reshape(-1)].ravel(), minlength=E)
    np.testing.assert_array_equal(np.asarray(stats["load"]), load)
    assert float(stats["tokens"]) == mask.sum()
    assert stats["hist"].shape == (E, 64) and float(stats["hist"].sum()) == E * mask.sum()


def test_layer_gradients_flow_and_bf16_close_to_fp32():
    cfg = make_cfg(init_std=0.1)
    m = StableLatentMoE(cfg, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(1), (2, 4, 32))
    bias = jnp.zeros(E)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, bias)[0] ** 2)))(m)
    for path, g in nnx.to_flat_state(grads):
        assert np.isfinite(np.asarray(g[...])).all() and np.abs(np.asarray(g[...])).max() > 0, path
    m16 = StableLatentMoE(dataclasses.replace(cfg, compute_dtype="bfloat16"), rngs=nnx.Rngs(3))
    fwd = nnx.jit(lambda m: m(x, bias)[0])
    y32, y16 = fwd(m), fwd(m16)
    assert y16.dtype == jnp.bfloat16
    err = np.abs(np.asarray(y16, np.float32) - np.asarray(y32)).max() / np.abs(np.asarray(y32)).max()
    assert err < 3e-2, err


def test_glu_spec_dispatch():
    a, b = jnp.linspace(-6, 6, 13), jnp.linspace(5, -5, 13)
    cfg = make_cfg()
    np.testing.assert_allclose(np.asarray(apply_glu(glu_spec(cfg), a, b)), np_glu(np.asarray(a), np.asarray(b)),
                               rtol=1e-5, atol=1e-6)
