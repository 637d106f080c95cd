"""QK-Clip (MuonClip) for gated MLA: the max-logit statistic against float64 loops, the clip
against its formula written out in numpy (and the logits it leaves), the statistic's layer
order against the parameters it clips, the train step on one device and on a mesh, and
tau = 0 changing nothing."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import ConfigError, load_config
from k3jax.ops.softmax_attn import causal_max_logits
from train.cli import _scalar_metrics
from train.metrics import RunLogger
from train.qk_clip import mla_layer_slots, qk_clip
from train.setup import prepare
from k3jax.model_spec import model_spec
from train.state import init_train_state
from reference import doc_positions, mla_logits_np

SMALL = ["model.vocab_size=64", "model.d_model=32", "model.layer_pattern=2*(mla,softmax,mla)+mla",
         "model.attn_res_block_size=0", "model.moe_every=0", "model.ffn_hidden=32", "model.init_std=0.3",
         "model.mla.num_heads=4", "model.mla.q_lora_rank=16", "model.mla.kv_lora_rank=16",
         "model.mla.qk_nope_head_dim=8", "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8",
         "model.attention.num_heads=2", "model.attention.head_dim=8",
         "data.seq_len=16", "train.batch_size=8", "train.micro_batches=2", "train.steps=10"]
# the MLA layers in the order of aux["mla_max_logits"], as (stage, slot in the unit, repeat),
# written out for this pattern: stage 0 = 2 x (mla, softmax, mla) (layers 0-5), stage 1 = (mla)
SLOTS = [(0, 0, 0), (0, 2, 0), (0, 0, 1), (0, 2, 1), (1, 0, 0)]
# the train step's model (one stage, cheaper to compile): 2 x (mla, mla, softmax)
STEP = SMALL + ["model.layer_pattern=2*(mla,mla,softmax)"]
STEP_SLOTS = [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]
N, R = 8, 4  # qk_nope_head_dim, qk_rope_head_dim


def attn(params, slot):
    """One MLA layer's parameters (repeat r of unit slot j of stage s) as numpy arrays."""
    s, j, r = slot
    return jax.tree.map(lambda a: np.asarray(a)[r], params["stages"][s]["units"]["layers"][j]["self_attn"])


# ---------------------------------------------------------------- the statistic


def max_logits_loop(q, k, scale, seg):
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, T, H, _ = q.shape
    rep = H // k.shape[2]
    out = np.full(H, -np.inf)
    for b in range(B):
        for t in range(T):
            for s in range(t + 1):
                if seg[b, s] == seg[b, t]:
                    for h in range(H):
                        out[h] = max(out[h], scale * q[b, t, h] @ k[b, s, h // rep])
    return out


@pytest.mark.parametrize("block", [64, 8, 5])  # one score matrix; blocks with padding (37 = 4x8+5, 7x5+2)
def test_causal_max_logits_against_a_loop(block):
    rng = np.random.default_rng(0)
    B, T, H, Hkv, D = 2, 37, 4, 2, 8
    q, k = rng.standard_normal((B, T, H, D)), rng.standard_normal((B, T, Hkv, D))
    k[0, 30:, 0] *= 30.0  # large logits in the future of most queries and in another document
    seg = np.array([[1] * 20 + [2] * 17, [3] * 5 + [4] * 30 + [0] * 2], np.int32)
    f = jax.jit(lambda q, k, s: causal_max_logits(q, k, scale=0.3, segment_ids=s, block_size=block))
    got = f(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(seg))
    np.testing.assert_allclose(got, max_logits_loop(q, k, 0.3, seg), rtol=1e-5)
    got = f(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(seg))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, max_logits_loop(q, k, 0.3, seg), rtol=2e-2)
    # no gradient flows through the statistic
    g = jax.grad(lambda q: causal_max_logits(q, jnp.asarray(k, jnp.float32), block_size=block).sum())(
        jnp.asarray(q, jnp.float32))
    assert not np.any(np.asarray(g))


# ---------------------------------------------------------------- the clip


def random_params(model_cfg, seed=0):
    """Every parameter of the model drawn at random: norm weights in [0.5, 1.5], the rest N(0, 0.3^2)."""
    rng = np.random.default_rng(seed)
    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(model_spec(model_cfg).params))

    def draw(path, a):
        return rng.uniform(0.5, 1.5, a.shape) if path[-1] == "weight" else 0.3 * rng.standard_normal(a.shape)

    return nnx.traversals.unflatten_mapping({p: jnp.asarray(draw(p, a), a.dtype) for p, a in flat.items()})


