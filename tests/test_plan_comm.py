"""train/plan/communication.py: the expert-parallel exchange's bytes per link against hand counts and
brute-force enumeration, the overlap formula by hand, and its place in k3jax-plan's report."""

import itertools
import json
import math
from pathlib import Path

import pytest

from k3jax.config import load_config
from k3jax.layers.ep_exchange import rows_per_destination
from train.plan.communication import VARIANTS, exchange_plan, pipeline_exposed

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "k3-tiny.yaml")  # 16 experts, top-4, latent 64, fp32, remat none


def test_rows_per_destination_by_enumeration():
    """E[ceil(S / W)] over every set of k of E experts, S = how many of the first g it holds."""
    for E, g, k, W in ((8, 3, 3, 2), (10, 4, 5, 4), (6, 6, 2, 1)):
        sets = list(itertools.combinations(range(E), k))
        want = sum(math.ceil(sum(e < g for e in s) / W) for s in sets) / len(sets)
        assert rows_per_destination(E, g, k, W) == pytest.approx(want, rel=1e-12)


def test_bytes_per_link_by_hand():
    """tiny on expert 4 x tensor 2 with 4 devices a node: 2 shards a node, 2 nodes. Per token and
    direction: r(8) network rows (one per remote node), 2 r(4) rows to the node's other shard and
    4 r(4) rows to the other tensor rank (ep_tensor=rows); each row moves 64 fp32 values + 4 ids
    and 4 weights out, 64 back, and in the backward 64 + 4 weight gradients and 64."""
    cfg = load_config(TINY, ["model.moe.ep_tensor=rows", "model.moe.ep_devices_per_node=4"])
    sizes = {"data": 1, "fsdp": 1, "expert": 4, "context": 1, "tensor": 2}
    r = exchange_plan(cfg, sizes, 1000)
    r8, r4 = 1 - math.comb(8, 4) / math.comb(16, 4), 1 - math.comb(12, 4) / math.comb(16, 4)
    row = (256 + 32) + 256 + (256 + 16) + 256
    assert r["shards_per_node"] == 2 and r["tensor"] == "rows" and r["wire"] == "float32"
    assert r["bytes_per_token"]["network"] == pytest.approx(r8 * row)
    assert r["bytes_per_token"]["nvlink"] == pytest.approx(6 * r4 * row)
    assert r["bytes_per_device"]["network"] == pytest.approx(500 * r8 * row)  # 1000 tokens over 2 tensor ranks
    assert r["seconds"]["network"] == pytest.approx(500 * r8 * row / 50e9)
    # the tensor group sharing weights instead: no rows to the other rank, the shard's 4 experts'
    # 3 x 64 x 64 weights gathered (half of them come over NVLink) in fp32, forward and backward
    w = exchange_plan(load_config(TINY, ["model.moe.ep_tensor=weights", "model.moe.ep_devices_per_node=4"]),
                      sizes, 1000)
    assert w["bytes_per_token"]["nvlink"] == pytest.approx(2 * r4 * row)
    assert w["expert_weights_bytes_per_device"]["nvlink"] == pytest.approx(2 * 0.5 * 4 * 3 * 64 * 64 * 4)


def test_remat_keeps_by_hand():
    """tiny on expert 4 x tensor 2 (as above) under remat=full: the recompute sends a row's
    288 B out and 256 B back again; with moe.ep_keep_results only the 288 B, with
    ep_keep_received too nothing. What remat keeps instead, per MoE layer: the results, 500
    tokens a device x 64 x fp32; the receive buffers of 2 chunks of 250 tokens: 250 rows to the
    remote node (2 x 250 x r(8) = 481 expected, at most 250), 500 to the other shard (2 x 500 x
    r(4) = 729 expected, at most 500), so 1,000 rows, 2,000 after the tensor group's gather,
    each 64 fp32 values + 4 ids + 4 weights."""
    sizes = {"data": 1, "fsdp": 1, "expert": 4, "context": 1, "tensor": 2}
    base = ["model.moe.ep_tensor=rows", "model.moe.ep_devices_per_node=4", "model.remat=full"]
    r8 = 1 - math.comb(8, 4) / math.comb(16, 4)
    row = (256 + 32) + 256 + (256 + 16) + 256
    for keep, recompute in (([], 288 + 256), (["model.moe.ep_keep_results=true"], 288),
                            (["model.moe.ep_keep_results=true", "model.moe.ep_keep_received=true"], 0)):
        r = exchange_plan(load_config(TINY, base + keep), sizes, 1000)
        assert r["bytes_per_token"]["network"] == pytest.approx(r8 * (row + recompute))
    assert r["kept_bytes_per_device"] == pytest.approx({"results": 500 * 64 * 4, "received": 2 * 2000 * (256 + 32)})
    none = exchange_plan(load_config(TINY, base), sizes, 1000)["kept_bytes_per_device"]
    assert none == {"results": 0.0, "received": 0.0}


