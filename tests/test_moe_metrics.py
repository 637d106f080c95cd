"""MoE step metrics and routing corner cases: the expert drop rate counts what the exchange
drops against what it was given, and balance=none routes every token to every expert."""

import functools
from pathlib import Path

import jax
import numpy as np
import pytest

from k3jax.config import load_config
from train.setup import prepare
from train.state import init_train_state

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "k3-tiny.yaml")
# one KDA layer with its MoE: the drop rate and the routing are per MoE layer, and a second
# layer only doubled each step's compile
SMALL = ["model.layer_pattern=kda", "model.attn_res_block_size=0", "model.d_model=64", "model.moe.latent_dim=32",
         "data.seq_len=32", "train.batch_size=8", "model.first_k_dense=0", "model.compute_dtype=float32"]


# expert parallelism with capacity dispatch: 4 expert shards, their buffers' room set by the
# capacity factor (appended per test)
EP = ["mesh.data=1", "mesh.expert=4", "mesh.num_devices=4", "model.moe.ep_dispatch=capacity"]
# room for every pair: no drops. test_collapse_warning_fires_on_a_constructed_collapse steps this
# config too, so the file compiles its step once (its metrics come from the routing, before any exchange)
ROOMY = EP + ["model.moe.ep_capacity_factor=4.0"]


@functools.cache
def compiled_step(overrides: tuple):
    """(cfg, setup, initial state, jitted step) of SMALL + overrides, made once per file run:
    tests that step the same config share its trace and compile (donate=False: the state is
    never consumed)."""
    cfg = load_config(TINY, SMALL + list(overrides))
    setup = prepare(cfg)
    with jax.set_mesh(setup.mesh):
        state = init_train_state(cfg, setup.spec, setup.tx, shardings=setup.shardings)
    return cfg, setup, state, setup.train_step(cfg, donate=False)


def batch_of(segment_ids):
    """The file's one batch of tokens [8,32] with these segment ids (0: padding, no loss)."""
    tok = np.random.default_rng(0).integers(1, 256, (8, 33)).astype(np.int32)
    return {"tokens": tok[:, :-1], "targets": tok[:, 1:], "segment_ids": segment_ids,
            "positions": np.tile(np.arange(32, dtype=np.int32), (8, 1)),
            "loss_mask": (segment_ids > 0).astype(np.float32)}


def one_step(overrides, *segment_ids):
    """One step's metrics from the same initial state, for each segment_ids [8,32] given
    (one compile: the batches differ in values only)."""
    cfg, setup, state, step = compiled_step(tuple(overrides))
    out = []
    with jax.set_mesh(setup.mesh):
        for seg in segment_ids:
            _, metrics = step(state, {k: jax.device_put(v, setup.rows) for k, v in batch_of(seg).items()})
            out.append(jax.device_get(metrics))
    return out if len(out) > 1 else out[0]


def test_drop_rate_is_over_every_routed_pair():
    """Padding tokens are routed and exchanged like any other (the exchange cannot tell), so
    the rate divides the dropped pairs by all routed pairs. Same tokens, three quarters marked
    as padding: the exchange drops (almost) the same pairs, so the rate must not change (the
    old denominator, the valid tokens' load, made it 4x larger, up to impossible rates > 1)."""
    ep = EP + ["model.moe.ep_capacity_factor=0.3"]
    full = np.ones((8, 32), np.int32)
    padded = full.copy()
    padded[:, 8:] = 0  # three quarters padding
    a, b = one_step(ep, full, padded)
    assert np.all(a["expert_drop_rate"] > 0.3) and np.all(a["expert_drop_rate"] <= 1.0)  # cf 0.3: most pairs drop
    # padding is also a document boundary, so the mixers, and with them a few routing choices,
    # change; which pairs an over-full buffer drops follows the routing (a dropped row carries
    # 1 to 4 of a token's pairs): the rates agree to 1 %, where the old denominator gave 4x
    np.testing.assert_allclose(b["expert_drop_rate"], a["expert_drop_rate"], rtol=1e-2)
    nothing = one_step(ROOMY, full)  # room for every pair
    assert np.all(nothing["expert_drop_rate"] == 0)


@pytest.mark.parametrize("estimator", ["exact", "histogram"])
def test_no_balancing_with_every_expert_chosen(estimator):
    """top_k = num_experts with balance=none is a valid config (a dense MoE); the QB
    estimators' statistics need k < E and are not collected then. Every token reaches every
    expert, so the load is perfectly even."""
    m = one_step(["mesh.num_devices=1", "model.moe.balance=none", "model.moe.top_k=16",
                  f"model.moe.qb_estimator={estimator}"], np.ones((8, 32), np.int32))
    assert np.isfinite(m["loss"]) and np.all(m["max_violation"] == 0)