def clip_np(w_q, w_kv, gamma):
    """The rule for one layer, per head h: q nope columns and k nope columns times sqrt(gamma_h),
    q rope columns times gamma_h, values unchanged. w_q [in,H,N+R], w_kv [R_kv,H,N+v]."""
    w_q, w_kv = np.array(w_q, np.float64), np.array(w_kv, np.float64)
    for h, g in enumerate(gamma):
        w_q[:, h, :N] *= np.sqrt(g)
        w_q[:, h, N:] *= g
        w_kv[:, h, :N] *= np.sqrt(g)
    return w_q, w_kv


@pytest.mark.parametrize("variant", [[], ["model.mla.q_lora_rank=0", "model.mla.use_rope=true"]],
                         ids=["q_lora", "q_proj+rope"])
def test_clip_hand_computed(variant):
    """Max logits of random layer inputs in float64; tau between layer 0's heads, so some heads
    of some layers exceed it and the others do not. After the clip: every weight equals the
    rule written out in numpy (bitwise unchanged outside the clipped heads' q/k columns), and
    the logits recomputed with the clipped weights peak at exactly tau in a clipped head and
    are unchanged (<= tau) elsewhere. A tau above every maximum changes nothing."""
    cfg = load_config(None, SMALL + variant)
    mc = cfg.model
    assert mla_layer_slots(mc) == SLOTS
    q_name = "q_b_proj" if mc.mla.q_lora_rank else "q_proj"
    params = random_params(mc)
    rng = np.random.default_rng(1)
    seg = np.array([[1] * 6 + [2] * 4, [3] * 10], np.int32)
    pos = doc_positions(seg)
    xs = [rng.standard_normal((2, 10, mc.d_model)) for _ in SLOTS]

    def logits(p):
        return [mla_logits_np(attn(p, slot), mc.mla, x, seg, pos, mc.rms_norm_eps) for slot, x in zip(SLOTS, xs)]

    before = logits(params)
    S = np.stack([s.max(axis=(0, 2, 3)) for s in before])  # [L_mla, H]
    tau = float(np.sort(S[0])[1:3].mean())
    gamma = np.where(S > tau, tau / S, 1.0)
    assert 0 < (gamma < 1).sum() < gamma.size and gamma.min() < 0.7

    clipped, count = qk_clip(params, jnp.asarray(S, jnp.float32), mc, tau)
    np.testing.assert_array_equal(count, (S > tau).sum(-1))
    for l, slot in enumerate(SLOTS):
        a, b = attn(params, slot), attn(clipped, slot)
        want_q, want_kv = clip_np(a[q_name]["kernel"], a["kv_b_proj"]["kernel"], gamma[l])
        np.testing.assert_allclose(b[q_name]["kernel"], want_q, rtol=1e-6)
        np.testing.assert_allclose(b["kv_b_proj"]["kernel"], want_kv, rtol=1e-6)
        keep = gamma[l] == 1.0
        np.testing.assert_array_equal(b[q_name]["kernel"][:, keep], a[q_name]["kernel"][:, keep])
        np.testing.assert_array_equal(b["kv_b_proj"]["kernel"][..., N:], a["kv_b_proj"]["kernel"][..., N:])
    # everything else is untouched, bit for bit (kv_a_proj_with_mqa: the shared rope key)
    flat_a, flat_b = nnx.traversals.flatten_mapping(params), nnx.traversals.flatten_mapping(clipped)
    assert flat_a.keys() == flat_b.keys()
    scaled = {("stages", s, "units", "layers", j, "self_attn", name, "kernel")
              for s, j, _ in SLOTS for name in (q_name, "kv_b_proj")}
    others = [p for p in flat_a if p not in scaled]
    assert len(others) == len(flat_a) - 6 and ("embed_tokens",) in others
    assert ("stages", 1, "units", "layers", 0, "self_attn", "kv_a_proj_with_mqa", "kernel") in others
    for p in others:
        np.testing.assert_array_equal(flat_b[p], flat_a[p])
    # the logits the clipped weights give: exactly tau at a clipped head's max, unchanged elsewhere
    after = logits(clipped)
    S_after = np.stack([s.max(axis=(0, 2, 3)) for s in after])
    assert np.all(S_after <= tau * (1 + 1e-5))
    np.testing.assert_allclose(S_after[S > tau], tau, rtol=1e-5)
    for l in range(len(SLOTS)):
        for h in np.flatnonzero(S[l] <= tau):
            np.testing.assert_allclose(after[l][:, h], before[l][:, h], rtol=1e-5)
        for h in np.flatnonzero(S[l] > tau):  # every logit of the head shrinks by gamma, not just the max
            finite = np.isfinite(before[l][:, h])
            np.testing.assert_allclose(after[l][:, h][finite], gamma[l, h] * before[l][:, h][finite],
                                       rtol=1e-5, atol=1e-6)
    same, none = qk_clip(params, jnp.asarray(S, jnp.float32), mc, float(S.max()) * 1.01)
    assert not np.any(np.asarray(none))
    for x, y in zip(jax.tree.leaves(same), jax.tree.leaves(params)):
        np.testing.assert_array_equal(x, y)


