"""MoE step metrics and routing corner cases: the expert drop rate counts what the exchange
drops against what it was given, and balance=none routes every token to every expert."""

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


def one_step(overrides, *segment_ids):
    """One step's metrics from the same initial state, for each segment_ids [8,32] given
    (one compile: the batches differ in values only)."""
    cfg = load_config(TINY, SMALL + overrides)
    setup = prepare(cfg)
    rng = np.random.default_rng(0)
    tok = rng.integers(1, 256, (8, 33)).astype(np.int32)
    out = []
    with jax.set_mesh(setup.mesh):
        state = init_train_state(cfg, setup.spec, setup.tx, shardings=setup.shardings)
        step = setup.train_step(cfg, donate=False)
        for seg in segment_ids:
            batch = {"tokens": tok[:, :-1], "targets": tok[:, 1:], "segment_ids": seg,
                     "positions": np.tile(np.arange(32, dtype=np.int32), (8, 1)),
                     "loss_mask": (seg > 0).astype(np.float32)}
            _, metrics = step(state, {k: jax.device_put(v, setup.rows) for k, v in batch.items()})
            out.append(jax.device_get(metrics))
    return out if len(out) > 1 else out[0]


def test_drop_rate_is_over_every_routed_pair():
    """Padding tokens are routed and exchanged like any other (the exchange cannot tell), so
    the rate divides the dropped pairs by all routed pairs. Same tokens, three quarters marked
    as padding: the exchange drops (almost) the same pairs, so the rate must not change (the
    old denominator, the valid tokens' load, made it 4x larger, up to impossible rates > 1)."""
    ep = ["mesh.data=1", "mesh.expert=4", "mesh.num_devices=4", "model.moe.ep_dispatch=capacity",
          "model.moe.ep_capacity_factor=0.3"]
    full = np.ones((8, 32), np.int32)
    padded = full.copy()
    padded[:, 8:] = 0  # three quarters padding
    a, b = one_step(ep, full, padded)
    assert np.all(a["expert_drop_rate"] > 0.3) and np.all(a["expert_drop_rate"] <= 1.0)  # cf 0.3: most pairs drop
    # padding is also a document boundary, so the mixers, and with them a few routing choices,
    # change; which pairs an over-full buffer drops follows the routing (a dropped row carries
    # 1 to 4 of a token's pairs): the rates agree to 1 %, where the old denominator gave 4x
    np.testing.assert_allclose(b["expert_drop_rate"], a["expert_drop_rate"], rtol=1e-2)
    nothing = one_step(["mesh.data=1", "mesh.expert=4", "mesh.num_devices=4", "model.moe.ep_dispatch=capacity",
                        "model.moe.ep_capacity_factor=4.0"], full)  # room for every pair
    assert np.all(nothing["expert_drop_rate"] == 0)


@pytest.mark.parametrize("estimator", ["exact", "histogram"])
def test_no_balancing_with_every_expert_chosen(estimator):
    """top_k = num_experts with balance=none is a valid config (a dense MoE); the QB
    estimators' statistics need k < E and are not collected then. Every token reaches every
    expert, so the load is perfectly even."""
    m = one_step(["mesh.num_devices=1", "model.moe.balance=none", "model.moe.top_k=16",
                  f"model.moe.qb_estimator={estimator}"], np.ones((8, 32), np.int32))
    assert np.isfinite(m["loss"]) and np.all(m["max_violation"] == 0)
