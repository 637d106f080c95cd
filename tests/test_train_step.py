"""The optimizer step: accumulation, schedules, parameter groups, z-loss, QB in the step."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.config import load_config
from train.optimizer import build_optimizer, lr_schedule, muon_dimension_numbers, per_param
from train.state import init_train_state, model_spec
from train.step import make_train_step, token_losses

TINY = Path(__file__).resolve().parents[1] / "configs" / "k3-tiny.yaml"
SMALL = ["model.layer_pattern=kda+mla", "model.attn_res_block_size=2", "model.d_model=64",
         "model.moe.latent_dim=32", "data.seq_len=16", "train.batch_size=4"]


def _batch(B, L, vocab, seed=0):
    tok = jax.random.randint(jax.random.PRNGKey(seed), (B, L + 1), 0, vocab)
    seg = jnp.concatenate([jnp.ones((B, L // 2), jnp.int32), 2 * jnp.ones((B, L - L // 2), jnp.int32)], 1)
    mask = jnp.ones((B, L)).at[:, L // 2 - 1].set(0.0)  # no target across the document boundary
    return dict(tokens=tok[:, :-1], targets=tok[:, 1:], segment_ids=seg,
                positions=jnp.concatenate([jnp.arange(L // 2), jnp.arange(L - L // 2)])[None].repeat(B, 0),
                loss_mask=mask)


def _setup(overrides):
    cfg = load_config(TINY, SMALL + overrides)
    spec = model_spec(cfg.model)
    tx, sched = build_optimizer(cfg.optimizer, cfg.train.steps, spec.params)
    return cfg, spec, tx, sched


def test_micro_batches_equal_one_batch():
    """2 micro-batches of 2 rows == 1 batch of 4 rows: loss, grad norm, update, QB bias and load."""
    out = []
    for micro in (1, 2):
        cfg, spec, tx, sched = _setup([f"train.micro_batches={micro}", "model.moe.qb_estimator=exact"])
        state = init_train_state(cfg, spec, tx)
        step = jax.jit(make_train_step(cfg, spec, tx, sched))
        new, m = step(state, _batch(4, 16, cfg.model.vocab_size))
        out.append((new, m))
    (a, ma), (b, mb) = out
    for k in ("loss", "grad_norm", "accuracy", "tokens"):
        np.testing.assert_allclose(ma[k], mb[k], rtol=2e-5)
    np.testing.assert_allclose(ma["max_violation"], mb["max_violation"], rtol=1e-6)
    np.testing.assert_allclose(a["rest"]["router_bias"], b["rest"]["router_bias"], atol=1e-6)
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)  # Adam: ~lr * g / |g|, sensitive where g ~ 0


def test_qb_bias_after_a_step_is_the_update_of_that_steps_routing_and_routes_the_next():
    """Two MoE layers, 2 micro-batches, padded tokens, a non-zero starting bias. Each step's
    new bias equals the QB update (k3jax.layers.qb and the float64 transcription in
    test_qb.py) of the router scores recomputed outside the step (the model's forward on the
    whole batch with the step's parameters and bias, padding dropped by hand). The next
    step routes with the new bias: its per-layer max_violation is that of a numpy top-k of
    scores + new bias (and not that of the old bias), and its loss that of the forward with
    the new bias."""
    from k3jax.layers import qb
    from test_qb import su_update_np
    cfg, spec, tx, sched = _setup(["model.moe.qb_estimator=exact", "model.first_k_dense=0", "train.micro_batches=2"])
    k, E = cfg.model.moe.top_k, cfg.model.moe.num_experts
    state = init_train_state(cfg, spec, tx)
    bias0 = 0.05 * jax.random.normal(jax.random.PRNGKey(5), state["rest"]["router_bias"].shape)
    state = {**state, "rest": {**state["rest"], "router_bias": bias0}}
    assert bias0.shape == (2, E)  # both layers route
    step = jax.jit(make_train_step(cfg, spec, tx, sched))

    @jax.jit
    def forward(params, rest, b):
        logits, aux = spec.model_from(params, rest)(b["tokens"], segment_ids=b["segment_ids"],
                                                     positions=b["positions"], token_mask=b["segment_ids"] > 0)
        return logits, aux["router_stats"]["scores"]

    def padded_batch(seed):
        b = _batch(4, 16, cfg.model.vocab_size, seed)
        b["segment_ids"] = b["segment_ids"].at[1, -5:].set(0)  # padding: out of the routing statistics
        b["loss_mask"] = b["loss_mask"].at[1, -5:].set(0.0)
        return b

    def ce_np(logits, b):
        z = np.asarray(logits, np.float64)
        lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
        ce = lse - np.take_along_axis(z, np.asarray(b["targets"])[..., None], -1)[..., 0]
        mask = np.asarray(b["loss_mask"], np.float64)
        return (ce * mask).sum() / mask.sum()

    def violation_np(scores, bias):
        top = np.argsort(-(scores + bias), axis=1)[:, :k]
        load = np.bincount(top.reshape(-1), minlength=E).astype(np.float64)
        return load.max() / load.mean() - 1.0

    for i in range(2):
        b = padded_batch(10 + i)
        valid = np.asarray(b["segment_ids"]).reshape(-1) > 0
        bias = np.asarray(state["rest"]["router_bias"])
        logits, scores = forward(state["params"], state["rest"], b)
        scores = np.asarray(scores)[:, valid]  # [layers, valid tokens, E]
        new_state, m = step(state, b)
        # this step routed with `bias`: loss and per-layer load of the recomputed routing
        np.testing.assert_allclose(m["loss"], ce_np(logits, b), rtol=2e-5)
        viol = [violation_np(scores[l], bias[l]) for l in range(2)]
        np.testing.assert_allclose(m["max_violation"], viol, rtol=1e-6)
        if i == 1:  # the old bias would have routed differently
            assert not np.allclose(viol, [violation_np(scores[l], np.asarray(bias0)[l]) for l in range(2)])
        got = np.asarray(new_state["rest"]["router_bias"])
        for l in range(2):
            stats = {"scores": jnp.asarray(scores[l]), "mask": jnp.ones(valid.sum(), bool),
                     "tokens": jnp.asarray(float(valid.sum()))}
            want = qb.quantile_balance_update(stats, jnp.asarray(bias[l]), top_k=k, estimator="exact")
            np.testing.assert_allclose(got[l], want, atol=1e-6)
            np.testing.assert_allclose(got[l], su_update_np(scores[l], bias[l], k), atol=1e-6)
        assert np.abs(got - bias).max() > 1e-2
        state = new_state
    # "none" leaves the bias alone
    cfg, spec, tx, sched = _setup(["model.moe.balance=none"])
    start = init_train_state(cfg, spec, tx)
    start = {**start, "rest": {**start["rest"], "router_bias": 0.1 + start["rest"]["router_bias"]}}
    s, _ = jax.jit(make_train_step(cfg, spec, tx, sched))(start, _batch(4, 16, 512))
    np.testing.assert_array_equal(s["rest"]["router_bias"], start["rest"]["router_bias"])


def test_token_losses_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 7)) * 3
    targets = rng.integers(0, 7, (2, 5))
    mask = (rng.random((2, 5)) > 0.3).astype(np.float64)
    ce, zl, correct, n = token_losses(jnp.asarray(logits, jnp.float32), jnp.asarray(targets),
                                      jnp.asarray(mask, jnp.float32), 1e-3)
    lse = np.log(np.exp(logits).sum(-1))
    ref_ce = ((lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]) * mask).sum()
    np.testing.assert_allclose(ce, ref_ce, rtol=1e-5)
    np.testing.assert_allclose(zl, 1e-3 * (lse ** 2 * mask).sum(), rtol=1e-5)
    assert float(correct) == ((logits.argmax(-1) == targets) * mask).sum() and float(n) == mask.sum()


def test_schedules_hand_computed():
    cfg = load_config(None, ["optimizer.lr=1.0", "optimizer.warmup_steps=10", "optimizer.min_lr_ratio=0.1"])
    cos = lr_schedule(cfg.optimizer, 110)
    assert float(cos(0)) == pytest.approx(0.1) and float(cos(9)) == pytest.approx(1.0)
    assert float(cos(10)) == pytest.approx(1.0)
    assert float(cos(60)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)  # halfway through the cosine
    assert float(cos(110)) == pytest.approx(0.1, rel=1e-5)
    wsd = lr_schedule(load_config(None, ["optimizer.lr=1.0", "optimizer.warmup_steps=10", "optimizer.min_lr_ratio=0.1",
                                         "optimizer.schedule=wsd", "optimizer.decay_fraction=0.2"]).optimizer, 110)
    assert float(wsd(50)) == pytest.approx(1.0) and float(wsd(90)) == pytest.approx(1.0)
    assert float(wsd(100)) == pytest.approx(0.55, rel=1e-5) and float(wsd(110)) == pytest.approx(0.1, rel=1e-5)


def test_parameter_groups():
    """Muon gets hidden matrices (stacked and expert dims as batch); AdamW the rest;
    weight decay only on matrices."""
    cfg, spec, _, _ = _setup([])
    flat = {"/".join(map(str, p)): (muon_dimension_numbers(p, v), v) for p, v in
            __import__("flax").nnx.to_flat_state(spec.params)}
    def dims(suffix):
        names = [k for k in flat if k.endswith(suffix)]
        assert names, suffix
        return flat[names[0]][0]
    assert dims("embed_tokens") is None and dims("lm_head/kernel") is None
    assert dims("block_sparse_moe/gate/weight") is None  # router gate: AdamW
    assert dims("self_attn/A_log") is None and dims("q_conv1d/weight") is None
    assert dims("self_attention_res/proj/kernel") is None and dims("input_layernorm/weight") is None
    # stacked [R, d, P]: reduce over d, output P, R is a batch axis
    q = dims("layers/0/self_attn/q_proj/kernel")
    assert tuple(np.atleast_1d(q.reduction_axis)) == (1,) and tuple(np.atleast_1d(q.output_axis)) == (2,)
    # experts [R, E, l, H]: E is a batch axis
    w1 = dims("experts/w1")
    assert tuple(np.atleast_1d(w1.reduction_axis)) == (2,) and tuple(np.atleast_1d(w1.output_axis)) == (3,)
    # heads-merging output projection [R, H, v, d]: reduce over (H, v)
    o = dims("layers/1/self_attn/o_proj/kernel")
    assert tuple(np.atleast_1d(o.reduction_axis)) == (1, 2) and tuple(np.atleast_1d(o.output_axis)) == (3,)
    from train.optimizer import _is_matrix
    decay = per_param(_is_matrix, spec.params)
    flat_decay = {"/".join(map(str, p)): v for p, v in __import__("flax").nnx.traversals.flatten_mapping(decay).items()}
    assert not any(v for k, v in flat_decay.items() if k.endswith(("A_log", "dt_bias", "weight")) and "gate" not in k)
    assert flat_decay["lm_head/kernel"] and flat_decay["stages/0/units/layers/0/self_attn/q_proj/kernel"]


# the quintic Newton-Schulz coefficients of Muon (Keller Jordan's modded-nanogpt)
NS_COEFFS = (3.4445, -4.7750, 2.0315)


def _newton_schulz_np(x, steps):
    """float64: Frobenius-normalise, iterate X <- aX + (bA + cA^2)X with A = XX^T on the wide
    orientation (tall matrices are transposed there and back)."""
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-8)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def test_muon_optimizer_matches_numpy_reference():
    """build_optimizer(name=muon): two steps on a tiny tree against a float64 reference.
    Hidden matrices (plain, tall, stacked, heads-merging [H,v,d]) take Nesterov momentum,
    Newton-Schulz per matrix, x 0.2 sqrt(max(fan_in, fan_out)), decoupled decay; the embedding
    and a norm weight take Nesterov AdamW, the norm without decay; global-norm clip first; lr
    from the warmup. Non-default settings, so each one must reach the optimizer.
    Measured float32 error: at most 7e-6 of the distance each parameter moved (bound 5e-5)."""
    from flax import nnx
    from k3jax.layers.common import EMBED, HEAD_DIM, HEADS, MLP, VOCAB
    cfg = load_config(None, ["optimizer.name=muon", "optimizer.lr=0.1", "optimizer.warmup_steps=4",
                             "optimizer.weight_decay=0.3", "optimizer.muon_momentum=0.8", "optimizer.muon_ns_steps=4",
                             "optimizer.b1=0.85", "optimizer.b2=0.9", "optimizer.eps=1e-3", "optimizer.grad_clip=1.0"])
    o = cfg.optimizer
    rng = np.random.default_rng(0)
    # path: (shape, logical axes (stacked dims unnamed), how the reference treats it)
    mats = lambda x: [x]  # noqa: E731
    table = {
        ("embed_tokens",): ((6, 4), (VOCAB, EMBED), ("adam", True)),
        ("norm", "weight"): ((4,), (EMBED,), ("adam", False)),
        ("mlp", "up_proj", "kernel"): ((4, 6), (EMBED, MLP), ("muon", mats)),
        ("mlp", "down_proj", "kernel"): ((6, 4), (MLP, EMBED), ("muon", mats)),  # tall
        ("layers", "q_proj", "kernel"): ((2, 4, 6), (EMBED, HEADS), ("muon", lambda x: [x[0], x[1]])),  # 2 stacked
        ("attn", "o_proj", "kernel"): ((2, 3, 4), (HEADS, HEAD_DIM, EMBED), ("muon", lambda x: [x.reshape(6, 4)])),
    }
    p0 = {k: rng.standard_normal(shape) for k, (shape, _, _) in table.items()}
    params = nnx.from_flat_state({k: nnx.Param(jnp.asarray(p0[k], jnp.float32), axes=axes)
                                  for k, (_, axes, _) in table.items()})
    tx, _ = build_optimizer(o, 100, params)
    grads = []
    for scale in (3.0, 0.5):  # global norm 3: clipped to 1; then 0.5: left alone
        g = {k: rng.standard_normal(v.shape) * rng.choice([0.01, 1.0]) for k, v in p0.items()}
        norm = np.sqrt(sum((x ** 2).sum() for x in g.values()))
        grads.append({k: x * scale / norm for k, x in g.items()})

    def unflat(d):
        return nnx.traversals.unflatten_mapping({k: jnp.asarray(v, jnp.float32) for k, v in d.items()})

    update = jax.jit(tx.update)
    p, state = unflat(p0), tx.init(unflat(p0))
    ref = {k: v.copy() for k, v in p0.items()}
    m1 = {k: np.zeros_like(v) for k, v in p0.items()}
    m2 = {k: np.zeros_like(v) for k, v in p0.items()}
    for t, g in enumerate(grads, start=1):
        upd, state = update(unflat(g), state, p)
        p = optax.apply_updates(p, upd)
        norm = np.sqrt(sum((x ** 2).sum() for x in g.values()))
        lr = o.lr * t / o.warmup_steps  # linear warmup, count t-1
        for k, (shape, _, (kind, extra)) in table.items():
            gk = g[k] * min(1.0, o.grad_clip / norm)
            if kind == "adam":
                m1[k] = o.b1 * m1[k] + (1 - o.b1) * gk
                m2[k] = o.b2 * m2[k] + (1 - o.b2) * gk ** 2
                mh = o.b1 * m1[k] / (1 - o.b1 ** (t + 1)) + (1 - o.b1) * gk / (1 - o.b1 ** t)
                u = mh / (np.sqrt(m2[k] / (1 - o.b2 ** t)) + o.eps)
                decay = extra
            else:
                beta = o.muon_momentum
                m1[k] = beta * m1[k] + (1 - beta) * gk
                mh = beta * m1[k] / (1 - beta ** (t + 1)) + (1 - beta) * gk / (1 - beta ** t)
                out = [0.2 * np.sqrt(max(x.shape)) * _newton_schulz_np(x, o.muon_ns_steps) for x in extra(mh)]
                u = np.stack(out).reshape(shape)
                decay = True
            if decay:
                u = u + o.weight_decay * ref[k]
            ref[k] = ref[k] - lr * u
        got = nnx.traversals.flatten_mapping(p)
        for k in table:
            moved = np.abs(ref[k] - p0[k]).max()  # relative to how far the parameter moved
            err = np.abs(np.asarray(got[k], np.float64) - ref[k]).max() / moved
            assert err < 5e-5, (t, k, err)


def test_skewed_start_max_violation_falls():
    """Start with a bias that sends most tokens to 4 of 16 experts; QB rebalances in a few steps."""
    cfg, spec, tx, sched = _setup(["model.moe.qb_estimator=histogram", "train.batch_size=8"])
    state = init_train_state(cfg, spec, tx)
    skew = jnp.zeros_like(state["rest"]["router_bias"]).at[:, :4].set(1.0)
    state = {**state, "rest": {**state["rest"], "router_bias": skew}}
    step = jax.jit(make_train_step(cfg, spec, tx, sched))
    viol = []
    for i in range(8):
        state, m = step(state, _batch(8, 16, cfg.model.vocab_size, seed=100 + i))
        viol.append(float(m["max_violation"].max()))
    assert viol[0] > 2.0 and max(viol[-3:]) < 0.5 * viol[0], viol
