"""k3jax-export / k3jax-import of k3jax's own K3 layout: bitwise round trips (fp32 and bf16,
scanned and unscanned stacks, a sharded import on an 8-device mesh), the files' index and
metadata, the HF layouts of a few tensors against the k3jax arrays written by hand, and the
errors for a missing, misshapen or unexpected tensor."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interchange_util import flat, micro_config, random_weights
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from k3jax.config import ConfigError
from k3jax.config.schema import replace
from k3jax.interchange import InterchangeError
from k3jax.interchange.hf_reader import import_checkpoint
from k3jax.interchange.hf_writer import export_weights
from k3jax.interchange.names import release_plan
from train.interchange import export as export_mod
from train.interchange import import_ as import_mod
from train.interchange.rundir import load_run_weights

BF16 = np.dtype(jnp.bfloat16)  # ml_dtypes' bfloat16, which safetensors' NumPy API reads and writes


def read_dir(d) -> tuple[dict, dict]:
    """(every tensor of the directory's files, the index)."""
    index = json.loads((d / "model.safetensors.index.json").read_text())
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        part = load_file(str(d / f))
        assert not set(part) & set(tensors), f"{f} repeats a tensor"
        tensors.update(part)
    return tensors, index


@pytest.fixture(scope="module")
def fp32_export(tmp_path_factory):
    cfg = micro_config()
    params, rest = random_weights(cfg.model, seed=1)
    out = tmp_path_factory.mktemp("fp32")
    export_weights(cfg, params, rest, out, dtype="float32", shard_bytes=150_000)
    return cfg, params, rest, out


def test_fp32_round_trip_is_bitwise_and_index_covers_every_tensor_once(fp32_export):
    cfg, params, rest, out = fp32_export
    tensors, index = read_dir(out)
    names = [e.name for e in release_plan(cfg.model)]
    assert len(names) == len(set(names))
    assert set(index["weight_map"]) == set(tensors) == set(names)  # every tensor, once, where the index says
    for name, f in index["weight_map"].items():
        with safe_open(str(out / f), "np") as h:
            assert name in h.keys() and h.metadata() == {"format": "pt"}  # noqa: SIM118 (a handle)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert len(set(index["weight_map"].values())) > 1  # the shard limit split the files
    _, arrays = import_checkpoint(out, cfg)
    a, b = flat({"params": params, "rest": rest}), flat(arrays)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_hf_layouts_against_hand_written_transposes(fp32_export):
    """A few tensors of the file against the k3jax arrays, each relation written out here."""
    _, params, rest, out = fp32_export
    t, _ = read_dir(out)
    s0 = params["stages"][0]["units"]["layers"]  # layers 0 (kda, dense) and 1 (mla, moe)
    s1 = params["stages"][1]["units"]["layers"]  # layers 2,3 (rep 0) and 4,5 (rep 1)
    np.testing.assert_array_equal(t["model.embed_tokens.weight"], params["embed_tokens"])
    np.testing.assert_array_equal(t["lm_head.weight"], params["lm_head"]["kernel"].T)
    np.testing.assert_array_equal(t["model.layers.0.self_attn.q_proj.weight"], s0[0]["self_attn"]["q_proj"]["kernel"][0].T)
    conv = s0[0]["self_attn"]["k_conv1d"]["weight"][0]  # [W, P]
    for c in range(3):
        np.testing.assert_array_equal(t["model.layers.0.self_attn.k_conv1d.weight"][c, 0], conv[:, c])
    a_log = t["model.layers.4.self_attn.A_log"]
    assert a_log.shape == (128,) and not a_log[2:].any()
    np.testing.assert_array_equal(a_log[:2], s1[0]["self_attn"]["A_log"][1])
    qb = s1[1]["self_attn"]["q_b_proj"]["kernel"][1]  # layer 5: [R, H, n+r]
    hf = t["model.layers.5.self_attn.q_b_proj.weight"]  # [H*(n+r), R], head-major rows
    np.testing.assert_array_equal(hf[24 + 3], qb[:, 1, 3])
    o = s1[1]["self_attn"]["o_proj"]["kernel"][1]  # [H, v, d]
    np.testing.assert_array_equal(t["model.layers.5.self_attn.o_proj.weight"][:, 16 + 5], o[1, 5])
    w2 = s1[0]["block_sparse_moe"]["experts"]["w2"][1, 3]  # layer 4, expert 3: [h, l]
    np.testing.assert_array_equal(t["model.layers.4.block_sparse_moe.experts.3.w2.weight"], w2.T)
    np.testing.assert_array_equal(t["model.layers.4.block_sparse_moe.gate.e_score_correction_bias"],
                                  rest["router_bias"][3])  # MoE layers 1,2,3,4,5: row 3 is layer 4
    np.testing.assert_array_equal(t["model.layers.4.mlp_res_proj.weight"], s1[0]["mlp_res"]["proj"]["kernel"][1].T)
    np.testing.assert_array_equal(t["model.output_attn_res_norm.weight"], params["output_attn_res"]["norm"]["weight"])


def test_bf16_unscanned_round_trip_and_scanned_export_is_the_same_checkpoint(fp32_export, tmp_path):
    """bf16 params exported as bf16 come back bitwise; the fp32 tensors (norms, router, gates)
    come back as their bf16 rounding, except those the release keeps in fp32. An unscanned
    model holding the same weights writes the same tensors."""
    _, _, _, src = fp32_export
    cfg = micro_config(param_dtype="bfloat16", scan_layers=False)
    _, arrays = import_checkpoint(src, cfg)  # fp32 file -> bf16 / fp32 leaves of an unscanned model
    out = tmp_path / "bf16"
    export_weights(cfg, arrays["params"], arrays["rest"], out, dtype="bfloat16")
    tensors, _ = read_dir(out)
    orig, _ = read_dir(src)
    for name, x in tensors.items():
        keep = name.endswith(("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias"))
        assert x.dtype == (np.float32 if keep else BF16), name
        np.testing.assert_array_equal(x, orig[name].astype(x.dtype), err_msg=name)
    _, back = import_checkpoint(out, cfg)
    a, b = flat(arrays), flat(back)
    for k in a:
        if a[k].dtype == BF16 or "A_log" in k or "dt_bias" in k or "conv1d" in k or "router_bias" in k:
            assert np.array_equal(a[k], b[k]), k
        else:
            np.testing.assert_array_equal(b[k], a[k].astype(BF16).astype(np.float32), err_msg=k)
    # the scanned model with the same weights exports the same checkpoint
    scanned = micro_config(param_dtype="bfloat16")
    _, arr2 = import_checkpoint(out, scanned)
    out2 = tmp_path / "scanned"
    export_weights(scanned, arr2["params"], arr2["rest"], out2, dtype="bfloat16")
    t2, _ = read_dir(out2)
    assert set(t2) == set(tensors)
    for k in tensors:
        assert np.array_equal(t2[k], tensors[k]), k


def test_sharded_import_and_export_on_a_mesh(fp32_export, tmp_path):
    """Each device's callback reads its slice (heads, experts, layers): the sharded arrays hold
    the same values, and exporting them from the mesh writes the same files."""
    from train.setup import prepare

    cfg, params, rest, src = fp32_export
    cfg = replace(cfg, **{"mesh.data": 1, "mesh.fsdp": 2, "mesh.expert": 2, "mesh.tensor": 2})
    setup = prepare(cfg)
    sh = {k: setup.shardings[k] for k in ("params", "rest")}
    with jax.set_mesh(setup.mesh):
        _, arrays = import_checkpoint(src, cfg, shardings=sh)
        assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
                   for x in jax.tree.leaves(arrays))
        a, b = flat({"params": params, "rest": rest}), flat(arrays)
        assert all(np.array_equal(a[k], b[k]) for k in a)
        export_weights(cfg, arrays["params"], arrays["rest"], tmp_path, dtype="float32")
    t1, _ = read_dir(src)
    t2, _ = read_dir(tmp_path)
    assert set(t1) == set(t2) and all(np.array_equal(t1[k], t2[k]) for k in t1)


