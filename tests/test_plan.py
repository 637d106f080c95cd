"""k3jax-plan: state bytes against hand counts, the CLI and the launch scripts (the all-to-all:
tests/test_plan_comm.py)."""

import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from k3jax.config import ConfigError, load_config
from k3jax.model_sizes import abstract_model, param_counts
from train.plan.cli import main, plan
from train.plan.memory import state_leaves

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "k3-tiny.yaml")  # vocab 512, d 128, 16 experts of 64 x 64, latent 64, k 4


def tiny(**mesh):
    sizes = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1, **mesh}
    return load_config(TINY, [f"mesh.{a}={s}" for a, s in sizes.items()]), math.prod(sizes.values())


def test_replicated_mesh_holds_every_parameter_and_adamw_holds_two_moments():
    cfg, n = tiny()
    r = plan(cfg, n, activations=False)
    total_params = sum(param_counts(abstract_model(cfg.model)).values())
    pd = r["per_device_bytes"]
    assert pd["params"] == 4 * total_params  # fp32 master weights
    assert pd["grads"] == pd["params"]
    # mu and nu of every parameter, plus int32 step counters (adam's and the schedule's)
    assert 0 < pd["optimizer"] - 2 * pd["params"] <= 16
    assert pd["total"] == pytest.approx(sum(v for k, v in pd.items() if k != "total"))


def test_known_tensors_shard_by_the_rules():
    cfg, _ = tiny(fsdp=2, expert=2, tensor=2)
    leaves = {lf.path: lf for lf in state_leaves(cfg, {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2})["params"]}
    # embed_tokens [vocab 512, embed 128]: vocab over tensor, embed over fsdp x expert
    assert leaves[("embed_tokens",)].bytes == 512 * 128 * 4 / 8
    assert leaves[("lm_head", "kernel")].bytes == 128 * 512 * 4 / 8
    # routed w1 of layer 4 (second stage, one repeat): [1, experts 16, latent 64, hidden 64]
    w1 = leaves[("stages", 1, "units", "layers", 0, "block_sparse_moe", "experts", "w1")]
    assert w1.shape == (1, 16, 64, 64) and w1.bytes == 16 * 64 * 64 * 4 / 8
    # A_log [1, heads 4]: heads over tensor only
    assert leaves[("stages", 0, "units", "layers", 1, "self_attn", "A_log")].bytes == 4 * 4 / 2


def test_doubling_fsdp_halves_the_state_up_to_small_replicated_tensors():
    a = plan(*tiny(fsdp=2), activations=False)["per_device_bytes"]
    b = plan(*tiny(fsdp=4), activations=False)["per_device_bytes"]
    for k in ("params", "optimizer"):
        # tiny's LoRA-side kernels, convs and per-head vectors are not split over fsdp: ~7% of it
        assert a[k] / 2 < b[k] < a[k] / 2 * 1.1
    sizes = {"data": 1, "fsdp": 2, "expert": 1, "tensor": 1}
    two = {lf.path: lf for lf in state_leaves(tiny(fsdp=2)[0], sizes)["params"]}
    four = state_leaves(tiny(fsdp=4)[0], {**sizes, "fsdp": 4})["params"]
    for lf in four:  # each leaf halves exactly, or is replicated over fsdp and stays
        assert lf.bytes == (two[lf.path].bytes / 2 if "fsdp" in str(lf.spec) else two[lf.path].bytes)
    assert all("fsdp" in str(lf.spec) for lf in four if lf.path[-1] in ("embed_tokens", "w1", "w2", "w3"))


SMALL = ["model.layer_pattern=kda+mla", "model.attn_res_block_size=2", "model.d_model=64", "model.moe.latent_dim=32",
         "data.seq_len=64", "train.batch_size=8", "model.moe.gmm_block=64"]


