"""Context parallelism (mesh.context) on fake CPU devices against one device: the model's loss,
every gradient and the MoE routing statistics (each token counted once), for rows holding one
long document and rows whose document boundaries fall inside shards and exactly on shard edges.
Plus the blocked attention against the dense reference, and the config errors."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import rel_err

from k3jax.config import ConfigError, load_config
from k3jax.ops.chunked_loss import token_losses
from k3jax.ops.context_attn import blocked_attention
from k3jax.ops.softmax_attn import naive_causal_softmax_attention
from k3jax.segments import not_padding, positions_from_segments, segment_starts
from train.setup import prepare
from train.state import init_train_state

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "k3-tiny.yaml")
T = 64  # context=4: shards of 16 tokens (one chunk); context=2: 32
COMMON = ["model.layer_pattern=kda+mla", "model.attn_res_block_size=2", "model.d_model=64",
          "model.moe.latent_dim=32", "model.moe.ep_capacity_factor=16", "model.moe.qb_estimator=histogram",
          f"data.seq_len={T}", "train.batch_size=4"]
# shard edges: 16, 32, 48 (context=4) and 32 (context=2)
ROWS = [
    [1] * 64,                                          # one document over every shard
    [1] * 16 + [2] * 10 + [3] * 6 + [4] * 20 + [0] * 12,  # starts at 16 and 32 (edges), 26 and 52 (inside)
    [9] * 40 + [2] * 24,                               # a document over three shards, a start inside one
    [7] * 32 + [3] * 31 + [5],                         # a start at 32; a one-token document ends the row
]


def _batch(vocab):
    rng = np.random.default_rng(0)
    seg = np.asarray(ROWS, np.int32)
    tokens = rng.integers(0, vocab, seg.shape).astype(np.int32)
    targets = rng.integers(0, vocab, seg.shape).astype(np.int32)
    nxt = np.concatenate([segment_starts(seg)[:, 1:], np.ones((4, 1), bool)], axis=1)
    mask = (not_padding(seg) & ~nxt).astype(np.float32)
    return {"tokens": tokens, "targets": targets, "segment_ids": seg, "positions": positions_from_segments(seg),
            "loss_mask": mask}


@functools.cache
def _initial_weights():
    """The parameters and router bias, drawn once on one device (host copies), that every mesh
    below starts from, placed by its own shardings: drawing them again on each mesh compiled an
    init program per mesh, and that a mesh draws the same values is test_sharding.py's claim
    (its train steps start from the mesh's own init), not this file's."""
    cfg = load_config(TINY, COMMON + ["mesh.num_devices=1"])
    setup = prepare(cfg)
    with jax.set_mesh(setup.mesh):
        state = init_train_state(cfg, setup.spec, setup.tx, shardings=setup.shardings)
    return jax.device_get((state["params"], state["rest"]))


def _loss_grads(mesh_overrides):
    cfg = load_config(TINY, COMMON + mesh_overrides)
    setup = prepare(cfg)
    batch = _batch(cfg.model.vocab_size)
    params, rest = _initial_weights()

    def f(params, rest, b):
        model = setup.spec.model_from(params, rest)
        logits, aux = model(b["tokens"], segment_ids=b["segment_ids"], positions=b["positions"],
                            token_mask=not_padding(b["segment_ids"]))
        ce, _, _, n = token_losses(logits, b["targets"], b["loss_mask"], 0.0)
        return ce / n, aux["router_stats"]

    with jax.set_mesh(setup.mesh):
        params = jax.device_put(params, setup.shardings["params"])
        rest = jax.device_put(rest, setup.shardings["rest"])
        b = {k: jax.device_put(v, setup.rows) for k, v in batch.items()}
        (loss, stats), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params, rest, b)
    return float(loss), jax.device_get(grads), jax.device_get(stats)


@pytest.fixture(scope="module")
def one_device():
    return _loss_grads(["mesh.num_devices=1"])


@pytest.mark.parametrize("mesh", [
    ["mesh.data=1", "mesh.expert=2", "mesh.context=4"],
    ["mesh.data=2", "mesh.context=2", "mesh.num_devices=4"],
], ids=["expert2xcontext4", "data2xcontext2"])
def test_context_parallel_equals_one_device(one_device, mesh):
    """Loss to 1e-5 relative, each gradient to 1e-4 relative (fp32 sums in another order;
    measured ~1e-6), routing statistics (load, token count, QB histogram) exactly."""
    loss1, grads1, stats1 = one_device
    loss, grads, stats = _loss_grads(mesh)
    assert loss == pytest.approx(loss1, rel=1e-5)
    flat1 = jax.tree_util.tree_flatten_with_path(grads1)[0]
    for (path, a), b in zip(flat1, jax.tree.leaves(grads)):
        assert rel_err(b, a) < 1e-4, (jax.tree_util.keystr(path), rel_err(b, a))
    valid = float(not_padding(np.asarray(ROWS)).sum())
    assert np.all(np.asarray(stats["tokens"]) == valid)  # every valid token once, padding never
    for key in ("load", "tokens", "hist"):
        np.testing.assert_array_equal(stats[key], stats1[key])


def test_blocked_attention_equals_dense_reference():
    """A shard's queries (tokens 16..32 of 40, GQA 4:2, Dv != D) over all keys, blocks of 8x16
    with padding, against the dense masked softmax of the whole row: outputs and gradients."""
    B, H, Hkv, D, Dv, n = 2, 4, 2, 8, 6, 40
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, n, H, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, n, Hkv, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, n, Hkv, Dv)), jnp.float32)
    seg = jnp.asarray([[1] * 13 + [2] * 20 + [0] * 7, [4] * 40], jnp.int32)
    lo, hi = 16, 33
    w = jnp.asarray(rng.standard_normal((B, hi - lo, H, Dv)), jnp.float32)

    def blocked(q, k, v):
        o = blocked_attention(q[:, lo:hi], k, v, jnp.arange(lo, hi), jnp.arange(n), seg[:, lo:hi], seg,
                              scale=0.3, block_q=8, block_k=16)
        return jnp.sum(o * w), o

    def dense(q, k, v):
        o = naive_causal_softmax_attention(q, k, v, scale=0.3, segment_ids=seg)[:, lo:hi]
        return jnp.sum(o * w), o

    (_, o1), g1 = jax.value_and_grad(blocked, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    (_, o2), g2 = jax.value_and_grad(dense, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert rel_err(o1, o2) < 1e-5
    for a, b in zip(g1, g2):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("overrides, match", [
    (["data.seq_len=60", "mesh.context=8"], "mesh.context=8 does not divide data.seq_len=60"),
    (["data.seq_len=64", "mesh.context=8"], "8 tokens, not a multiple of model.kda.chunk_size=16"),
])
def test_context_config_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(TINY, overrides)
    assert "mesh.context" in str(e.value)


def test_context_parallel_prefill_equals_one_device():
    """Prefill of two packed 32-token prompts (a document starting on the shard edge 32 in row
    1) over context=4, on top of a cache that already holds 8 tokens (a continued document in
    row 0, a fresh one in row 1), then one decode step: logits and the whole cache (KDA states,
    conv windows, MLA latents) equal the one-device run."""
    from flax import nnx

    from k3jax import decode
    from k3jax.model import create_model
    from k3jax.sharding import make_mesh

    cfg = load_config(TINY, COMMON + ["mesh.data=1", "mesh.context=4", "mesh.num_devices=4"])
    model = create_model(cfg.model, 0)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(1)
    first = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (2, 8)), jnp.int32)
    prompt = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (2, T)), jnp.int32)
    seg0 = jnp.asarray([[1] * 8, [1] * 8], jnp.int32)
    seg = jnp.asarray([[1] * 20 + [2] * 44, [4] * 32 + [5] * 32], jnp.int32)

    @jax.jit
    def run(state):
        m = nnx.merge(graphdef, state)
        cache = decode.init_cache(m, 2, 8 + T + 1)
        _, cache = decode.prefill(m, first, cache, segment_ids=seg0)
        logits, cache = decode.prefill(m, prompt, cache, segment_ids=seg)
        step, cache = decode.decode_step(m, prompt[:, -1], cache)
        return logits, step, cache

    want = jax.device_get(run(state))
    with jax.set_mesh(make_mesh(cfg.mesh)):
        got = jax.device_get(run(state))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if np.issubdtype(np.asarray(b).dtype, np.floating):
            assert rel_err(a, b) < 1e-5, rel_err(a, b)
        else:
            np.testing.assert_array_equal(a, b)


def test_plan_counts_context_gathers_and_refuses_a_bad_split():
    """k3jax-plan with mesh.context=4 on k3-tiny (no compile): the bytes each device receives
    per layer, counted by hand from the config (4 KDA heads of 32, conv 4; MLA latent 64 + rope
    16; fp32 compute; 2 rounds without remat), and a sequence the shards cannot split."""
    from train.plan.cli import main, plan

    cfg = load_config(TINY, ["mesh.data=2", "mesh.context=4"])
    r = plan(cfg, 8, batch=4, seq=4096, activations=False)
    B_local = 2
    kda = 2 * B_local * (4 * 32 * (32 + 32) * 4 * 3 + 3 * 3 * 4 * 32 * 4)
    mla = 2 * B_local * 4096 * (64 + 16) * 4 * 3 / 4
    got = r["context_gather_bytes_per_layer"]["per_device"]
    assert got == {"delta_rule_layer": kda, "mla_layer": mla}
    assert r["context_gather_bytes_per_layer"]["per_step_per_device"] == 6 * kda + 2 * mla  # 2*(kda,kda,kda,mla)
    assert r["tokens_per_device_per_micro_batch"] == 2 * 1024
    with pytest.raises(ConfigError, match="mesh.context"):
        plan(cfg, 8, batch=4, seq=4096 + 16 * 3, activations=False)
    # the CLI judges mesh.context against --seq, not the config's data.seq_len (128 / 16 < chunk)
    assert main(["--config", TINY, "--devices", "16", "--mesh", "data=1,context=16", "--seq", "4096", "--batch", "1",
                 "--state-only", "--json"]) == 0


def test_other_mixers_context_parallel_equal_one_device():
    """The layers the model test does not run (gated DeltaNet's per-head gate, DeltaNet without
    decay, linear attention without the delta rule, softmax attention with GQA, MLA's QK-Clip
    max logits) on context=4
    against no mesh: outputs and gradients (inputs and parameters), one packed row with starts
    inside a shard and on the edge 32."""
    from flax import nnx
    from test_segments import D, _make

    from k3jax.segments import positions_from_segments as pos_of
    from k3jax.sharding import make_mesh

    seg = jnp.asarray([[1] * 20 + [2] * 12 + [3] * 32, [5] * 64], jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 64, D))
    layers = {kind: nnx.split(_make(kind)) for kind in ("gated_deltanet", "deltanet", "linear", "softmax", "mla")}
    states = {k: st for k, (_, st) in layers.items()}
    w = jnp.sin(jnp.arange(2 * 64 * D, dtype=jnp.float32).reshape(2, 64, D))

    @jax.jit
    def loss_grads(states, x):
        def f(states, x):
            total, max_logits = 0.0, None
            for kind, (graphdef, _) in layers.items():
                extra = {"max_logits": True} if kind == "mla" else {}  # QK-Clip's statistic, too
                out = nnx.merge(graphdef, states[kind])(x, segment_ids=seg, positions=pos_of(seg), **extra)
                total = total + jnp.sum(out[0] * w)
                max_logits = out[2] if kind == "mla" else max_logits
            return total, max_logits
        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(states, x)

    want = loss_grads(states, x)
    with jax.set_mesh(make_mesh(load_config(TINY, ["mesh.data=1", "mesh.context=4", "mesh.num_devices=4"]).mesh)):
        got = loss_grads(states, x)
    # 3e-5: gated DeltaNet's dt_bias gradient (two numbers) sums every token's decay gradient
    # with cancellation; fp32 summation order alone moves it by 2e-5 between the sharded and the
    # one-device run (and by 6e-6 between the norms' and conv's own VJPs and autodiff's on one
    # device). Every other leaf agrees within 2e-6.
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_err(a, b) < 3e-5, rel_err(a, b)