def test_k3_all_to_all_within_the_compute():
    """Issue 22's goal for configs/k3.yaml on 2,048 H200s (bf16, its own defaults): the planned
    all-to-all time per step is at most the step's compute with the recompute; without the
    remat keeps it is not."""
    from train.plan.estimate import step_compute_seconds

    cfg = load_config(ROOT / "configs" / "k3.yaml", ["mesh.fsdp=4"])
    sizes = {"data": 1, "fsdp": 4, "expert": 64, "context": 1, "tensor": 8}
    compute = step_compute_seconds(cfg, 2048)
    assert cfg.model.qat == "none" and cfg.model.remat == "full"
    assert 92 * exchange_plan(cfg, sizes, 16 * 4096)["seconds_total"] <= compute
    plain = exchange_plan(cfg, sizes, 16 * 4096, exchange=VARIANTS["3. + one row per (token, node)"])
    assert 92 * plain["seconds_total"] > compute


def test_before_is_the_old_count_for_k3():
    """The exchange before the changes reproduces what k3jax-plan counted for configs/k3.yaml on
    2,048 H200s (issue 22): 44.4 GB per MoE layer per device, 81.7 s a step at 50 GB/s."""
    cfg = load_config(ROOT / "configs" / "k3.yaml", ["mesh.fsdp=4"])
    sizes = {"data": 1, "fsdp": 4, "expert": 64, "context": 1, "tensor": 8}
    before = exchange_plan(cfg, sizes, 16 * 4096, exchange=VARIANTS["before"])
    assert before["bytes_per_device"]["network"] == pytest.approx(44.4e9, rel=1e-3)
    assert 92 * before["seconds"]["network"] == pytest.approx(81.7, rel=1e-3)
    after = exchange_plan(cfg, sizes, 16 * 4096)
    assert after["bytes_per_device"]["network"] < before["bytes_per_device"]["network"] / 8


def test_exposed_time_by_hand():
    """Two chunks, dispatch 4 s, return 4 s, experts 6 s, shared experts 1 s: the first dispatch
    and last return (2 + 2 s) have 1 s of shared experts under them; chunk 1's dispatch (2 s)
    and chunk 0's return (2 s) each hide under a chunk's experts (3 s): 3 s exposed. One chunk:
    everything but the shared experts' second."""
    assert pipeline_exposed(4.0, 4.0, 6.0, 1.0, 2) == pytest.approx(3.0)
    assert pipeline_exposed(4.0, 4.0, 6.0, 1.0, 1) == pytest.approx(7.0)
    assert pipeline_exposed(4.0, 4.0, 2.0, 0.0, 2) == pytest.approx(4.0 + 1.0 + 1.0)  # experts too short: 1 s each shows
    # four chunks: ends 1 + 1, two middle steps of 2 s against 1.5 s of experts, the edges 1 s each
    assert pipeline_exposed(4.0, 4.0, 6.0, 0.0, 4) == pytest.approx(2.0 + 2 * 0.5)


def test_plan_reports_the_exchange_beside_the_compute():
    from train.plan.cli import plan

    cfg = load_config(TINY, ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"])
    r = plan(cfg, 8, activations=False)
    f = r["flops"]
    assert f["all_to_all_seconds_per_step"] == r["all_to_all_seconds_per_step"] > 0
    assert 0 < f["all_to_all_exposed_seconds_per_step"] == r["all_to_all_exposed_seconds_per_step"]
    assert r["all_to_all_seconds_per_step"] == pytest.approx(7 * r["all_to_all"]["seconds_total"])  # 7 MoE layers
    tpu = plan(cfg, 8, activations=False, target="tpu")["all_to_all"]
    assert set(tpu["bytes_per_device"]) == {"ici"} and tpu["shards_per_node"] == 2


def test_exchange_changes_command(capsys):
    """k3jax-plan --exchange-changes (what `python -m k3jax.plan_comm` printed): one JSON row per
    variant, each the exchange plan of that variant on the mesh; the table has a line for each."""
    from train.plan.cli import main

    args = ["--exchange-changes", "--config", TINY, "--devices", "8", "--mesh", "data=1,fsdp=-1,expert=4,tensor=2",
            "model.moe.ep_devices_per_node=4"]
    assert main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["change"] for r in rows] == list(VARIANTS)
    cfg = load_config(TINY, ["mesh.data=1", "mesh.fsdp=-1", "mesh.expert=4", "mesh.tensor=2",
                             "model.moe.ep_devices_per_node=4"])
    sizes = {"data": 1, "fsdp": 1, "expert": 4, "context": 1, "tensor": 2}
    tokens = cfg.train.batch_size // 4 * cfg.data.seq_len  # rows split over data * fsdp * expert = 4
    moe_layers = sum(cfg.model.ffn_kind(i) == "moe" for i in range(cfg.model.num_layers))
    for r in rows:
        want = exchange_plan(cfg, sizes, tokens, exchange=VARIANTS[r["change"]], moe_layers=moe_layers)
        assert r["bytes_per_token"] == pytest.approx(want["bytes_per_token"])
    assert main(args) == 0
    table = capsys.readouterr().out.splitlines()
    assert "on 8 devices" in table[0] and all(any(line.startswith(v) for line in table) for v in VARIANTS)