def test_plan_against_the_compiled_train_step_on_a_fake_mesh():
    """The plan's state bytes against XLA's argument size for the real sharded train step on 8
    fake devices, and its activations + gradients against the step's temporaries. The plan
    compiles one device's gradient alone; the step also has the SPMD partitioner's buffers and
    the optimizer update, so they differ by measured 0.90 (this mesh) to 1.07 (data=2, fsdp=2,
    expert=2): within 25 %."""
    from train.setup import prepare

    cfg = load_config(TINY, SMALL + ["mesh.data=2", "mesh.fsdp=1", "mesh.expert=2", "mesh.tensor=2",
                                     "model.remat=full"])
    pd = plan(cfg, 8, target="cpu")["per_device_bytes"]
    setup = prepare(cfg)
    with jax.set_mesh(setup.mesh):
        ma = setup.train_step(cfg).lower(*setup.abstract_args(cfg)).compile().memory_analysis()
    state = pd["params"] + pd["optimizer"] + pd["other_state"]
    assert state == pytest.approx(ma.argument_size_in_bytes, rel=0.01)  # + the batch's few KB
    assert pd["grads"] + pd["activations"] == pytest.approx(ma.temp_size_in_bytes, rel=0.25)


def test_compiled_activations_follow_remat_and_the_target():
    # two layers: remat's saving and the one-layer workspace below do not depend on the depth
    cfg = load_config(TINY, ["model.layer_pattern=2*kda", "model.attn_res_block_size=0", "model.moe_every=0",
                             "data.seq_len=256"])
    none = plan(cfg, 1, target="cpu")
    full = plan(load_config(TINY, ["model.layer_pattern=2*kda", "model.attn_res_block_size=0", "model.moe_every=0",
                                   "data.seq_len=256", "model.remat=full"]), 1, target="cpu")
    assert none["compiler"]["kind"] == "host" and "note" not in none["compiler"]
    assert full["per_device_bytes"]["activations"] < 0.7 * none["per_device_bytes"]["activations"]
    # planning for a GPU (a stand-in for the fused KDA kernels is compiled), their backward
    # workspace is added for one layer; by hand for 8 x 256 tokens, 4 heads of 32, chunk 16,
    # fp32. Keeping their intermediates (the default): state gradients, dv_new, fp32 partials;
    # keeping only their inputs (fla's way), also kernel-1 outputs + L scratch, states and v_new
    gpu = plan(cfg, 1, target="gpu", compiler="host")
    inputs_only = plan(load_config(TINY, ["model.layer_pattern=2*kda", "model.attn_res_block_size=0",
                                          "model.moe_every=0", "data.seq_len=256",
                                          "model.kda.kernel_residuals=inputs"]), 1, target="gpu", compiler="host")
    workspace = lambda r: [v for k, v in r["activation_terms"].items() if "workspace" in k]  # noqa: E731
    kept_per_token = 32 * 32 * 4 / 16 + 32 * 4 + (3 * 32 + 2 * 16 + 1) * 4
    recomputed = (3 * 32 + 32 + 2 * 16) * 4 + 4 * 16 + 32 * 32 * 4 / 16 + 32 * 4
    assert workspace(gpu) == [8 * 256 * 4 * kept_per_token]
    assert workspace(inputs_only) == [8 * 256 * 4 * (kept_per_token + recomputed)]
    assert not any("workspace" in k for k in none["activation_terms"])
    compiled = lambda r: next(v for k, v in r["activation_terms"].items() if k.startswith("compiled"))  # noqa: E731
    assert compiled(inputs_only) < compiled(none)  # the XLA form keeps its chunk tensors; the kernels their inputs
    # kept, the intermediates are the stand-in's residuals: per token and head w, kg, qg, Aqk, Ainv,
    # v_new and the chunk states, 2 layers (fp32, so 4 bytes each), and within 10 % of it
    kept = 8 * 256 * 4 * 2 * ((3 * 32 + 2 * 16 + 32) * 4 + (32 * 32 + 32) * 4 / 16)
    assert compiled(gpu) - compiled(inputs_only) == pytest.approx(kept, rel=0.1)