def test_negative_tau_is_refused():
    with pytest.raises(ConfigError, match="qk_clip_tau"):
        load_config(None, ["optimizer.qk_clip_tau=-1"])
    assert load_config(None, []).optimizer.qk_clip_tau == 0.0


# ---------------------------------------------------------------- in the model and the step


def batch(vocab, seed=0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(1, vocab, (8, 17)).astype(np.int32)
    seg = np.repeat(np.array([[1] * 9 + [2] * 7]), 8, 0).astype(np.int32)
    seg[3, 12:] = 0  # padding
    mask = (seg > 0).astype(np.float32)
    mask[:, 8] = 0.0
    return {"tokens": tok[:, :-1], "targets": tok[:, 1:], "segment_ids": seg, "positions": doc_positions(seg),
            "loss_mask": mask}


def forward(cfg):
    """jitted (params, rest, batch) -> (logits, aux["mla_max_logits"]) of cfg's model."""
    spec = model_spec(cfg.model)

    @jax.jit
    def fwd(params, rest, b):
        logits, aux = spec.model_from(params, rest)(b["tokens"], segment_ids=b["segment_ids"],
                                                    positions=b["positions"], mla_max_logits=True)
        return logits, aux["mla_max_logits"]

    return fwd


def test_max_logit_rows_follow_the_layer_order_the_clip_uses():
    """Row i of aux["mla_max_logits"] belongs to the parameters at SLOTS[i] (two stages, with
    Block AttnRes): doubling that layer's query kernel (NoPE: every logit of the layer
    doubles) doubles row i exactly and leaves the rows of the layers before it alone. Without
    the switch there is no statistic and the logits are the same."""
    cfg = load_config(None, SMALL + ["model.attn_res_block_size=3"])
    assert mla_layer_slots(cfg.model) == SLOTS
    fwd = forward(cfg)
    spec = model_spec(cfg.model)
    params, rest = random_params(cfg.model), {}
    b = batch(cfg.model.vocab_size)
    logits, S = fwd(params, rest, b)
    assert S.shape == (len(SLOTS), cfg.model.mla.num_heads)
    for i, (s, j, r) in enumerate(SLOTS):
        w = params["stages"][s]["units"]["layers"][j]["self_attn"]["q_b_proj"]["kernel"]
        doubled = jax.tree.map(lambda x: x, params)  # a copy of the dict structure
        doubled["stages"][s]["units"]["layers"][j]["self_attn"]["q_b_proj"]["kernel"] = w.at[r].multiply(2.0)
        _, S2 = fwd(doubled, rest, b)
        np.testing.assert_allclose(S2[i], 2 * S[i], rtol=1e-5)
        np.testing.assert_array_equal(S2[:i], S[:i])
    off_logits, off = spec.model_from(params, rest)(b["tokens"], segment_ids=b["segment_ids"],
                                                    positions=b["positions"])
    assert off["mla_max_logits"] is None
    # the statistic's own reductions change XLA:CPU's fusion of the logits: 1.1e-6 apart on AVX-512
    np.testing.assert_allclose(off_logits, logits, rtol=1e-5, atol=1e-5)


def run_step(overrides, b, state=None):
    """One train step of the STEP model, built as the CLI builds it (prepare: mesh, shardings),
    from `state` (placed by the run's shardings) or a fresh one."""
    cfg = load_config(None, STEP + overrides)
    setup = prepare(cfg)
    with jax.set_mesh(setup.mesh):
        if state is None:
            state = init_train_state(cfg, setup.spec, setup.tx, shardings=setup.shardings)
        else:
            state = jax.device_put(state, setup.shardings)
        new, m = setup.train_step(cfg, donate=False)(state, {k: jax.device_put(v, setup.rows) for k, v in b.items()})
    return jax.device_get(state), jax.device_get(new), jax.device_get(m)


@pytest.fixture(scope="module")
def one_device_steps():
    """The same step with QK-Clip off and on (tau between the heads' max logits), one device."""
    cfg = load_config(None, STEP)
    assert mla_layer_slots(cfg.model) == STEP_SLOTS
    b = batch(cfg.model.vocab_size, seed=3)
    state, off, m_off = run_step(["mesh.num_devices=1"], b)
    # the step's statistic: the pre-update weights over the whole batch (= the max over its micro-batches)
    _, S = forward(cfg)(state["params"], state["rest"], b)
    S = np.asarray(S, np.float64)
    tau = float(np.median(S))
    _, on, m_on = run_step(["mesh.num_devices=1", f"optimizer.qk_clip_tau={tau!r}"], b)
    return b, state, S, tau, (off, m_off), (on, m_on)


def test_step_clips_the_updated_weights_and_nothing_else(one_device_steps):
    """With tau: the step's weights are the tau = 0 step's weights with the clip rule applied
    (numpy) at the max logits of the pre-update weights over both micro-batches; everything
    else (other weights, the optimizer state, loss, gradient norm) is bit for bit the tau = 0
    step's. With tau = 0 no statistic is computed or logged."""
    _, _, S, tau, (off, m_off), (on, m_on) = one_device_steps
    gamma = np.where(S > tau, tau / S, 1.0)
    assert 0 < (gamma < 1).sum() < gamma.size
    assert "mla_max_logit" not in m_off and "qk_clipped_heads" not in m_off
    np.testing.assert_allclose(m_on["mla_max_logit"], S.max(-1), rtol=1e-5)
    np.testing.assert_array_equal(m_on["qk_clipped_heads"], (S > tau).sum(-1))
    for k in ("loss", "grad_norm", "accuracy"):
        assert m_on[k] == m_off[k], k
    for x, y in zip(jax.tree.leaves(on["opt_state"]), jax.tree.leaves(off["opt_state"])):
        np.testing.assert_array_equal(x, y)
    for l, slot in enumerate(STEP_SLOTS):
        a, b = attn(off["params"], slot), attn(on["params"], slot)
        want_q, want_kv = clip_np(a["q_b_proj"]["kernel"], a["kv_b_proj"]["kernel"], gamma[l])
        # S here and in the step are sums in another order: gamma agrees to ~1e-6
        np.testing.assert_allclose(b["q_b_proj"]["kernel"], want_q, rtol=1e-5)
        np.testing.assert_allclose(b["kv_b_proj"]["kernel"], want_kv, rtol=1e-5)
    flat_off, flat_on = nnx.traversals.flatten_mapping(off["params"]), nnx.traversals.flatten_mapping(on["params"])
    for p in flat_off:
        if p[-2:] not in (("q_b_proj", "kernel"), ("kv_b_proj", "kernel")):
            np.testing.assert_array_equal(flat_on[p], flat_off[p])


def test_sharded_step_clips_like_one_device(one_device_steps):
    """data=2 x fsdp=2 x tensor=2 (heads split over tensor, the LoRA ranks over fsdp): the same
    clipped weights and statistics as one device."""
    b, state, _, tau, _, (on, m_on) = one_device_steps
    _, mesh_on, m_mesh = run_step(["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", f"optimizer.qk_clip_tau={tau!r}"], b,
                                  state)
    np.testing.assert_allclose(m_mesh["mla_max_logit"], m_on["mla_max_logit"], rtol=1e-5)
    np.testing.assert_array_equal(m_mesh["qk_clipped_heads"], m_on["qk_clipped_heads"])
    # sums in another order on the mesh, through one optimizer step (1.6e-4 on AVX-512 XLA:CPU); a
    # wrong clip moves a head's weights by its factor gamma, far more
    for x, y in zip(jax.tree.leaves(mesh_on["params"]), jax.tree.leaves(on["params"])):
        np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-5)


def test_metrics_lines_carry_the_per_layer_max_logit(tmp_path):
    """metrics.jsonl: the per-layer values and the `_max` the CLI adds for per-layer arrays."""
    from k3jax.config.schema import LoggingConfig
    log = RunLogger(tmp_path, LoggingConfig(tensorboard=False, progress=False), total_steps=1, start_step=0)
    log.scalars(1, _scalar_metrics({"mla_max_logit": np.array([3.0, 7.5]), "qk_clipped_heads": np.array([0.0, 2.0])}))
    log.close()
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["mla_max_logit"] == [3.0, 7.5] and line["mla_max_logit_max"] == 7.5
    assert line["qk_clipped_heads"] == [0.0, 2.0]
