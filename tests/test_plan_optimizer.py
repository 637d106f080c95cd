"""train/plan/optimizer.py: the optimizer's FLOPs, collective bytes and seconds per device against
hand counts, its place in k3jax-plan's step and MFU, and the recipe configs (k3.yaml, k3-sft.yaml)."""

import json
import math
from pathlib import Path

import pytest

from k3jax.config import load_config
from train.muon_mesh import Bucket
from train.plan.cli import main, plan
from train.plan.optimizer import axis_links, bucket_traffic, rank_share

ROOT = Path(__file__).resolve().parents[1]
K3 = ROOT / "configs" / "k3.yaml"
SFT = ROOT / "configs" / "k3-sft.yaml"
TINY = str(ROOT / "configs" / "k3-tiny.yaml")
K3_MESH = {"data": 1, "fsdp": 4, "expert": 64, "context": 1, "tensor": 8}


def test_axis_links():
    """tensor fills an 8-GPU node: NVLink; the axes outside it cross nodes. A TPU's axes are ICI."""
    links = axis_links(K3_MESH, "gpu", 8)
    assert links == {"tensor": "nvlink", "context": "nvlink", "expert": "network", "fsdp": "network",
                     "data": "network"}
    small = axis_links({"data": 1, "fsdp": 2, "expert": 2, "context": 2, "tensor": 2}, "gpu", 8)
    assert (small["tensor"], small["context"], small["expert"], small["fsdp"]) == ("nvlink",) * 3 + ("network",)
    assert set(axis_links(K3_MESH, "tpu", 4).values()) == {"ici"}


def test_bucket_traffic_by_hand():
    """K3's layer-0 dense MLP on 2,048 H200s: 3 matrices [7168, 33792] a device in pieces of
    28 x 4,224 (bf16), exchanged over expert (64), fsdp (4), tensor (8). Each all-to-all pads the
    batch only to its own axis: 64 pieces (63 sent), then 4 of 64 (3 x 64 sent), then 8 of 256
    (7 x 256 sent, NVLink): one matrix a device. A bucket copied on each tensor rank: 22 matrices,
    3 per replica; the all-gather brings each device the other 7 replicas' 3."""
    links = axis_links(K3_MESH, "gpu", 8)
    dense = Bucket((0,), (28, 4224), 1, ((1, "expert"), (1, "fsdp"), (2, "tensor")), (), 3, 7168, 33792)
    piece = 28 * 4224 * 2
    per_chunk, exchange, gather = bucket_traffic(dense, K3_MESH, links, 2, 4)
    assert (per_chunk, gather) == ((1,), {})
    assert exchange == pytest.approx({"network": (63 + 3 * 64) * piece, "nvlink": 7 * 256 * piece})
    lora = Bucket((0,), (28, 3584), 1, ((2, "expert"), (2, "fsdp")), ("tensor",), 22, 3584, 7168)
    per_chunk, exchange, gather = bucket_traffic(lora, K3_MESH, links, 2, 4)
    piece = 28 * 3584 * 2
    assert per_chunk == (1,) and exchange == pytest.approx({"network": (63 + 3 * 64) * piece})
    assert gather == pytest.approx({"nvlink": 7 * 3 * piece})


