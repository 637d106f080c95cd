"""`model.scan_layers` may change on resume: the train state moves between the scanned and the
unrolled layer layouts (train/relayout.py). Checked against the model itself (the moved
parameters compute the scanned model's logits), by hand (where one layer lands), by a round
trip (bit for bit), end to end (a scanned checkpoint resumed unrolled), and by one training
step in each layout from the same state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.model import create_model
from k3jax.model_spec import model_spec
from k3jax.tree_paths import plain_path
from train.checkpoint import abstract_train_state_of
from train.relayout import RelayoutError, layer_places, relayout, stage_layout

from tiny_run import TINY

# 8 layers in (kda, mla) units: scanned, a dense first unit and 3 repeats of a MoE unit
MODEL = ["model.layer_pattern=4*(kda,mla)", "model.attn_res_block_size=2", "model.d_model=64",
         "model.moe.latent_dim=32"]


def _cfg(scan: bool, *extra):
    return load_config(TINY, MODEL + [f"model.scan_layers={str(scan).lower()}", *extra])


def test_layer_places_by_hand():
    scanned, unrolled = _cfg(True).model, _cfg(False).model
    assert stage_layout(scanned) == ((0, 2, 1), (2, 2, 3)) and stage_layout(unrolled) == ((0, 8, 1),)
    # layer 5 = stage 1's start 2 + repeat 1 x 2 + slot 1
    assert layer_places(scanned)[5] == (1, 1, 1) and layer_places(unrolled)[5] == (0, 5, 0)


def test_moved_parameters_compute_the_scanned_models_logits():
    """Scanned parameters and router bias moved into the unrolled layout, run by the unrolled
    model: the scanned model's logits (fp32; the two programs differ only in how XLA lays out
    the same arithmetic). The bias is non-zero so routing depends on it reaching its layer.
    4 layers, scanned as 2 repeats of one (kda, mla) MoE unit."""
    small = ["model.layer_pattern=2*(kda,mla)", "model.first_k_dense=0"]
    scanned, unrolled = _cfg(True, *small).model, _cfg(False, *small).model
    assert stage_layout(scanned) == ((0, 2, 2),) and stage_layout(unrolled) == ((0, 4, 1),)
    model = create_model(scanned, seed=0)
    model.router_bias[...] = 0.1 * jax.random.normal(jax.random.PRNGKey(1), model.router_bias[...].shape)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = {"params": nnx.to_pure_dict(params), "rest": nnx.to_pure_dict(rest)}
    spec = model_spec(unrolled)
    target = {"params": jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(spec.params)),
              "rest": jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(spec.rest))}
    moved = relayout(jax.tree.map(jnp.copy, state), scanned, target, unrolled)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 16), 0, scanned.vocab_size)
    want = jax.jit(lambda p, r: nnx.merge(graphdef, p, r)(tokens)[0])(params, rest)
    got = jax.jit(lambda s: spec.model_from(s["params"], s["rest"])(tokens)[0])(moved)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(moved["rest"]["router_bias"], state["rest"]["router_bias"])


def test_train_state_round_trip_is_exact_and_layer_five_lands_by_hand():
    """A per-head Muon train state (params, AdamW and Muon moments) of random values: scanned ->
    unrolled -> scanned gives it back bit for bit, and layer 5's slices land where
    test_layer_places_by_hand says, in the parameters and in every moment."""
    muon = ["optimizer.name=muon", "optimizer.muon_per_head=true"]
    scanned, unrolled = _cfg(True, *muon), _cfg(False, *muon)
    abstract_s, abstract_u = abstract_train_state_of(scanned), abstract_train_state_of(unrolled)
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype)), abstract_s)
    host = jax.device_get(state)
    moved = relayout(state, scanned.model, abstract_u, unrolled.model)
    assert jax.tree.structure(moved) == jax.tree.structure(abstract_u)
    kernel = ("units", "layers", "self_attn", "kv_a_proj_with_mqa", "kernel")  # layer 5 is an MLA layer

    def layer_leaves(tree, stage, slot):
        out = []
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            keys = plain_path(path)
            for i in range(len(keys) - 6):
                if keys[i:i + 2] == ("stages", stage) and keys[i + 2:i + 4] == kernel[:2] \
                        and keys[i + 4] == slot and keys[i + 5:] == kernel[2:]:
                    out.append((keys[:i], np.asarray(x)))
        return out

    before, after = layer_leaves(host, 1, 1), layer_leaves(jax.device_get(moved), 0, 5)
    assert len(before) == len(after) >= 2  # the parameter and its Muon momentum at least
    for (pa, a), (pb, b) in zip(before, after):
        assert pa == pb and a.shape[0] == 3 and b.shape[0] == 1
        np.testing.assert_array_equal(b[0], a[1])  # repeat 1 of stage 1 -> the unrolled stage's only row
    back = relayout(moved, unrolled.model, abstract_s, scanned.model)
    for x, y in zip(jax.tree.leaves(host), jax.tree.leaves(jax.device_get(back))):
        np.testing.assert_array_equal(x, y)


def test_another_optimizer_is_refused_naming_a_leaf():
    scanned, unrolled = _cfg(True), _cfg(False, "optimizer.name=muon", "optimizer.muon_per_head=true")
    with pytest.raises(RelayoutError, match="the requested run has it|the checkpoint has it"):
        relayout(abstract_train_state_of(scanned), scanned.model, abstract_train_state_of(unrolled), unrolled.model)


RUN = ["train.steps=4", "mesh.num_devices=2", "mesh.data=1", "mesh.fsdp=2", "mesh.expert=1", "mesh.tensor=1"]


def test_resume_reads_a_scanned_checkpoint_into_the_unrolled_layout(tmp_path):
    """A scanned run's checkpoint (step 2, on an fsdp=2 mesh), resumed by k3jax-train's resume
    (train.resume.restore_newest) under model.scan_layers=false: its check passes, and the state
    comes back in the unrolled layout, in the unrolled run's shardings, equal bit for bit to the
    saved one moved by hand-checked `relayout`. Another optimizer is still refused, naming a leaf."""
    from k3jax.config import ConfigError
    from train.checkpoint import Checkpointer
    from train.resume import restore_newest
    from train.setup import prepare
    from train.state import init_train_state

    scanned, unrolled = _cfg(True, *RUN, f"run_dir={tmp_path}"), _cfg(False, *RUN, f"run_dir={tmp_path}")
    src = prepare(scanned)
    with jax.set_mesh(src.mesh):
        state = init_train_state(scanned, src.spec, src.tx, shardings=src.shardings)
        state = dict(state, step=jnp.asarray(2, jnp.int32),
                     rest={"router_bias": jax.device_put(0.1 * jax.random.normal(
                         jax.random.PRNGKey(3), state["rest"]["router_bias"].shape), src.shardings["rest"]["router_bias"])})
    saved = jax.device_get(state)
    with Checkpointer(tmp_path, scanned.checkpoint, owner=True) as ckpt:
        ckpt.save(2, state, {"position": 7}, scanned)
    dst = prepare(unrolled)
    with Checkpointer(tmp_path, unrolled.checkpoint) as ckpt:
        resumed = restore_newest(ckpt, unrolled, dst)
        assert resumed.step == 2 and resumed.data == {"position": 7} and not resumed.damaged
        want = relayout(jax.tree.map(jnp.asarray, saved), scanned.model, dst.abstract, unrolled.model)
        assert jax.tree.structure(resumed.state) == jax.tree.structure(dst.abstract)
        # by hand: layer 5 (scanned: stage 1, slot 1, repeat 1) is the unrolled stage's slot 5
        kernel = lambda p, s, j: p["stages"][s]["units"]["layers"][j]["self_attn"]["kv_a_proj_with_mqa"]["kernel"]  # noqa: E731
        np.testing.assert_array_equal(np.asarray(kernel(resumed.state["params"], 0, 5))[0],
                                      kernel(saved["params"], 1, 1)[1])
        for got, w, sh in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(want), jax.tree.leaves(dst.shardings)):
            assert got.sharding.is_equivalent_to(sh, got.ndim)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
        muon = _cfg(False, *RUN, f"run_dir={tmp_path}", "optimizer.name=muon", "optimizer.muon_per_head=true")
        with pytest.raises(ConfigError, match="cannot be restored into the requested run's .*the requested run has it"):
            restore_newest(ckpt, muon, prepare(muon))


def test_one_train_step_is_the_same_in_both_layouts():
    """The layer layout changes where the state lies, not what a step computes: from the same
    state (moved), one training step scanned and one unrolled give the same loss, the same
    Quantile Balancing bias for every MoE layer (its routing statistics reach the layer they came
    from) and the same new parameters and AdamW moments, to fp32 noise. 4 layers, a non-zero bias."""
    from train.setup import prepare
    from train.state import init_train_state

    small = ["model.layer_pattern=2*(kda,mla)", "model.first_k_dense=0", "data.seq_len=16", "train.batch_size=2",
             "mesh.num_devices=1", "optimizer.warmup_steps=0"]
    scanned, unrolled = _cfg(True, *small), _cfg(False, *small)
    s_setup, u_setup = prepare(scanned), prepare(unrolled)
    state = init_train_state(scanned, s_setup.spec, s_setup.tx, shardings=s_setup.shardings)
    bias = state["rest"]["router_bias"]
    state = dict(state, rest={"router_bias": 0.1 * jax.random.normal(jax.random.PRNGKey(3), bias.shape, bias.dtype)})
    moved = relayout(jax.tree.map(jnp.copy, state), scanned.model, u_setup.abstract, unrolled.model)
    bias_before = np.asarray(state["rest"]["router_bias"])  # the step donates the state
    rng = np.random.default_rng(0)
    tok = rng.integers(0, scanned.model.vocab_size, (2, 17)).astype(np.int32)
    batch = {"tokens": tok[:, :-1], "targets": tok[:, 1:], "segment_ids": np.ones((2, 16), np.int32),
             "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16)).copy(),
             "loss_mask": np.ones((2, 16), np.float32)}
    s_new, s_m = s_setup.train_step(scanned)(state, batch)
    u_new, u_m = u_setup.train_step(unrolled)(moved, batch)
    np.testing.assert_allclose(u_m["loss"], s_m["loss"], rtol=1e-5)
    np.testing.assert_allclose(u_m["max_violation"], s_m["max_violation"], rtol=1e-4, atol=1e-5)
    assert float(np.max(np.abs(np.asarray(s_new["rest"]["router_bias"]) - bias_before))) > 1e-4  # QB moved it
    np.testing.assert_allclose(u_new["rest"]["router_bias"], s_new["rest"]["router_bias"], rtol=1e-4, atol=1e-6)
    back = relayout(u_new, unrolled.model, s_setup.abstract, scanned.model)
    # atol: AdamW's first step divides each gradient by its own magnitude, so an element whose
    # gradient is near adam's eps turns fp32 noise into ~1 % of a step (lr 3e-3); 1 of 65,536 did
    assert jax.tree.structure(back) == jax.tree.structure(s_new)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(back)[0], jax.tree.leaves(s_new)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-3, atol=5e-5,
                                   err_msg=jax.tree_util.keystr(path))
