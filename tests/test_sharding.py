"""Meshes, sharding rules and expert parallelism on 8 fake CPU devices (see conftest.py)."""

import glob
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import ConfigError, MeshConfig, load_config
from k3jax.layers.moe import routed_experts_dropless
from k3jax.layout import plan_stages
from k3jax.sharding import RULES, make_mesh, param_specs
from k3jax.layers.expert_parallel import routed_experts_sharded
from train.cli import train
from train.setup import prepare
from k3jax.model_spec import model_spec
from train.state import init_train_state
from reference import rel_err

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(glob.glob(str(ROOT / "configs" / "*.yaml")) + glob.glob(str(ROOT / "configs" / "*" / "*.yaml")))
TINY = str(ROOT / "configs" / "k3-tiny.yaml")
SMALL = ["model.layer_pattern=kda+mla", "model.attn_res_block_size=2", "model.d_model=64", "model.moe.latent_dim=32",
         "data.seq_len=32", "train.batch_size=8"]
MESHES = [dict(data=2, fsdp=1, expert=4, tensor=1), dict(data=1, fsdp=4, expert=1, tensor=2),
          dict(data=8, fsdp=1, expert=1, tensor=1), dict(data=1, fsdp=2, expert=2, tensor=2)]
mesh_id = lambda m: "x".join(f"{k}{v}" for k, v in m.items() if v > 1)  # noqa: E731
# the train step on meshes: (mesh, devices per node): nodes > 1; tensor > 1 (and FSDP); both
STEP_MESHES = {"nodes2-expert4": (MESHES[0], 2), "fsdp2-expert2-tensor2": (MESHES[3], 8),
               "nodes2-expert4-tensor2": (dict(data=1, fsdp=1, expert=4, tensor=2), 4)}


def test_eight_devices_available():
    assert jax.device_count() == 8, "tests/conftest.py must force 8 host devices"


def test_every_parameter_has_an_explicit_partition_spec():
    missing = []
    for path in CONFIGS:
        spec = model_spec(load_config(path).model)
        for p, var in nnx.to_flat_state(spec.params):
            axes = var.get_metadata().get("axes")
            name = f"{os.path.relpath(path, ROOT)}: {'/'.join(map(str, p))}"
            if axes is None or len(axes) > len(var.get_value().shape):
                missing.append(name)
            elif any(a is not None and a not in RULES for a in axes):
                missing.append(f"{name} (axis without a rule: {axes})")
        param_specs(spec.params)  # raises on a parameter without axes
    assert not missing, "parameters without a PartitionSpec:\n" + "\n".join(missing)


def test_mesh_sizes_and_errors():
    mesh = make_mesh(MeshConfig(data=-1, fsdp=2, expert=2, tensor=1))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 2, "context": 1, "tensor": 1}
    with pytest.raises(ConfigError, match="does not divide the 8 devices"):
        make_mesh(MeshConfig(data=-1, fsdp=3))
    with pytest.raises(ConfigError, match="has 4 devices but 8"):
        make_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=1))
    assert make_mesh(MeshConfig(num_devices=4)).size == 4


def test_k3_expert_weights_shard_over_every_non_tensor_axis():
    spec = model_spec(load_config(ROOT / "configs" / "k3.yaml").model)
    flat = {"/".join(map(str, p)): s for p, s in nnx.traversals.flatten_mapping(param_specs(spec.params)).items()}
    w1 = next(v for k, v in flat.items() if k.endswith("experts/w1"))
    assert tuple(w1) == (None, "expert", ("fsdp", "context"), "tensor")
    assert tuple(flat["lm_head/kernel"]) == (("fsdp", "expert", "context"), "tensor")
    router = next(v for k, v in flat.items() if k.endswith("block_sparse_moe/gate/weight"))
    assert tuple(router) == (None, ("fsdp", "expert", "context"), None)  # a mesh axis is used once: the first dim wins


# ------------------------------------------------------------------------------------------
# expert parallelism