def test_rank_share_by_hand():
    """One replicated leaf of 20 wide [16, 32] matrices on data=8 (H200 nodes of 8): each rank
    takes ceil(20 / 8) = 3 of them, one a chunk; 5 quintic steps of 4 r^2 c + 2 r^3 FLOPs each;
    the all-gather brings each rank the other 7 ranks' 3 bf16 matrices over NVLink. On data=16
    the same gather crosses nodes. One device has no buckets: refused, not counted as zero."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from optax.contrib import MuonDimensionNumbers

    leaf, dims = jax.ShapeDtypeStruct((20, 16, 32), jnp.float32), MuonDimensionNumbers(1, 2)
    sizes = {"data": 8, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    kw = dict(steps=5, itemsize=2, links_gbs={"nvlink": 450.0, "network": 50.0}, devices_per_node=8)
    got = rank_share([leaf], [dims], [P()], sizes, **kw)
    assert got["buckets"] == 1 and got["chunks"] == [(1, 16, 32)] * 3
    assert got["flops"] == 3 * 5 * (4 * 16 * 16 * 32 + 2 * 16 ** 3)
    assert got["all_gather_bytes"] == {"nvlink": 7 * 3 * 16 * 32 * 2}
    assert got["all_gather_s"] == pytest.approx(7 * 3 * 16 * 32 * 2 / 450e9)
    got = rank_share([leaf], [dims], [P()], sizes | {"data": 16}, **kw)
    assert [c[0] for c in got["chunks"]] == [1, 1] and got["all_gather_bytes"] == {"network": 15 * 2 * 16 * 32 * 2}
    with pytest.raises(ValueError, match="one device"):
        rank_share([leaf], [dims], [P()], sizes | {"data": 1}, **kw)


@pytest.fixture(scope="module")
def k3_plan():
    return plan(load_config(K3), 2048, chip="h200", activations=False)


def test_k3_optimizer_in_the_step(k3_plan):
    """configs/k3.yaml (Per-Head Muon, QK-Clip) on 2,048 H200s, state only. Its expert bucket
    by hand: w1, w2, w3 of 92 MoE layers x 896 experts, each [3072, 3584] on its wide side;
    each device holds 92 x 14 x 3 = 3,864 pieces, a quarter by an eighth of a matrix (fsdp 4 x
    tensor 8), so 3,864 / 32 -> 121 whole matrices a device, once each; the exchange sends 3/4 of
    the bf16 pieces over the network (fsdp) and 7/8 over NVLink (tensor), and the same back.
    The optimizer's seconds join the step (compute + exposed all-to-all + optimizer) and the MFU
    it implies, and stay within 3 % of it (issue 45's goal)."""
    r = k3_plan
    o, f = r["optimizer"], r["flops"]
    assert (o["name"], o["per_head"], o["qk_clip_tau"]) == ("muon", True, 100.0)
    experts = next(b for b in o["newton_schulz"]["buckets"] if b["matrix"] == [3072, 3584])
    f1 = 5 * (4 * 3072 ** 2 * 3584 + 2 * 3072 ** 3)
    # w1, w2, w3 of the 8 MoE layers of the stages' units (3 + 4 x 22 repeats + 1 = 92 layers)
    assert experts["matrices"] == 92 * 896 * 3 and experts["leaves"] == 3 * 8
    assert experts["matrices_per_device"] == math.ceil(92 * 14 * 3 / 32) == 121
    assert experts["flops_per_device"] == 121 * f1 and experts["replicas"] == 1
    piece = 3072 // 8 * 3584 // 4 * 2
    # chunks of 31, 30, 30, 30 matrices: 992, 960, 960, 952 pieces, multiples of 4; then 248 + 3 x 240
    # groups of 4 pieces, padded to multiples of 8
    assert experts["collective_bytes_per_device"] == pytest.approx(
        {"network": 2 * 3864 * piece * 3 / 4, "nvlink": 2 * (248 + 3 * 240) * 4 * piece * 7 / 8})
    ns = o["newton_schulz"]
    assert ns["repeated_factor"] == 1 and ns["flops_total"] >= 92 * 896 * 3 * f1
    assert ns["work_factor"] == pytest.approx(ns["flops_per_device"] * 2048 / ns["flops_total"])
    assert o["seconds"]["newton_schulz"] == pytest.approx(ns["flops_per_device"] / 989e12)
    assert o["flops_per_device"] == ns["flops_per_device"] + o["qk_clip"]["flops_per_device"] > 0
    # QK-Clip's blocked max logits: 24 MLA layers, 16 rows and 12 heads a device, 36 blocks of 512^2, D = 192
    assert o["qk_clip"]["flops_per_device"] == 16 * 12 * 24 * 36 * 2 * 192 * 512 ** 2
    s = o["seconds"]
    assert o["seconds_per_step"] == pytest.approx(s["newton_schulz"] + s["collectives_exposed"] + s["qk_clip"]
                                                  + s["elementwise"])
    assert s["collectives_exposed"] <= s["collectives_serial"] == pytest.approx(sum(o["collective_seconds"].values()))
    assert f["optimizer_seconds_per_step"] == o["seconds_per_step"]
    step = f["with_remat_recompute_s"] + f["all_to_all_exposed_seconds_per_step"] + f["optimizer_seconds_per_step"]
    assert f["step_seconds"] == pytest.approx(step)
    assert f["mfu"] == pytest.approx(f["model_flops_per_step"] / 2048 / 989e12 / step)
    assert f["optimizer_share_of_step"] <= 0.03


def test_sft_config_plans_qat_with_the_mxfp8_wire():
    """configs/k3-sft.yaml is k3.yaml's model with MXFP4/MXFP8 QAT and the MXFP8 expert wire, and
    the SFT settings. Its exchange against the same with bf16 rows: only the forward's dispatch
    carries the wire (remat keeps what the recompute would send; gradients go in bf16), so per
    token the difference is the dispatched rows x 3,584 x (2 - 33/32) bytes."""
    from train.plan.communication import Exchange, rows_per_token

    cfg, base = load_config(SFT), load_config(K3)
    assert (cfg.model.qat, cfg.model.moe.ep_wire, cfg.optimizer.muon_per_head, cfg.optimizer.qk_clip_tau) == \
        ("mxfp4", "auto", True, 100.0)
    from k3jax.config.load import diff_configs

    assert diff_configs(base.model, cfg.model, prefix="model.") == [("model.qat", "none", "mxfp4")]
    assert cfg.mesh == base.mesh and cfg.train.micro_batches == base.train.micro_batches
    assert cfg.optimizer.lr < base.optimizer.lr and cfg.data.sources[0].type == "text"
    r = plan(cfg, 2048, chip="h200", activations=False)
    plain = r["all_to_all_compute_dtype_wire"]
    assert r["all_to_all"]["wire"] == "mxfp8" and plain["wire"] == "bfloat16"
    rows = rows_per_token(cfg.model.moe, K3_MESH, Exchange())["network"]  # NVLink: the tensor group's weights
    mxfp8, bf16 = r["all_to_all"]["bytes_per_token"], plain["bytes_per_token"]
    assert bf16["network"] - mxfp8["network"] == pytest.approx(sum(rows.values()) * 3584 * (2 - 33 / 32))
    assert bf16["nvlink"] == mxfp8["nvlink"]
    assert sum(plain["kept_bytes_per_device"].values()) > sum(r["all_to_all"]["kept_bytes_per_device"].values())
    # k3.yaml itself has the bf16 wire: no comparison row
    assert plan(base, 2048, chip="h200", activations=False)["all_to_all_compute_dtype_wire"] is None


def test_text_report_has_the_optimizer_beside_the_model(capsys):
    """The text plan prints the optimizer's line beside the model's and the planned step, from
    the figures of --json."""
    args = ["--config", TINY, "--devices", "8", "--mesh", "data=1,fsdp=2,expert=2,tensor=2", "--state-only",
            "optimizer.name=muon", "optimizer.muon_per_head=true", "optimizer.qk_clip_tau=100"]
    assert main(args + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    out = capsys.readouterr().out
    opt = next(line for line in out.splitlines() if line.strip().startswith("optimizer ") and "Newton" in line)
    assert f"{r['optimizer']['flops_per_device']:10.3e}".strip() in opt and "muon per head, QK-Clip 100" in opt
    planned = next(line for line in out.splitlines() if line.startswith("planned step:"))
    assert f"the optimizer {r['flops']['optimizer_share_of_step']:.1%}" in planned
    assert "each orthogonalised by 1 device" in out


def test_tpu_counts_the_optimizer_collectives_serial():
    """XLA:TPU schedules the optimizer's all-to-alls synchronously (train/plan/optimizer.py): on
    a TPU nothing of them is hidden under Newton-Schulz; on a GPU the chunks' pipeline hides some."""
    cfg = load_config(TINY, ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2", "optimizer.name=muon"])
    tpu = plan(cfg, 8, chip="v5p", target="tpu", activations=False)["optimizer"]
    assert set(tpu["collective_bytes_per_device"]) == {"ici"}
    assert tpu["seconds"]["collectives_serial"] > 0
    assert tpu["seconds"]["collectives_exposed"] == pytest.approx(tpu["seconds"]["collectives_serial"])
    gpu = plan(cfg, 8, chip="h200", activations=False)["optimizer"]
    assert gpu["seconds"]["collectives_exposed"] <= gpu["seconds"]["collectives_serial"]
