"""The whole decoder: decode == forward, scanned == unscanned, gradients for every config,
generation, layer planning and the k3jax-info figures."""

import functools
import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import decode
from k3jax.config import load_config
from k3jax.config.shrink import shrink_model
from k3jax.info import main as info_main
from k3jax.info import report
from k3jax.layout import plan_stages
from k3jax.model import create_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")) + glob.glob(os.path.join(ROOT, "configs", "*", "*.yaml")))


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(os.path.join(ROOT, "configs", "k3-tiny.yaml")).model
    model = create_model(cfg, seed=0)
    # a non-zero QB bias so routing depends on it
    model.router_bias[...] = 0.1 * jax.random.normal(jax.random.PRNGKey(1), model.router_bias[...].shape)
    return cfg, model


def test_prefill_and_decode_equal_forward(tiny):
    """k3-tiny (KDA + MLA, MoE, AttnRes). Row 0 packs three documents, one starting during
    decode; row 1 is a single document."""
    cfg, model = tiny
    graphdef, state = nnx.split(model)
    B, T, T1 = 2, 20, 9
    tokens = jax.random.randint(jax.random.PRNGKey(0), (B, T), 0, cfg.vocab_size)
    seg = jnp.array([[0] * 5 + [1] * 8 + [2] * 7, [0] * T])
    full = jax.jit(lambda s, t, g: nnx.merge(graphdef, s)(t, segment_ids=g)[0])(state, tokens, seg)
    pre = jax.jit(lambda s, t, c, g: decode.prefill(nnx.merge(graphdef, s), t, c, segment_ids=g))
    step = jax.jit(lambda s, t, c, g: decode.decode_step(nnx.merge(graphdef, s), t, c, segment_ids=g))
    cache = decode.init_cache(model, B, 24)
    logits, cache = pre(state, tokens[:, :T1], cache, seg[:, :T1])
    outs = [logits]
    for t in range(T1, T):
        logits, cache = step(state, tokens[:, t], cache, seg[:, t])
        outs.append(logits[:, None])
    err = float(jnp.abs(jnp.concatenate(outs, 1) - full).max())
    assert err < 2e-5, err
    assert int(cache["index"]) == T


def _per_layer_states(model) -> list:
    """One nnx.State per absolute layer, taken out of the model's stacked stages."""
    out = [None] * model.cfg.num_layers
    for stage, stacked in zip(model.plan, model.stages):
        layers = nnx.state(stacked.units)["layers"]
        for r in range(stage.repeat):
            for j in range(len(stage.unit)):
                out[stage.layer_index(r, j)] = jax.tree.map(lambda a: a[r], layers[j])
    return out


def _copy_weights(src, dst) -> None:
    """Every weight of `src` into `dst`: the same network with its layers grouped into other
    stages (scanned vs unscanned), matched by absolute layer index."""
    for name in ("embed_tokens", "norm", "lm_head", "output_attn_res", "router_bias"):
        if not hasattr(src, name):
            continue
        part = getattr(src, name)
        if isinstance(part, nnx.Variable):
            getattr(dst, name)[...] = part[...]
        else:
            nnx.update(getattr(dst, name), nnx.state(part))
    layers = _per_layer_states(src)
    for stage, stacked in zip(dst.plan, dst.stages):
        state = nnx.state(stacked.units)
        for j in range(len(stage.unit)):
            reps = [layers[stage.layer_index(r, j)] for r in range(stage.repeat)]
            state["layers"][j] = jax.tree.map(lambda *a: jnp.stack(a), *reps)
        nnx.update(stacked.units, state)


def test_scanned_equals_unscanned():
    over = ["model.layer_pattern=3*(kda,mla)", "model.attn_res_block_size=2", "model.d_model=64"]
    path = os.path.join(ROOT, "configs", "k3-tiny.yaml")
    scanned = create_model(load_config(path, over).model, seed=0)
    unrolled = create_model(load_config(path, over + ["model.scan_layers=false"]).model, seed=7)
    assert [s.repeat for s in scanned.plan] == [1, 2] and len(unrolled.plan) == 1
    _copy_weights(scanned, unrolled)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 16), 0, 512)
    (a, sa), (b, sb) = scanned(tokens), unrolled(tokens)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(sa["router_stats"]["load"], sb["router_stats"]["load"])