def _copy_with(src, dst, change):
    """src's tensors rewritten into one file of dst, after change(tensors)."""
    tensors, _ = read_dir(src)
    change(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_errors_name_the_tensor(fp32_export, tmp_path):
    cfg, _, _, src = fp32_export
    name = "model.layers.3.self_attn.kv_b_proj.weight"
    _copy_with(src, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(InterchangeError, match=f"missing tensor {name}"):
        import_checkpoint(tmp_path / "missing", cfg)
    _copy_with(src, tmp_path / "shape", lambda t: t.update({name: t[name][:, :-1].copy()}))
    with pytest.raises(InterchangeError, match=rf"tensor {name} in .*model.safetensors has shape \[64, 31\], "
                                               r"expected \[64, 32\]"):
        import_checkpoint(tmp_path / "shape", cfg)
    _copy_with(src, tmp_path / "extra", lambda t: t.update({"model.layers.9.mlp.up_proj.weight": t[name]}))
    with pytest.raises(InterchangeError, match="unexpected tensor model.layers.9.mlp.up_proj.weight"):
        import_checkpoint(tmp_path / "extra", cfg)
    # a run directory that is not one, and an export of another model (its recorded config)
    assert export_mod.main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    other = micro_config(ffn_hidden=128)
    from k3jax.config import ConfigError
    with pytest.raises(ConfigError, match="model.ffn_hidden"):
        import_checkpoint(src, other)


def test_cli_import_then_train_start_export_and_decode(tmp_path, capsys):
    """k3jax-import writes a run dir: k3jax-train's start reads those weights with a fresh
    optimizer state at step 0, k3jax-export of it gives back the same files, and the model
    loads for k3jax.decode (a 2-layer model: decoding compiles it)."""
    import yaml

    from k3jax.config import config_to_dict, load_config
    from k3jax.decode import generate
    from train.interchange.rundir import load_model
    from train.cli import check_imported
    from train.setup import prepare
    from train.state import train_state_from_weights

    cfg = micro_config(layer_pattern="kda+mla", attn_res_block_size=1)
    params, rest = random_weights(cfg.model, seed=2)
    src = tmp_path / "src"
    export_weights(cfg, params, rest, src, dtype="float32")
    config = tmp_path / "run.yaml"
    # one device: an 8-way replicated state would only add Orbax's per-replica slicing to the test
    config.write_text(yaml.safe_dump({"model": config_to_dict(cfg)["model"], "train": {"steps": 3},
                                      "mesh": {"num_devices": 1}}))
    run = tmp_path / "run"
    assert import_mod.main([str(src), "--config", str(config), "--out", str(run)]) == 0
    assert import_mod.main([str(src), "--config", str(config), "--out", str(run)]) == 2  # never overwrites
    assert "already holds weights" in capsys.readouterr().err
    run_cfg = load_config(run / "config.yaml")
    assert check_imported(run, run_cfg)
    with pytest.raises(Exception, match="model.d_model"):
        check_imported(run, replace(run_cfg, **{"model.d_model": 32}))
    _, p2, r2 = load_run_weights(run)
    # imported scanned (2 stages of one layer each), read unrolled (1 stage of both): layer 1's
    # tensors move from stage 1 slot 0 to stage 0 slot 1 (train/relayout.py), nothing else changes
    cfg_u, p3, r3 = load_run_weights(run, overrides=["model.scan_layers=false"])
    assert cfg_u.model.scan_layers is False
    scanned_keys, unrolled_keys = flat(p2), flat(p3)
    moved = {k.replace("['stages'][1]['units']['layers'][0]", "['stages'][0]['units']['layers'][1]"): v
             for k, v in scanned_keys.items()}
    assert set(moved) == set(unrolled_keys) and any("['stages'][1]" in k for k in scanned_keys)
    for k, v in moved.items():  # both layouts hold one repeat of each stage here: [1, ...]
        np.testing.assert_array_equal(unrolled_keys[k], v)
    np.testing.assert_array_equal(flat(r3)["['router_bias']"], flat(r2)["['router_bias']"])
    tx = prepare(run_cfg).tx
    state = train_state_from_weights(run_cfg, tx, p2, r2)
    assert int(state["step"]) == 0
    a = flat({"params": params, "rest": rest})
    assert all(np.array_equal(a[k], v) for k, v in flat({"params": state["params"], "rest": state["rest"]}).items())
    fresh = flat(tx.init(p2))
    assert all(np.array_equal(v, fresh[k]) for k, v in flat(state["opt_state"]).items())
    out = tmp_path / "again"
    assert export_mod.main([str(run), "--out", str(out), "--dtype", "float32"]) == 0
    # 64 ids: the run's byte tokenizer (257) is not what it trained on, and the export says so
    assert "no tokenizer written: data.tokenizer 'bytes' has 257 ids, model.vocab_size 64" in capsys.readouterr().out
    assert not (out / "tokenizer.json").exists() and "eos_token_id" not in json.loads((out / "config.json").read_text())
    t1, _ = read_dir(src)
    t2, _ = read_dir(out)
    assert set(t1) == set(t2) and all(np.array_equal(t1[k], t2[k]) for k in t1)
    model = load_model(run)
    np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]), params["lm_head"]["kernel"])
    prompt = np.array([[5, 9, 2]], np.int32)
    tokens = np.asarray(generate(model, prompt, max_new_tokens=2))  # decode's own tests check its values
    assert tokens.shape == (1, 5) and np.array_equal(tokens[:, :3], prompt) and tokens.max() < cfg.model.vocab_size