def test_host_fallback_says_first_that_its_figure_is_not_the_targets(capsys, monkeypatch):
    """Without the target's compiler (monkeypatched: as without the [plan] extra) the plan compiles on this machine
    and its first line says how far that figure was measured from a GPU's, and how to get the
    right compiler; the JSON says which compiler measured it."""
    import train.plan.cli as kp

    monkeypatch.setattr(kp, "compiler_unavailable", lambda platform: "jax-cuda13-plugin is not installed")
    args = ["--config", TINY, "--devices", "1", "--chip", "h200", "model.layer_pattern=kda", "data.seq_len=64",
            "model.attn_res_block_size=0",
            "train.batch_size=2", "model.moe_every=0"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("NOTE: XLA:CPU's figure: measured 1.96x") and "pip install -e '.[plan]'" in lines[0]
    assert "jax-cuda13-plugin is not installed" in lines[0]
    assert any("compiled by XLA:CPU" in line for line in lines[1:4])
    assert main(args + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["compiler"]["kind"] == "host" and r["chip"] == "h200" and r["hbm_bytes"] == 141e9
    assert r["flops"]["peak_tflops"] == 989.0
    # asking for the target's compiler where there is none is an error naming the flag
    assert main(args + ["--compiler", "target"]) == 2
    assert "--compiler" in capsys.readouterr().err


@pytest.mark.parametrize("chip", ["h200", "v5p"])
def test_target_compile_of_the_sharded_step(chip):
    """With the [plan] extra: the whole sharded train step compiled by XLA:GPU / XLA:TPU for 8
    compile-only devices. Its arguments are the state the leaves count (+ the batch), the total
    is arguments + temporaries + outputs, and the peak's terms are named by this project's code.
    Every kernel of the step runs per shard (none outside a shard_map, tests/test_plan_kernels.py).

    The plan's compile stops after buffer assignment and reads its figures from the dump
    (train/plan/compile.py): the same step compiled to the end in this process, read by
    memory_analysis(), gives the same bytes: the stopped compile checked is the plan's own."""
    from k3jax.chips import CHIPS
    from target_compiler import require_target_compiler
    from train.plan.compile import compile_train_step

    require_target_compiler(CHIPS[chip].platform)
    cfg = load_config(TINY, SMALL + ["mesh.data=2", "mesh.fsdp=1", "mesh.expert=2", "mesh.tensor=2",
                                     "model.remat=full"])
    r = plan(cfg, 8, chip=chip, target=CHIPS[chip].platform)
    comp, pd = r["compiler"], r["per_device_bytes"]
    assert comp["kind"] == "target" and comp["devices"] == 8
    assert comp["topology"] == ("1x1x8" if chip == "h200" else "v5p:2x2x2")
    state = pd["params"] + pd["optimizer"] + pd["other_state"] + pd["batch"]
    if chip == "h200":
        assert pd["arguments"] == pytest.approx(state, rel=0.01)
    else:  # XLA:TPU stores each shard in whole (8, 128) tiles: at these tiny widths (64) most
        # of an array is padding, so the compiled arguments lie between the state and the state
        # with every shard padded to whole tiles (at K3's widths, multiples of 128, they agree)
        assert state <= pd["arguments"] <= _tpu_tiled_bytes(cfg)
    assert pd["total"] == pd["arguments"] + pd["temporaries"] + pd["outputs_not_aliased"]
    named = r["activation_terms"]
    assert any("k3jax/" in k for k in named) and sum(named.values()) >= pd["temporaries"] * 0.99
    assert comp["unsharded_kernels"] == []

    assert "buffer assignment" in comp["figures_from"]
    whole = compile_train_step(cfg, CHIPS[chip], 8, breakdown=False, to_the_end=True)
    assert whole.figures_from == "memory_analysis()"
    assert (pd["arguments"], pd["outputs_not_aliased"]) == (whole.arguments, whole.outputs_not_aliased)
    stopped = pd["temporaries"]
    if chip == "h200":  # equal when run alone (every run here); once, in the full suite on 2 cores,
        # the whole compile's temporaries came out 18,688 bytes (0.4 %) below the stopped one's,
        # not reproduced since: the planner's figure is held to within 1 %
        assert abs(stopped - whole.temporaries) <= 0.01 * whole.temporaries, (stopped, whole.temporaries)
    else:  # XLA:TPU adds a few MB after buffer assignment (train.plan.compile.buffer_assignment_figures)
        assert 0 <= whole.temporaries - stopped <= 10 * 2**20, (stopped, whole.temporaries)
    assert stopped > 0


def _tpu_tiled_bytes(cfg) -> int:
    """An upper bound on the train step's arguments on 8 TPU chips: each per-device shard's
    last two dims rounded up to whole tiles (8 x 128 for 4-byte, 16 x 128 for 2-byte types; a
    vector as one row of them, a scalar as one tile)."""
    from train.setup import prepare

    setup = prepare(cfg)
    total = 0
    for x in jax.tree.leaves(setup.abstract_args(cfg)):
        shape = list(x.sharding.shard_shape(x.shape)) if x.ndim else []
        rows = 8 * 4 // x.dtype.itemsize
        shape = [1, 1][len(shape):] + shape
        shape[-1] = -(-shape[-1] // 128) * 128
        shape[-2] = -(-shape[-2] // rows) * rows
        total += math.prod(shape) * x.dtype.itemsize
    return total


def test_chip_descriptions():
    """The chips' facts the planner defaults to, and the slices and topologies they compile for."""
    from k3jax.chips import CHIPS

    h200, v5p, v6e = CHIPS["h200"], CHIPS["v5p"], CHIPS["v6e"]
    assert (h200.hbm_gb, h200.peak_bf16_tflops, v5p.hbm_gb, v6e.hbm_gb) == (141.0, 989.0, 95.0, 32.0)
    assert h200.gpu_topology(2048) == "1x256x8" and h200.gpu_topology(4) == "1x1x4"
    text = h200.gpu_target_config()
    assert "core_count: 132" in text and "major: 9 minor: 0" in text and 'device_description_str: "NVIDIA H200"' in text
    assert f"device_memory_size: {141 * 2 ** 30}" in text and "memory_bandwidth: 4800000000000" in text
    assert v5p.tpu_topology(2048) == "v5p:16x16x8" and v5p.tpu_slice_name(2048) == "v5p-4096"
    assert v5p.tpu_topology(4) == "v5p:2x2x1" and v5p.tpu_host_bounds(2) == (2, 1, 1)
    assert v6e.tpu_topology(8) == "v6e:4x2" and v6e.tpu_topology(256) == "v6e:16x16"
    for bad in (lambda: v5p.tpu_topology(3), lambda: v6e.tpu_topology(512), lambda: h200.gpu_topology(12)):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ConfigError, match="--chip"):
        plan(tiny()[0], 1, target="gpu", chip="v5p", activations=False)


def test_fits_flips_with_the_memory_size():
    cfg, n = tiny()
    assert plan(cfg, n, hbm_gb=141, activations=False)["fits"]
    small = plan(cfg, n, hbm_gb=1e-3, activations=False)
    assert not small["fits"] and small["largest_terms"][0]["bytes"] >= small["largest_terms"][-1]["bytes"]


def test_cli_json(capsys):
    assert main(["--config", TINY, "--devices", "8", "--mesh", "data=2,fsdp=-1,expert=2,tensor=1", "--json",
                 "--target", "cpu", *SMALL]) == 0
    r = json.loads(capsys.readouterr().out)
    assert {"per_device_bytes", "fits", "hbm_bytes", "largest_terms", "all_to_all_bytes_per_moe_layer",
            "mesh", "flops", "target"} <= r.keys()
    assert set(r["per_device_bytes"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert r["mesh"] == {"data": 2, "fsdp": 2, "expert": 2, "context": 1, "tensor": 1}
    assert r["hbm_bytes"] == 141e9 and len(r["largest_terms"]) == 8 and r["target"] == "cpu"
    assert any(k.startswith("compiled (cpu)") for k in r["activation_terms"])


@pytest.mark.parametrize("args", [
    ["--devices", "8", "--mesh", "data=3,fsdp=1,expert=1,tensor=1"],   # 3 devices, not 8
    ["--devices", "8", "--mesh", "pipeline=8"],                         # no such axis
    ["--devices", "2", "--mesh", "data=1,fsdp=2,expert=1,tensor=1", "--batch", "3"],  # rows do not split
    ["--devices", "3", "--mesh", "data=1,fsdp=1,expert=3,tensor=1", "--batch", "3"],  # 16 experts over 3
    ["--devices", "1", "model.d_model=-1"],
])
def test_config_errors_exit_2(args, capsys):
    assert main(["--config", TINY, *args]) == 2
    assert capsys.readouterr().err.startswith("k3jax-plan: ")


def test_plan_raises_config_error_for_indivisible_batch():
    cfg, n = tiny(fsdp=2)
    with pytest.raises(ConfigError):
        plan(cfg, n, batch=3)


# ---------------------------------------------------------------------------------------
# launch scripts

SCRIPTS = ["local.sh", "slurm.sbatch", "tpu_pod.sh"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_launch_script_syntax(name):
    path = ROOT / "launch" / name
    assert path.stat().st_mode & stat.S_IXUSR
    subprocess.run(["bash", "-n", str(path)], check=True)
    assert "k3jax-train" in path.read_text()


def _stub_train(tmp_path, body: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "k3jax-train"
    stub.write_text("#!/usr/bin/env bash\n" + body)
    stub.chmod(0o755)
    # no nvidia-smi on PATH: the CPU branch, whatever this machine has
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "K3_LOG_DIR": str(tmp_path / "logs"), "K3_PORT": "23456",
            "HOME": os.environ.get("HOME", "/tmp")}


def test_local_launcher_starts_n_processes(tmp_path):
    env = _stub_train(tmp_path, 'echo "$* | $XLA_FLAGS" >> "$(dirname "$0")/../calls"\n')
    env["K3_CPU_DEVICES"] = "4"
    subprocess.run([str(ROOT / "launch" / "local.sh"), "2", "--config", "c.yaml", "a=1"], env=env, check=True,
                   cwd=tmp_path, timeout=30)
    calls = sorted((tmp_path / "calls").read_text().splitlines())
    assert len(calls) == 2
    for i, line in enumerate(calls):
        assert line.startswith("--config c.yaml a=1 distributed.coordinator=127.0.0.1:23456 "
                               f"distributed.num_processes=2 distributed.process_id={i} |")
        assert "--xla_force_host_platform_device_count=4" in line


def test_local_launcher_fails_when_a_process_fails(tmp_path):
    env = _stub_train(tmp_path, 'case "$*" in *process_id=1) exit 3;; esac; exec sleep 20\n')
    p = subprocess.run([str(ROOT / "launch" / "local.sh"), "2", "--config", "c.yaml"], env=env, cwd=tmp_path,
                       timeout=15, capture_output=True, text=True)
    assert p.returncode == 3, p.stderr  # and process 0 was stopped rather than waited for


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_tpu_hbm_refusal_is_read_as_the_plan():
    """XLA:TPU refuses (rather than compiles) a program over the chip's HBM; the planner reads
    the temporaries its message names (binary units, as XLA prints them)."""
    from train.plan.compile import hbm_overflow_bytes

    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
           "(4.79T) exceeds available HBM (95.73G). HLO module: jit_step.")
    assert hbm_overflow_bytes(msg) == int(4.79 * 2 ** 40)
    assert hbm_overflow_bytes(msg.replace("(4.79T)", "(512.5M)")) == int(512.5 * 2 ** 20)
    assert hbm_overflow_bytes("INTERNAL: something else") is None