def test_k3_layer_plan():
    cfg = load_config(os.path.join(ROOT, "configs", "k3.yaml")).model
    plan = plan_stages(cfg)
    assert [(s.start, len(s.unit), s.repeat) for s in plan] == [(0, 12, 1), (12, 12, 6), (84, 9, 1)]
    assert plan[0].unit[0] == ("kda", "dense") and plan[2].unit[-2:] == (("mla", "moe"), ("mla", "moe"))


def _loss(graphdef, state, tokens, seg):
    logits, _ = nnx.merge(graphdef, state)(tokens, segment_ids=seg)
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "configs")))
def test_gradients_finite_for_every_config(path):
    cfg = shrink_model(load_config(path).model)
    model = create_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    params = nnx.state(model, nnx.Param)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 24), 0, cfg.vocab_size)
    seg = jnp.array([[0] * 10 + [1] * 14, [0] * 24])
    grads = jax.jit(jax.grad(lambda p: _loss(graphdef, nnx.merge_state(state, p), tokens, seg)))(params)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(bool(jnp.isfinite(g).all()) for g in leaves)
    assert sum(float(jnp.abs(g).sum()) > 0 for g in leaves) > 0.7 * len(leaves)


def test_remat_does_not_change_gradients():
    path = os.path.join(ROOT, "configs", "k3-tiny.yaml")
    grads = []
    for remat in ("none", "full"):
        cfg = shrink_model(load_config(path, [f"model.remat={remat}", "model.layer_pattern=kda+mla", "model.attn_res_block_size=2"]).model)
        graphdef, state = nnx.split(create_model(cfg, seed=0))
        tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 16), 0, cfg.vocab_size)
        grads.append(jax.jit(jax.grad(functools.partial(_loss, graphdef)))(state, tokens, jnp.zeros((2, 16), jnp.int32)))
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_greedy_generation_is_consistent_with_forward(tiny):
    cfg, model = tiny
    prompt = jax.random.randint(jax.random.PRNGKey(4), (2, 6), 0, cfg.vocab_size)
    out = decode.generate(model, prompt, max_new_tokens=5)
    assert out.shape == (2, 11)
    np.testing.assert_array_equal(out[:, :6], prompt)
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])(state, out)
    np.testing.assert_array_equal(jnp.argmax(logits[:, 5:-1], -1), out[:, 6:])


def test_sampling():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    key = jax.random.PRNGKey(0)
    assert int(decode.sample_logits(logits, key, temperature=0.0, top_p=1.0)[0]) == 0
    keys = jax.random.split(key, 4000)
    draw = jax.vmap(lambda k: decode.sample_logits(logits, k, temperature=1.0, top_p=1.0)[0])(keys)
    freq = np.bincount(np.asarray(draw), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    # top-p 0.7 keeps {0.5, 0.3}: renormalised to 0.625 / 0.375, never the tail
    draw = jax.vmap(lambda k: decode.sample_logits(logits, k, temperature=1.0, top_p=0.7)[0])(keys)
    freq = np.bincount(np.asarray(draw), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.03)


def test_info_full_k3_counts(capsys):
    cfg = load_config(os.path.join(ROOT, "configs", "k3.yaml")).model
    r = report(cfg, 1_048_576)
    assert abs(r["total_params"] / 2.7795e12 - 1) < 0.005
    assert abs(r["active_params"] / 104.19e9 - 1) < 0.005
    # hand-computed decode state: 69 KDA layers x [96,128,128] fp32 + 3 bf16 conv windows of
    # [3, 12288]; 24 MLA layers x 576 bf16 values per token
    s = r["decode_state_bytes"]
    assert s["kda_state"] == 69 * 96 * 128 * 128 * 4
    assert s["kda_conv"] == 69 * 3 * 3 * 12288 * 2
    assert s["mla_latent"] == 24 * 576 * 2 * 1_048_576
    assert info_main(["--config", os.path.join(ROOT, "configs", "k3.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"total_params", "active_params"} <= set(out)


def test_info_reports_config_errors(capsys):
    assert info_main(["--config", os.path.join(ROOT, "configs", "k3.yaml"), "model.d_modle=3"]) == 2
    assert "did you mean 'model.d_model'" in capsys.readouterr().err