def test_each_layer_bias_reaches_its_own_layer_in_the_scanned_model():
    """Five MoE layers: one in the first stage, four in a stage scanned twice (units of two),
    each slicing its row of the one [L_moe, E] router bias. Each row pushes a different expert
    far above every score: layer i must send every token to its expert e_i and to no other
    layer's, so a row that reached another layer (a scan iterating the rows in another order,
    one row for every layer) would put the wrong expert on top."""
    from flax import nnx

    from k3jax.layout import plan_stages
    from k3jax.model import create_model

    cfg = load_config(TINY, ["model.layer_pattern=3*(kda,mla)", "model.attn_res_block_size=2",
                             "model.compute_dtype=float32", "model.d_model=64", "model.moe.latent_dim=32",
                             "model.moe.num_experts=8", "model.moe.top_k=2"]).model
    assert [s.repeat for s in plan_stages(cfg)] == [1, 2]  # the scanned stage the test is about
    model = create_model(cfg, seed=0)
    n_moe, n_exp = model.router_bias[...].shape
    forced = (3 * np.arange(n_moe) + 1) % n_exp  # distinct experts, none in its own layer's row index
    bias = np.zeros((n_moe, n_exp), np.float32)
    bias[np.arange(n_moe), forced] = 10.0  # sigmoid scores lie in (0, 1): +10 wins every token's top-k
    model.router_bias[...] = bias
    tok = np.random.default_rng(0).integers(1, 256, (2, 16)).astype(np.int32)
    _, _, aux = nnx.jit(lambda m, t: m.forward(t, head=False))(model, tok)
    load = np.asarray(aux["router_stats"]["load"])  # [L_moe, E]
    tokens = tok.size
    for i in range(n_moe):
        assert load[i, forced[i]] == tokens, (i, load[i])
        others = np.delete(forced, i)
        assert np.all(load[i, others] < tokens), (i, load[i])  # no other layer's row reached layer i


def test_collapse_warning_fires_on_a_constructed_collapse():
    """A real step whose router bias sends every token to one expert logs collapsed = 1 and
    hot_share = 1 for that layer; the watch warns once when the collapse has lasted
    logging.collapse_steps steps (two windows of 10), names the layer, stays quiet while it
    lasts, and says when the layer is balanced again. The same step with no bias logs no
    collapse (top-4 of 16 experts at init: no expert near half the tokens). The step is
    test_drop_rate_is_over_every_routed_pair's expert-parallel one with room for every pair
    (ROOMY): the collapse metrics are the routing's (the load of every token's top-k), the
    same on any mesh and dispatch, and sharing that step saves this test's compile."""
    from train.balance_watch import CollapseWatch
    from train.metrics import progress_line

    cfg, setup, state, step = compiled_step(tuple(ROOMY))
    batch = batch_of(np.ones((8, 32), np.int32))
    out = []
    with jax.set_mesh(setup.mesh):
        for hot in (None, 3):
            bias = np.zeros(state["rest"]["router_bias"].shape, np.float32)
            if hot is not None:
                bias[0, hot] = 10.0  # above every sigmoid score: expert 3 is in every token's top-k
            rest = {**state["rest"], "router_bias": jax.device_put(bias, state["rest"]["router_bias"].sharding)}
            _, m = step({**state, "rest": rest}, {k: jax.device_put(v, setup.rows) for k, v in batch.items()})
            out.append(jax.device_get(m))
    balanced, collapsed = out
    assert float(collapsed["hot_share"][0]) == 1.0 and float(collapsed["collapsed"][0]) == 1.0
    assert float(collapsed["max_violation"][0]) == cfg.model.moe.num_experts / cfg.model.moe.top_k - 1
    assert float(balanced["collapsed"][0]) == 0.0 and float(balanced["hot_share"][0]) < 0.5

    watch = CollapseWatch(20, [0])
    assert watch.update(10, 10, collapsed) == []  # 10 collapsed steps: not yet 20
    lines = watch.update(20, 10, collapsed)
    assert len(lines) == 1 and lines[0].startswith("warning: MoE layer 0 (layer 0) has collapsed"), lines
    assert "last 20" in lines[0] and "100% of them" in lines[0]
    assert watch.update(30, 10, collapsed) == []  # once
    assert watch.update(40, 10, balanced) == ["MoE layer 0 (layer 0) is balanced again at step 40 "
                                              f"(max_violation {float(balanced['max_violation'][0]):.2f})"]
    quiet = CollapseWatch(20, [0])
    assert all(quiet.update(s, 10, balanced) == [] for s in (10, 20, 30))
    # the progress line names the worst layer's balance
    line = progress_line(20, 300, {"loss": 1.0, **collapsed})
    worst = cfg.model.moe.num_experts / cfg.model.moe.top_k - 1  # every token on one expert: 16 / 4 - 1
    assert f"balance {worst:.2f} (MoE layer 0)" in line, line