def test_export_reads_a_training_checkpoint_at_the_asked_step(tmp_path, capsys):
    """A run directory as k3jax-train leaves it (Orbax train states): --step picks the state,
    and the file holds that state's parameters and router bias."""
    from k3jax.config import dump_config
    from k3jax.config.schema import replace
    from train.checkpoint import Checkpointer
    from train.setup import prepare
    from train.state import init_train_state

    cfg = replace(micro_config(layer_pattern="kda+mla", attn_res_block_size=1), run_dir=str(tmp_path / "run"),
                  **{"mesh.num_devices": 1, "checkpoint.async_save": False})
    setup = prepare(cfg)
    state = init_train_state(cfg, setup.spec, setup.tx)
    ckpt = Checkpointer(cfg.run_dir, cfg.checkpoint)
    later = dict(state, rest={"router_bias": state["rest"]["router_bias"] + 1.0}, step=state["step"] + 7)
    ckpt.save(4, state, {"reader": 0}, cfg)
    ckpt.save(7, later, {"reader": 1}, cfg)
    ckpt.close()
    dump_config(cfg, tmp_path / "run" / "config.yaml")
    for step, src in ((4, state), (None, later)):  # None: the newest
        out = tmp_path / f"hf{step}"
        assert export_mod.main([cfg.run_dir, "--out", str(out), "--dtype", "auto"]
                               + ([] if step is None else ["--step", str(step)])) == 0
        t, _ = read_dir(out)
        np.testing.assert_array_equal(t["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"],
                                      np.asarray(src["rest"]["router_bias"])[0])
        np.testing.assert_array_equal(t["lm_head.weight"], np.asarray(src["params"]["lm_head"]["kernel"]).T)
    assert export_mod.main([cfg.run_dir, "--out", str(tmp_path / "x"), "--step", "5"]) == 2
    assert "no checkpoint at step 5 (saved steps: [4, 7])" in capsys.readouterr().err
    # the caller's overrides reach the checkpoint's config (they were once dropped for the saved
    # one, so a kernel-vs-XLA comparison ran one path twice); a bad one is named
    got, params, _ = load_run_weights(cfg.run_dir, 4, ("model.kda.impl=xla", "train.batch_size=3"))
    assert (got.model.kda.impl, got.train.batch_size) == ("xla", 3) and cfg.model.kda.impl == "auto"
    np.testing.assert_array_equal(params["lm_head"]["kernel"], np.asarray(state["params"]["lm_head"]["kernel"]))
    with pytest.raises(ConfigError, match="model.moe.qb_update_rate"):
        load_run_weights(cfg.run_dir, 4, ("model.moe.qb_update_rate=0",))


def test_vlm_checkpoint_reads_the_language_model_only(fp32_export, tmp_path):
    """The release's VLM checkpoint prefixes the text model's names with `language_model.`
    and holds a vision tower: the import takes the former and leaves the latter."""
    cfg, params, rest, src = fp32_export

    def vlm(t):
        for name in list(t):
            t["language_model." + name] = t.pop(name)
        t["vision_tower.patch_embed.weight"] = np.zeros((4, 4), np.float32)

    _copy_with(src, tmp_path / "vlm", vlm)
    (tmp_path / "vlm" / "config.json").write_text(json.dumps({"model_type": "kimi_vl_unknown"}))
    with pytest.raises(InterchangeError, match="model_type 'kimi_vl_unknown' is not one k3jax reads"):
        import_checkpoint(tmp_path / "vlm", cfg)
    _, arrays = import_checkpoint(tmp_path / "vlm", cfg, layout="k3")  # --layout k3: the config is the truth
    a, b = flat({"params": params, "rest": rest}), flat(arrays)
    assert all(np.array_equal(a[k], b[k]) for k in a)