def _moe_inputs(N=64, E=8, k=2, l=16, H=12, seed=0):
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.standard_normal((N, l)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    w = jnp.asarray(rng.random((N, k)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32) for s in ((E, l, H), (E, l, H), (E, H, l))]
    return z, idx, w, ws


GLU = ("situ", 4.0, 25.0)
# (mesh, devices per node, dispatch, how a tensor group shares its experts, top_k, chunks): every
# hop and tensor path; G expert shards per node = devices_per_node / tensor, over X / G nodes
EP_CASES = {
    "nodes2x2-tensor1": (dict(data=2, expert=4), 2, "capacity", "auto", 2, 2),  # hop 1 (network) + hop 2 (NVLink)
    "nodes2x2-tensor2-weights": (dict(expert=4, tensor=2), 4, "ragged", "weights", 2, 2),  # both hops, weights gathered
    "nodes4-tensor2-rows-k5": (dict(expert=4, tensor=2), 2, "capacity", "rows", 5, 1),  # hop 1; rows split at W=4 slots
}


@pytest.mark.parametrize("case", list(EP_CASES))
def test_expert_parallel_equals_dropless(case):
    """Output and gradients (z, routing weights, w1) of the shard_map MoE equal the
    single-device dropless MoE (1e-5 relative; fp32 sums in another order), on meshes with
    tensor > 1, with nodes > 1 and with both, in one chunk and two (pipelined). 'ragged' runs on
    CPU through an emulation of ragged_all_to_all's documented semantics."""
    shape, per_node, dispatch, tensor, k, chunks = EP_CASES[case]
    z, idx, w, (w1, w3, w2) = _moe_inputs(k=k)
    mesh = make_mesh(MeshConfig(**{"data": 1, **shape}))

    def loss(fn):
        def f(z, w, w1):
            u, aux = fn(z, w, w1)
            return jnp.sum(u ** 2), (u, aux)
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

    ep = loss(lambda z, w, w1: routed_experts_sharded(
        z, idx, w, w1, w3, w2, GLU, jnp.float32, mesh=mesh, capacity_factor=8.0, dispatch=dispatch,
        devices_per_node=per_node, tensor=tensor, chunks=chunks))
    with jax.set_mesh(mesh):
        (_, (u, drop)), g = jax.jit(ep)(z, w, w1)
    (_, (ref, _)), gr = loss(lambda z, w, w1: (routed_experts_dropless(z, idx, w, w1, w3, w2, GLU), None))(z, w, w1)
    assert float(drop) == 0.0
    assert rel_err(u, ref) < 1e-5
    for a, b in zip(g, gr):
        assert rel_err(a, b) < 1e-5


def test_rows_fan_out_one_child_per_destination_and_w_slots():
    """fan_out by hand: slots [5, 1, 4, 0, 2, -1] to destinations e // 2 with at most W=2 slots
    a child: destination 0 gets (1, 0), destination 1 gets (2) and destination 2 gets (5, 4),
    each opening at its first ordered slot; the empty slot goes nowhere."""
    from k3jax.layers.ep_exchange import fan_out

    e = jnp.asarray([[5, 1, 4, 0, 2, -1]], jnp.int32)
    w = jnp.asarray([[0.5, 0.1, 0.4, 0.0, 0.2, 0.9]], jnp.float32)
    split = jax.jit(fan_out, static_argnums=(2, 3, 4))
    half = lambda x: x // 2  # noqa: E731
    dest, ce, cw = split(e, w, half, 3, 2)
    # ordered by (destination, slot): 1, 0 | 2 | 5, 4 | empty
    assert dest.tolist() == [0, 3, 1, 2, 3, 3]
    assert ce.tolist() == [[1, 0], [-1, -1], [2, -1], [5, 4], [-1, -1], [-1, -1]]
    np.testing.assert_allclose(np.asarray(cw)[[0, 2, 3]], [[0.1, 0.0], [0.2, 0.0], [0.5, 0.4]], rtol=1e-7)
    dest3, ce3, _ = split(jnp.asarray([[1, 0, 5]], jnp.int32), w[:, :3], half, 3, 1)
    assert dest3.tolist() == [0, 0, 2] and ce3.tolist() == [[1], [0], [5]]  # W=1: a child per slot


def test_capacity_drops_are_counted_and_dropped_pairs_contribute_nothing():
    """With buffers below demand, the pairs that drop are recomputed here in NumPy: a device
    sends one row per (token, destination shard) in token order; a destination keeps the first
    `cap` rows from each source; the receiver keeps the first `pairs` of its (row, slot) pairs
    ordered by local expert, rows in arrival order (source, then rank)."""
    from k3jax.layers.expert_parallel import exchange_sizes

    N, E, k, X, cf = 64, 8, 2, 4, 0.5
    z, idx, w, (w1, w3, w2) = _moe_inputs(N, E, k, seed=3)
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, expert=4, tensor=1))
    shards, E_loc = 8, E // X
    n = N // shards
    sizes = exchange_sizes(n, k, E, X, 1, 1, cf)
    with jax.set_mesh(mesh):
        u, drop = jax.jit(lambda z: routed_experts_sharded(z, idx, w, w1, w3, w2, GLU, jnp.float32, mesh=mesh,
                                                           capacity_factor=cf, dispatch="capacity",
                                                           devices_per_node=1, chunks=1))(z)
    idx_np = np.asarray(idx)
    keep = np.zeros((N, k), bool)
    for group in range(2):  # data rows: devices 4g .. 4g+3 hold tokens [(4g+s)*n, (4g+s+1)*n); s = expert index
        arrived = {x: [] for x in range(X)}  # destination shard -> rows (token, its slots there), arrival order
        for s in range(X):
            sent = {x: 0 for x in range(X)}
            for tok in range((4 * group + s) * n, (4 * group + s + 1) * n):
                for x in sorted({e // E_loc for e in idx_np[tok]}):
                    if sent[x] < sizes.node_cap:
                        arrived[x].append((tok, [j for j, e in enumerate(idx_np[tok]) if e // E_loc == x]))
                    sent[x] += 1
        for x, rows in arrived.items():
            cands = [(int(idx_np[tok, j]) % E_loc, r, tok, j) for r, (tok, slots) in enumerate(rows) for j in slots]
            for e, r, tok, j in sorted(cands, key=lambda c: c[0])[:sizes.pairs]:  # stable: rows in arrival order
                keep[tok, j] = True
    assert 0 < (~keep).sum() and float(drop) == pytest.approx((~keep).sum() / keep.size)
    ref = routed_experts_dropless(z, idx, jnp.asarray(np.where(keep, w, 0.0), jnp.float32), w1, w3, w2, GLU)
    assert rel_err(u, ref) < 1e-5


def test_node_limited_routing_must_match_the_mesh():
    z, idx, w, (w1, w3, w2) = _moe_inputs()
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="moe.expert_nodes=4"):
        routed_experts_sharded(z, idx, w, w1, w3, w2, GLU, jnp.float32, mesh=mesh, devices_per_node=2,
                               expert_nodes=4)  # 2 shards per node: 2 nodes


# ------------------------------------------------------------------------------------------
# the train step on meshes


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    B, L = cfg.train.batch_size, cfg.data.seq_len
    tok = rng.integers(0, cfg.model.vocab_size, (B, L + 1)).astype(np.int32)
    seg = np.repeat(np.array([[1] * (L // 2) + [2] * (L - L // 2)]), B, 0).astype(np.int32)
    pos = np.concatenate([np.arange(L // 2), np.arange(L - L // 2)])[None].repeat(B, 0).astype(np.int32)
    mask = np.ones((B, L), np.float32)
    mask[:, L // 2 - 1] = 0
    return dict(tokens=tok[:, :-1], targets=tok[:, 1:], segment_ids=seg, positions=pos, loss_mask=mask)


@pytest.fixture(scope="module")
def single_device_steps():
    cfg = load_config(TINY, SMALL + ["mesh.num_devices=1", "model.moe.qb_estimator=histogram"])
    return cfg, _run_steps(cfg)


def _step_config(case, *extra):
    """The model and mesh of STEP_MESHES[case] (test_checkpoint_saved_on_8_devices_restores_on_4
    trains the first one with k3jax-train's loop: the same program, so the compilation cache
    compiles its init and train step once for both tests)."""
    shape, per_node = STEP_MESHES[case]
    return load_config(TINY, SMALL + ["model.moe.qb_estimator=histogram", f"model.moe.ep_devices_per_node={per_node}"]
                       + [f"mesh.{k}={v}" for k, v in shape.items()] + list(extra))


def _run_steps(cfg, n=2):
    setup = prepare(cfg)
    rows = setup.rows
    with jax.set_mesh(setup.mesh):
        state = init_train_state(cfg, setup.spec, setup.tx, shardings=setup.shardings)
        step = setup.train_step(cfg)  # donating the state, as k3jax-train's loop does: one program for both
        losses = []
        for i in range(n):
            batch = {k: jax.device_put(v, rows) for k, v in _batch(cfg, i).items()}
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
    return losses, jax.device_get(state["params"]), jax.device_get(state["rest"])


@pytest.mark.parametrize("case", list(STEP_MESHES))
def test_train_step_on_a_mesh_equals_one_device(single_device_steps, case):
    """Two optimizer steps (AdamW, QB histogram) on a mesh vs one device: losses to 1e-5
    relative, parameters (the gradients' effect) and QB biases (the router statistics') to 1e-4
    absolute. The meshes put the expert axis over 2 nodes, tensor > 1 in one node, and both."""
    cfg1, (loss1, params1, rest1) = single_device_steps
    loss, params, rest = _run_steps(_step_config(case))
    np.testing.assert_allclose(loss, loss1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params1)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3)
    np.testing.assert_allclose(rest["router_bias"], rest1["router_bias"], atol=1e-4)


def test_muon_step_on_a_mesh_equals_one_device():
    """Per-head Muon (fp32 Newton-Schulz) on fsdp 2 x expert 2 x tensor 2, where the matrices
    are split along their matrix dimensions (or copied over some axes) and each is orthogonalised
    once, on one device, from its pieces (train/muon_mesh.py), against one device: losses to 1e-5
    relative, parameters after two steps to 1e-4."""
    muon = ["optimizer.name=muon", "optimizer.muon_per_head=true", "optimizer.muon_dtype=float32"]
    one = load_config(TINY, SMALL + muon + ["mesh.num_devices=1"])
    loss1, params1, _ = _run_steps(one)
    cfg = load_config(TINY, SMALL + muon + [f"mesh.{k}={v}" for k, v in MESHES[3].items()])
    loss, params, _ = _run_steps(cfg)
    np.testing.assert_allclose(loss, loss1, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params1)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3)


class _StopAfter:
    """A stand-in for the SIGTERM flag that fires after `n` steps."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    @property
    def signal(self):
        self.calls += 1
        return "SIGTERM" if self.calls >= self.n else None


def test_checkpoint_saved_on_8_devices_restores_on_4(tmp_path, monkeypatch):
    """Train 3 steps on data=2 x expert=4 (8 devices); the preemption checkpoint restores onto
    fsdp=2 x tensor=2 (4 devices) bit for bit equal to the state the run handed to the
    checkpointer, laid out on the new mesh. One more step there equals the same step from the
    saved state on the original 8 devices (fp32 reductions in another order): loss to 1e-6
    relative (measured: equal), params to 5e-7 absolute (measured 1.3e-7; the step moves
    them by up to 1.7e-3), QB bias to 2e-7 absolute (measured 5e-8).
    The 8-device run is test_train_step_on_a_mesh_equals_one_device's nodes2-expert4 program
    (its config, schedule and donation), which the compilation cache then holds: of the three
    train steps here only the 4-device one is compiled anew."""
    from train.checkpoint import Checkpointer, abstract_with_shardings
    handed = {}
    save = Checkpointer.save

    def spy(self, step, state, data_state, cfg):  # a host copy of what the loop saves
        handed[step] = jax.device_get(state)
        return save(self, step, state, data_state, cfg)

    monkeypatch.setattr(Checkpointer, "save", spy)
    # k3-tiny's 300 steps (its schedule), of which the stop below runs 3
    run = ["checkpoint.every=4", "logging.every=1", "logging.eval_every=0", "logging.progress=false",
           f"run_dir={tmp_path}"]
    cfg8 = _step_config("nodes2-expert4", *run)
    assert (cfg8.mesh.data, cfg8.mesh.fsdp, cfg8.mesh.expert, cfg8.mesh.tensor) == (2, 1, 4, 1)
    train(cfg8, stop=_StopAfter(3))  # as if preempted after step 3: a checkpoint on 8 devices
    assert list(handed) == [3]
    saved = handed[3]
    ckpt = Checkpointer(tmp_path, cfg8.checkpoint)
    assert ckpt.latest_step() == 3
    cfg4 = _step_config("nodes2-expert4", *run, "mesh.data=1", "mesh.fsdp=2", "mesh.expert=1", "mesh.tensor=2",
                        "mesh.num_devices=4")
    on4 = prepare(cfg4)
    sh4 = on4.shardings
    moved, _ = ckpt.restore(3, abstract_with_shardings(on4.abstract, sh4))
    ckpt.close()
    assert jax.tree.structure(moved) == jax.tree.structure(saved)
    for a, b, s in zip(jax.tree.leaves(saved), jax.tree.leaves(moved), jax.tree.leaves(sh4)):
        assert b.sharding.is_equivalent_to(s, b.ndim) and len(b.sharding.device_set) == 4
        assert b.dtype == a.dtype
        np.testing.assert_array_equal(np.asarray(b), a)
    assert int(moved["step"]) == 3 and np.abs(saved["rest"]["router_bias"]).max() > 0

    def one_step(cfg, setup, state):
        with jax.set_mesh(setup.mesh):
            batch = {k: jax.device_put(v, setup.rows) for k, v in _batch(cfg, 9).items()}
            state, m = setup.train_step(cfg)(state, batch)
        return float(m["loss"]), jax.device_get(state)

    on8 = prepare(cfg8)
    loss8, after8 = one_step(cfg8, on8, jax.device_put(saved, on8.shardings))
    loss4, after4 = one_step(cfg4, on4, moved)
    assert int(after4["step"]) == 4 and np.isfinite(loss4)
    np.testing.assert_allclose(loss4, loss8, rtol=1e-6)
    max_diff = lambda x, y: max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))  # noqa: E731
    err, moved_by = max_diff(after4["params"], after8["params"]), max_diff(after8["params"], saved["params"])
    bias_err = np.abs(after4["rest"]["router_bias"] - after8["rest"]["router_bias"]).max()
    print(f"4 vs 8 devices: params {err:.2g} (the step moved them by {moved_by:.2g}), QB bias {bias_err:.2g}")
    assert err < 5e-7 and moved_by > 5e-4, (err, moved_by)
    np.testing.assert_allclose(after4["rest"]["router_bias"], after8["rest"]["router_bias"], atol=2e-7)


def test_aot_compile_sharded_k3_small_step():
    """The sharded train step of configs/k3-small.yaml lowers and compiles for 8 devices
    (expert=4 x tensor=2) without allocating it: a sharding mistake fails here, not on a cluster.
    Each device's share of the train state, as the planner counts it from the sharding rules,
    is what XLA's compiled step takes as arguments (plus the batch's few KB).
    k3-small's first stage only: one unit of its layer pattern, (kda, kda, kda, mla) with the
    dense first layer, at its widths, heads, experts, vocabulary, dtypes and remat. Its other 12
    layers are a second scanned stage of the same layer kinds, sharded by the same rules;
    compiling that second stage too took 290 s of CI's 2 cores, more than the rest of this file."""
    from train.plan.cli import plan

    cfg = load_config(ROOT / "configs" / "k3-small.yaml", ["mesh.data=1", "mesh.fsdp=1", "mesh.expert=4",
                                                          "mesh.tensor=2", "data.seq_len=256", "train.batch_size=8",
                                                          "train.micro_batches=1", "model.layer_pattern=1*(kda,kda,kda,mla)"])
    assert load_config(ROOT / "configs" / "k3-small.yaml").model.layer_pattern == "4*(kda,kda,kda,mla)"
    assert [(s.start, len(s.unit), s.repeat) for s in plan_stages(cfg.model)] == [(0, 4, 1)]
    assert plan_stages(cfg.model)[0].unit == (("kda", "dense"), ("kda", "moe"), ("kda", "moe"), ("mla", "moe"))
    setup = prepare(cfg)
    t0 = time.perf_counter()
    with jax.set_mesh(setup.mesh):
        compiled = setup.train_step(cfg).lower(*setup.abstract_args(cfg)).compile()
    print(f"k3-small sharded step AOT compile: {time.perf_counter() - t0:.1f} s")
    pd = plan(cfg, 8, activations=False)["per_device_bytes"]
    state = pd["params"] + pd["optimizer"] + pd["other_state"]
    args = compiled.memory_analysis().argument_size_in_bytes
    assert state <= args <= state * 1.001 + 8 * 256 * 5 * 4, (state, args)
