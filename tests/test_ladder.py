"""k3jax-ladder: a tiny run of the two new rungs (softmax_conv, mla) over two seeds and its resume,
every rung's cost row against hand-computed decode-state bytes, the seeded claims on hand-made
rows that agree, disagree and tie, the resume rule (a key added at its default does not orphan
rows, a changed value does), the learning-rate sweep's order and best rate with a stand-in
trainer, and the recipe command's bookkeeping; ledgers of launches that split the rungs, merged rung by rung."""

import json
import math
from dataclasses import replace as dc_replace
from pathlib import Path

import numpy as np
import pytest

from k3jax.config import ConfigError, load_config
from train.ladder import cli
from train.ladder import tasks as T
from train.ladder.claims import Paired, check_claims, judge
from train.ladder.fingerprint import function_changes, function_dict
from train.ladder.runs import best_lrs
from train.ladder.sizes import (RUNGS, SIZES, Width, default_configs_dir, periodic_unit, rung_config, rung_pattern,
                                total_params)

NEW = ("softmax_conv", "mla")
K3_SMALL = Path(__file__).resolve().parents[1] / "configs" / "k3-small.yaml"
ROW_KEYS = {
    "mqar": {"rung", "task", "seed", "d_model", "lr", "pairs", "seq_len", "accuracy", "params", "steps"},
    "lm": {"rung", "task", "seed", "step", "tokens", "eval_loss", "params"},
    "cost": {"rung", "task", "tokens_per_s", "state_bytes_4k", "state_bytes_128k"},
}
ROW_KEYS["mqar_overwrite"] = ROW_KEYS["mqar"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The new rungs trained (recall + overwrite, LM) at seeds 0 and 1, a few steps each."""
    out = tmp_path_factory.mktemp("ladder")
    assert cli.main(["--size", "smoke", "--out", str(out), "--rungs", ",".join(NEW)]) == 0
    return out, json.loads((out / "ladder.json").read_text())


@pytest.fixture(scope="module")
def costs(tmp_path_factory):
    """Every rung's cost row (no training): matched parameters and decode-state bytes."""
    out = tmp_path_factory.mktemp("ladder_cost")
    assert cli.main(["--size", "smoke", "--out", str(out), "--tasks", "cost"]) == 0
    return json.loads((out / "ladder.json").read_text())


def cell_text(values) -> str:
    """What ladder.md should print for the seeds' values, computed here: mean (max - min)."""
    return f"{np.mean(values):.3f} ({np.max(values) - np.min(values):.3f})"


def markdown_table(md: str, heading: str) -> list[list[str]]:
    """The cells of the first table after the line starting with `heading`: header row first."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    table = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip("|").split("|")])
        elif table:
            break
    return [table[0], *table[2:]]  # without the |---| rule


def test_smoke_new_rungs_every_task_and_seed(smoke):
    out, data = smoke
    rows = data["rows"]
    for rung in NEW:
        for task, keys in ROW_KEYS.items():
            mine = [r for r in rows if r["rung"] == rung and r["task"] == task]
            assert mine, (rung, task)
            for r in mine:
                assert set(r) == keys, r
                assert all(math.isfinite(v) for k, v in r.items() if k not in ("rung", "task")), r
            if task != "cost":
                assert {r["seed"] for r in mine} == {0, 1}
        lm = [r for r in rows if r["rung"] == rung and r["task"] == "lm"]
        assert sorted(r["step"] for r in lm if r["seed"] == 0) == [2, 4]  # 2 evals over 4 steps
        assert all(0 < r["eval_loss"] < 2 * math.log(320) for r in lm)
        # the two seeds start from other weights: their losses differ
        assert {r["eval_loss"] for r in lm if r["seed"] == 0}.isdisjoint({r["eval_loss"] for r in lm if r["seed"] == 1})
    assert data["rungs"]["softmax_conv"]["function"]["lm"]["model"]["attention"]["conv_size"] == 4
    assert data["rungs"]["mla"]["layer_pattern"] == "4*(mla)"
    md = (out / "ladder.md").read_text()
    # the tables print ladder.json's seeds as mean (spread), cell by cell
    header, *lines = markdown_table(md, "## Recall (MQAR)")
    assert [line[0] for line in lines] == list(NEW) and header[3] == "seeds"
    for line in lines:
        (pairs, length), = [c.split(" pairs @ ") for c in header[4:]]
        accs = [r["accuracy"] for r in rows if r["rung"] == line[0] and r["task"] == "mqar"
                and r["pairs"] == int(pairs) and r["seq_len"] == int(length)]
        assert line[3] == "2" and line[4] == cell_text(accs)
    header, *lines = markdown_table(md, "## Language modelling")
    for line in lines:
        last = [r["eval_loss"] for r in rows if r["rung"] == line[0] and r["task"] == "lm" and r["step"] == 4]
        assert line[-1] == cell_text(last)
    for png in ("ladder_recall.png", "ladder_lm.png", "ladder_cost.png", "ladder_train_loss.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_rung_matched_and_decode_state_bytes_by_hand(costs):
    params = {r: costs["rungs"][r]["params"] for r in RUNGS}
    assert all(abs(p / params["kda"] - 1) < 0.03 for p in params.values()), params
    ffn = costs["rungs"]["mla"]["ffn_hidden"]
    assert total_params(rung_config(SIZES["smoke"], "mla", default_configs_dir(), ffn_hidden=ffn).model) == params["mla"]
    cost = {r["rung"]: r for r in costs["rows"] if r["task"] == "cost"}
    # smoke: 4 layers, d_model 32, one head of 32, float32 (4 bytes), conv 4 (3 cached steps)
    layers, heads, dk, f32, conv_steps = 4, 1, 32, 4, 3
    kv_per_token = layers * 2 * heads * dk * f32
    windows = layers * 3 * conv_steps * heads * dk * f32  # q/k/v windows
    assert cost["softmax"]["state_bytes_4k"] == 4096 * kv_per_token
    assert cost["softmax"]["state_bytes_128k"] == 131072 * kv_per_token
    assert cost["softmax_conv"]["state_bytes_4k"] == 4096 * kv_per_token + windows
    recurrent = layers * heads * dk * dk * f32 + windows
    for rung in ("linear", "deltanet", "gated_deltanet", "kda"):
        assert cost[rung]["state_bytes_4k"] == cost[rung]["state_bytes_128k"] == recurrent
    # MLA caches its latent (16) and shared rope key (8) per token; the hybrid in 1 layer of 4
    assert cost["mla"]["state_bytes_4k"] == 4096 * layers * (16 + 8) * f32
    assert cost["hybrid"]["state_bytes_4k"] == 3 * recurrent // layers + 4096 * (16 + 8) * f32
    (state,) = [c for c in check_claims(costs["rows"], None) if c["source"] == "by construction"]
    assert state["verdict"] == "agrees"


def test_smoke_resumes_and_the_fingerprint_rule(smoke, capsys):
    out, before = smoke
    original = (out / "ladder.json").read_text()
    try:
        # the same command: nothing trains; a knob (how, not what) resumes too
        assert cli.main(["--size", "smoke", "--out", str(out), "--rungs", ",".join(NEW),
                         "--set", "model.attention.impl=xla"]) == 0
        assert ": training" not in capsys.readouterr().out
        assert json.loads((out / "ladder.json").read_text())["rows"] == before["rows"]
        # a changed value orphans the rows: refused, naming the file and the key
        assert cli.main(["--size", "smoke", "--out", str(out), "--set", "optimizer.lr=1e-4"]) == 2
        err = capsys.readouterr().err
        assert "ladder.json" in err and "optimizer.lr" in err
        # rows measured before a key existed (it is missing from their stored function) resume when
        # the key is at its default: the mla rung's model.attention.conv_size (0)
        edited = json.loads(original)
        del edited["rungs"]["mla"]["function"]["recall"]["model"]["attention"]["conv_size"]
        (out / "ladder.json").write_text(json.dumps(edited))
        assert cli.main(["--size", "smoke", "--out", str(out), "--rungs", "mla"]) == 0
        assert ": training" not in capsys.readouterr().out
        # ... and not where the rung sets it: softmax_conv's is 4, so those rows were measured without it
        edited = json.loads(original)
        del edited["rungs"]["softmax_conv"]["function"]["lm"]["model"]["attention"]["conv_size"]
        (out / "ladder.json").write_text(json.dumps(edited))
        assert cli.main(["--size", "smoke", "--out", str(out), "--rungs", "softmax_conv"]) == 2
        err = capsys.readouterr().err
        assert "softmax_conv rung" in err and "softmax_conv.yaml" in err and "model.attention.conv_size: 0 -> 4" in err
        assert json.loads((out / "ladder.json").read_text()) == edited  # the file is left as it was
        # the seeds are the ladder's own
        assert cli.main(["--size", "smoke", "--out", str(out), "--set", "train.seed=3"]) == 2
        assert "--seeds" in capsys.readouterr().err
    finally:
        (out / "ladder.json").write_text(original)


def _part(data: dict, keep) -> dict:
    """A copy of a ledger holding only the runs whose key `keep` accepts."""
    part = json.loads(json.dumps(data))
    part["done"] = [k for k in data["done"] if keep(k)]
    part["timing"] = {k: v for k, v in data["timing"].items() if keep(k)}
    rungs = {k.split("/")[0] for k in part["done"]}
    part["rows"] = [r for r in data["rows"] if r["rung"] in rungs and any(
        k == f"{r['rung']}/cost" if r["task"] == "cost" else
        k.startswith(f"{r['rung']}/{r['task']}/") and k.endswith(f"/s{r['seed']}") for k in part["done"])]
    return part


def test_merge_split_launches_rung_by_rung(smoke, tmp_path, capsys):
    _, full = smoke
    # two processes resumed one ledger holding softmax_conv's seed-0 runs; one trained the rest of
    # softmax_conv, the other mla
    a = _part(full, lambda k: k.startswith("softmax_conv/"))
    b = _part(full, lambda k: k.startswith("mla/") or (k.startswith("softmax_conv/") and k.endswith("/s0")))
    assert b["done"] and set(a["done"]) - set(b["done"]) and set(b["done"]) - set(a["done"])
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    merged_dir = tmp_path / "merged"
    assert cli.main(["--merge", str(pa), str(pb), "--out", str(merged_dir)]) == 0
    merged = json.loads((merged_dir / "ladder.json").read_text())
    assert sorted(merged["done"]) == sorted(full["done"])
    assert sorted(map(json.dumps, merged["rows"])) == sorted(map(json.dumps, full["rows"]))
    assert merged["timing"] == full["timing"] and merged["rungs"] == full["rungs"]
    assert merged["environment"] == full["environment"]
    # the tables drawn from the merge are those of the unsplit ledger
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "ladder.json").write_text(json.dumps(full))
    assert cli.main(["--report-only", "--out", str(whole)]) == 0
    assert (merged_dir / "ladder.md").read_text() == (whole / "ladder.md").read_text()
    # --out's own ledger is merged too: merging b again into it changes nothing
    assert cli.main(["--merge", str(pb), "--out", str(merged_dir)]) == 0
    assert sorted(json.loads((merged_dir / "ladder.json").read_text())["done"]) == sorted(full["done"])
    capsys.readouterr()
    # launches on two devices: both named
    b["environment"]["device"] = "gpu (another)"
    pb.write_text(json.dumps(b))
    assert cli.main(["--merge", str(pa), str(pb), "--out", str(tmp_path / "two")]) == 0
    device = json.loads((tmp_path / "two" / "ladder.json").read_text())["environment"]["device"]
    assert device == f"{a['environment']['device']} and gpu (another)"
    # two launches that each trained runs of one rung the other lacks: refused, naming the rung
    c = _part(full, lambda k: k.startswith("softmax_conv/") and k.endswith("/s1"))
    d = _part(full, lambda k: k.startswith("softmax_conv/") and k.endswith("/s0"))
    pc, pd = tmp_path / "c.json", tmp_path / "d.json"
    pc.write_text(json.dumps(c))
    pd.write_text(json.dumps(d))
    assert cli.main(["--merge", str(pc), str(pd), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "softmax_conv rung" in err and "c.json" in err and not (tmp_path / "x" / "ladder.json").exists()
    # other settings, or another function of a rung measured in both: refused
    e = json.loads(json.dumps(b))
    e["settings"]["recall"]["train_length"] += 1
    pe = tmp_path / "e.json"
    pe.write_text(json.dumps(e))
    assert cli.main(["--merge", str(pa), str(pe), "--out", str(tmp_path / "x")]) == 2
    assert "recall.train_length" in capsys.readouterr().err
    f = json.loads(json.dumps(b))
    f["rungs"]["softmax_conv"]["function"]["lm"]["optimizer"]["lr"] = 1.0
    pf = tmp_path / "f.json"
    pf.write_text(json.dumps(f))
    assert cli.main(["--merge", str(pa), str(pf), "--out", str(tmp_path / "x")]) == 2
    assert "softmax_conv rung was measured with another config" in capsys.readouterr().err


def test_parallel_processes_give_the_sequential_rows(smoke, tmp_path, capsys):
    """--parallel 2: each new rung in its own child process, the ledgers merged: the same rows as
    the one-process launch (same seeds, same CPU), every timing marked as measured on a shared
    device, and the cost table's tokens/s left out for it."""
    _, full = smoke
    out = tmp_path / "par"
    assert cli.main(["--size", "smoke", "--out", str(out), "--rungs", ",".join(NEW), "--parallel", "2"]) == 0
    printed = capsys.readouterr().out
    assert "part0 trains softmax_conv" in printed and "part1 trains mla" in printed
    assert "part0 exit 0: k3jax-ladder: every run is done" in printed
    par = json.loads((out / "ladder.json").read_text())
    assert sorted(par["done"]) == sorted(full["done"])

    def key(r):
        return json.dumps({k: v for k, v in r.items() if k not in ("accuracy", "eval_loss", "tokens_per_s")},
                          sort_keys=True)
    seq = {key(r): r for r in full["rows"]}
    assert len(seq) == len(par["rows"])
    for r in par["rows"]:
        s_row = seq[key(r)]
        for k in ("accuracy", "eval_loss"):
            if k in r:
                assert r[k] == pytest.approx(s_row[k], rel=1e-5, abs=1e-6), (key(r), k)
        if r["task"] == "cost":
            assert r["tokens_per_s"] is None and s_row["tokens_per_s"] > 0
    assert all(v.get("shared_device") == 2 for k, v in par["timing"].items() if not k.endswith("/cost"))
    md = (out / "ladder.md").read_text()
    assert "| mla | — |" in md and "beside 1 other ladder process(es)" in md
    # run again: every run is done, no child starts
    assert cli.main(["--size", "smoke", "--out", str(out), "--rungs", ",".join(NEW), "--parallel", "2"]) == 0
    assert "nothing for --parallel to start" in capsys.readouterr().out
    # --parallel trains: with --report-only (which trains nothing) it is refused by name
    assert cli.main(["--size", "smoke", "--out", str(out), "--parallel", "2", "--report-only"]) == 2
    assert "--parallel" in capsys.readouterr().err


def test_parallel_groups_and_what_is_left():
    from train.ladder.parallel import expected_runs, groups, rungs_left

    zoo = SIZES["zoology"]
    # zoology: 2 widths x (3 rates at seed 0 + seed 1 at the best) x 1 task
    assert expected_runs(zoo, ("mqar",), (0, 1)) == 2 * (3 + 1)
    smoke = SIZES["smoke"]  # no sweep: 2 seeds x (2 recall tasks + lm) + cost
    assert expected_runs(smoke, ("mqar", "mqar_overwrite", "lm", "cost"), (0, 1)) == 2 * 3 + 1
    done = [f"kda/mqar/d{d}/lr{lr}/s0" for d in (128, 256) for lr in (0.001, 0.0032, 0.01)]
    assert rungs_left(zoo, ["kda", "mla"], ("mqar",), (0, 1), done) == ["kda", "mla"]
    done += ["kda/mqar/d128/lr0.001/s1", "kda/mqar/d256/lr0.001/s1"]
    assert rungs_left(zoo, ["kda", "mla"], ("mqar",), (0, 1), done) == ["mla"]
    assert groups(list(RUNGS), 3) == [["softmax", "deltanet", "hybrid"], ["softmax_conv", "gated_deltanet", "mla"],
                                      ["linear", "kda"]]
    assert groups(["kda"], 4) == [["kda"]]
    # zoology-mix: two rates at seed 0 + seed 1 at the best, per width
    assert expected_runs(SIZES["zoology-mix"], ("mqar",), (0, 1)) == 2 * (2 + 1)


def test_parallel_children_split_the_inherited_memory_fraction():
    """gpu_env.sh exports 0.92 for one process: N children get 0.92 / N each, not 0.92 each."""
    from train.ladder.parallel import MEMORY_SHARE, child_env
    key = "XLA_PYTHON_CLIENT_MEM_FRACTION"
    assert child_env({key: "0.92", "A": "1"}, 2) == {key: "0.460", "A": "1"}
    assert float(child_env({}, 4)[key]) == pytest.approx(MEMORY_SHARE / 4, abs=5e-4)
    for bad in ("lots", "1.5", "0"):
        with pytest.raises(SystemExit, match=key):
            child_env({key: bad}, 2)


def test_parallel_summary_names_each_childs_outcome_not_its_last_notice():
    """On a GPU a child prints tokamax's untuned-shape count after its "every run is done" line; the
    parent's summary reports the outcome line (the 2026-12-07 H100 calls printed the notice)."""
    from train.ladder.parallel import status_line
    notice = "k3jax-ladder: tokamax: 3 kernel shapes without a tuned config for NVIDIA H100 80GB HBM3"
    assert status_line(f"training\nk3jax-ladder: every run is done\n{notice}\n") == "k3jax-ladder: every run is done"
    assert status_line(f"k3jax-ladder: unfinished rungs: kda\n{notice}") == "k3jax-ladder: unfinished rungs: kda"
    assert status_line("Traceback (most recent call last):\nValueError: bad\n\n") == "ValueError: bad"
    assert status_line("") == "(no output)"


def test_zoology_mix_trains_on_zoologys_mixture():
    """Zoology's original_mqar_configs, by hand: 100 k x (4 pairs, 64 tokens), 20 k x (8, 128),
    20 k each x (16 | 32 | 64, 256): token shares proportional to examples x length."""
    size = SIZES["zoology-mix"]
    cfg = rung_config(size, "kda", default_configs_dir(), cli.recall_overrides(size), (), width=size.widths[0])
    zoology = [(100_000, 4, 64), (20_000, 8, 128), (20_000, 16, 256), (20_000, 32, 256), (20_000, 64, 256)]
    tokens = np.array([n * length for n, _, length in zoology], float)
    got = [(s.mqar_pairs, s.mqar_length, s.mqar_queries, s.mqar_overwrites) for s in cfg.data.sources]
    assert got == [(p, length, p, 0) for _, p, length in zoology]
    weights = np.array([s.weight for s in cfg.data.sources])
    np.testing.assert_allclose(weights / weights.sum(), tokens / tokens.sum(), rtol=1e-12)
    assert cfg.data.seq_len == 256 and cfg.train.steps == 8000 and cfg.model.vocab_size == 8192


def test_function_changes_both_directions():
    cfg = load_config(default_configs_dir() / "kda.yaml", ["train.steps=7"])
    stored = json.loads(json.dumps(function_dict(cfg)))  # as ladder.json holds it
    assert function_changes(stored, cfg) == []
    # seeds and knobs are no part of the function
    again = load_config(default_configs_dir() / "kda.yaml", ["train.steps=7", "train.seed=5", "data.seed=5",
                                                             "model.kda.impl=xla", "train.loss_chunk=0"])
    assert function_changes(stored, again) == []
    # a key missing from the stored dict (added to the schema since): fine at its default ...
    older = json.loads(json.dumps(stored))
    del older["model"]["kda"]["gate_rank"]
    assert function_changes(older, cfg) == []
    # ... not where the config sets it (the ladder's gates start open: dt_bias_init -4, default 0)
    del older["model"]["kda"]["dt_bias_init"]
    assert function_changes(older, cfg) == [("model.kda.dt_bias_init", 0.0, -4.0)]
    # a changed value; a key this version does not have
    changed = load_config(default_configs_dir() / "kda.yaml", ["train.steps=8"])
    assert function_changes(stored, changed) == [("train.steps", 7, 8)]
    unknown = json.loads(json.dumps(stored))
    unknown["model"]["kda"]["retired_knob"] = 1
    (diff,) = function_changes(unknown, cfg)
    assert "retired_knob" in diff[0] + diff[1]


def test_seeded_verdicts_on_hand_made_rows():
    def lm(rung, losses):
        return [{"rung": rung, "task": "lm", "seed": s, "step": 10, "tokens": 100, "eval_loss": v, "params": 1}
                for s, v in enumerate(losses)]

    def verdict(rows, words):
        (c,) = [c for c in check_claims(rows, None) if words in c["claim"]]
        return c

    gate = "forget gate on top of the delta rule lowers"
    # every seed lower by more than the spread: agrees (means 0.900 vs 1.000, spreads 0.02 and 0.01)
    c = verdict(lm("gated_deltanet", [0.89, 0.90, 0.91]) + lm("deltanet", [1.00, 0.995, 1.005]), gate)
    assert c["verdict"] == "agrees" and "3 seeds, holds in 3" in c["evidence"]
    # every seed higher by more than the spread: disagrees, with the likeliest reason
    c = verdict(lm("gated_deltanet", [1.10, 1.12]) + lm("deltanet", [1.00, 1.01]), gate)
    assert c["verdict"] == "disagrees" and c["likely_if_not"]
    # a tie: the seeds disagree with each other ...
    c = verdict(lm("gated_deltanet", [0.95, 1.02]) + lm("deltanet", [1.00, 1.00]), gate)
    assert c["verdict"] == "not settled at this budget" and "holds in 1" in c["evidence"]
    # ... or every seed agrees but the mean difference (0.015) is inside the spread (0.02)
    c = verdict(lm("gated_deltanet", [0.96, 0.98]) + lm("deltanet", [0.98, 0.99]), gate)
    assert c["verdict"] == "not settled at this budget"
    # one seed never settles a claim, however large the difference
    c = verdict(lm("gated_deltanet", [0.5]) + lm("deltanet", [1.0]), gate)
    assert c["verdict"] == "not settled at this budget" and "one seed" in c["evidence"]
    # the rule itself on a threshold claim: 0.95 and 0.91 are both above 0.9, but 0.93 - 0.9 < 0.04
    assert judge(Paired({0: 0.95, 1: 0.91}, {0: 0.9, 1: 0.9}, "a", "b"))[0] == "not settled at this budget"
    assert judge(Paired({0: 1.0, 1: 0.99}, {0: 0.9, 1: 0.9}, "a", "b"))[0] == "agrees"
    assert judge(Paired({0: 1.0}, {1: 0.9}, "a", "b"))[0] is None  # no seed in common: not measured
    # two rungs at chance with no spread: a difference below the tables' last digit orders nothing
    assert judge(Paired({0: 0.0002, 1: 0.0002}, {0: 0.0006, 1: 0.0006}, "a", "b"))[0] == "not settled at this budget"
    assert judge(Paired({0: 0.0002, 1: 0.0002}, {0: 0.0022, 1: 0.0022}, "a", "b"))[0] == "disagrees"


def test_recall_claims_per_width_at_the_best_rate():
    def recall(rung, d, lr, seed, accs, length=64, task="mqar"):
        return [{"rung": rung, "task": task, "seed": seed, "d_model": d, "lr": lr, "pairs": p, "seq_len": length,
                 "accuracy": a, "params": 1, "steps": 1} for p, a in zip((4, 8, 16), accs)]

    rows = []
    for d in (64, 128):
        for seed in (0, 1):
            # softmax_conv: 1e-3 solves it, 1e-2 does not (the best rate must be chosen, not averaged)
            rows += recall("softmax_conv", d, 1e-3, seed, (1.0, 1.0, 0.98 + 0.01 * seed))
            rows += recall("softmax_conv", d, 1e-2, seed, (0.3, 0.2, 0.1))
            rows += recall("linear", d, 1e-3, seed, (0.9, 0.5 + 0.02 * seed, 0.2))
            rows += recall("softmax_conv", d, 1e-3, seed, (0.2, 0.1, 0.05), length=256)
    assert best_lrs(rows, 64) == {("softmax_conv", 64): 1e-3, ("softmax_conv", 128): 1e-3, ("linear", 64): 1e-3,
                                  ("linear", 128): 1e-3}
    claims = check_claims(rows, 64)
    solves = [c for c in claims if "solves MQAR" in c["claim"]]
    assert [c["claim"].rsplit(" [", 1)[1] for c in solves] == ["d_model 64]", "d_model 128]"]
    assert all(c["verdict"] == "agrees" for c in solves)  # 0.997 and 0.993 per seed, spread 0.003 < 0.095
    (beats,) = [c for c in claims if "(with its short conv) recalls better" in c["claim"] and "64]" in c["claim"]]
    assert beats["verdict"] == "agrees"
    (falls,) = [c for c in claims if "fixed-size state" in c["claim"] and "128]" in c["claim"]]
    assert falls["verdict"] == "agrees"  # 0.9 -> 0.2 in both seeds
    (rope,) = [c for c in claims if "degrades on sequences longer" in c["claim"] and "64]" in c["claim"]]
    assert rope["verdict"] == "agrees"  # loses ~0.87 at 256 in both seeds, far above 0.05
    # a rung that never learned at its trained length says nothing about longer ones
    unlearned = [dict(r, accuracy=0.3) if r["rung"] == "softmax_conv" else r for r in rows]
    (rope,) = [c for c in check_claims(unlearned, 64) if "longer" in c["claim"] and "64]" in c["claim"]]
    assert rope["verdict"] == "inconclusive"


@pytest.fixture
def sweep_size(monkeypatch):
    """A two-width, two-rate size (the zoology size's shape at the smoke size's scale), trained by
    a stand-in whose accuracy is known here: 1e-3 is the better rate at width 32, 3e-3 at 48."""
    base = SIZES["smoke"]
    widths = tuple(Width(d, (f"model.d_model={d}", f"model.kda.head_dim={d}", f"model.attention.head_dim={d}"))
                   for d in (32, 48))
    size = dc_replace(base, name="sweep", tasks=("mqar",), seeds=(0, 1), widths=widths, lrs=(1e-3, 3e-3),
                      sweep_seeds=1, recall=dc_replace(base.recall, overwrite=False))
    monkeypatch.setitem(SIZES, "sweep", size)
    trained = []

    def train(cfg, programs, **_):
        trained.append((cfg.model.d_model, cfg.optimizer.lr, cfg.train.seed))
        return T.Trained(state=None, setup=None, steps=cfg.train.steps, tokens=1, tokens_per_s=1.0, train_s=0.0,
                         losses=[(1, 1.0)])

    def accuracy(tr, programs, cell, examples):
        d, lr, seed = cell.model.d_model, cell.optimizer.lr, cell.train.seed
        good = (d == 32) == (lr == 1e-3)
        return (0.9 if good else 0.4) + 0.01 * seed

    monkeypatch.setattr(T, "train", train)
    monkeypatch.setattr(T, "mqar_accuracy", accuracy)
    return size, trained


def test_sweep_order_best_rate_budget_and_more_seeds(sweep_size, tmp_path, capsys):
    size, trained = sweep_size
    args = ["--size", "sweep", "--out", str(tmp_path), "--rungs", "kda"]
    # --stop-after 0: the first run starts, no other; the same command then resumes
    assert cli.main(args + ["--stop-after", "0"]) == 0
    logged = capsys.readouterr().out
    assert trained == [(32, 1e-3, 0)] and "Run the same command again" in logged and "unfinished rungs: kda" in logged
    assert cli.main(args) == 0
    assert "every run is done" in capsys.readouterr().out
    # the sweep at seed 0 (both rates, per width), then seed 1 at each width's best rate only
    assert trained == [(32, 1e-3, 0), (32, 3e-3, 0), (32, 1e-3, 1), (48, 1e-3, 0), (48, 3e-3, 0), (48, 3e-3, 1)]
    data = json.loads((tmp_path / "ladder.json").read_text())
    assert sorted(data["done"]) == sorted(["kda/mqar/d32/lr0.001/s0", "kda/mqar/d32/lr0.003/s0", "kda/mqar/d32/lr0.001/s1",
                                           "kda/mqar/d48/lr0.001/s0", "kda/mqar/d48/lr0.003/s0",
                                           "kda/mqar/d48/lr0.003/s1"])
    assert set(data["rungs"]) == {"kda@d32", "kda@d48"}
    md = (tmp_path / "ladder.md").read_text()
    header, *lines = markdown_table(md, "## Recall (MQAR), d_model 48")
    assert header[3] == "lr" and lines[0][3] == "0.003" and lines[0][4] == "2"  # the best rate, both seeds
    assert lines[0][5] == cell_text([0.90, 0.91])
    header, *lines = markdown_table(md, "## The learning-rate sweep")
    assert lines[0][:4] == ["kda", "32", cell_text([0.9, 0.91]) + "*", "0.400"]  # 1e-3 ran at both seeds
    # a third seed later: only it runs, at the rates already chosen
    assert cli.main(args + ["--seeds", "0,1,2"]) == 0
    assert trained[6:] == [(32, 1e-3, 2), (48, 3e-3, 2)]


def test_recipe_bookkeeping(tmp_path):
    from train.ladder import recipe

    cfg = load_config(K3_SMALL)
    assert recipe.steps_for(cfg) == 160  # 16 x 4096 = 65,536 a step: 153 steps reach 10 M, rounded up to 20s
    assert 160 * 16 * 4096 >= 10_000_000
    runs = {v: recipe.overrides(v, tmp_path / v, 160) for v in recipe.VARIANTS}
    shared = set(runs["bf16"]) - {f"run_dir={tmp_path / 'bf16'}"}
    for v, ov in runs.items():  # the same run but for the variant's own switches
        assert shared <= set(ov) and set(ov) - shared == {f"run_dir={tmp_path / v}", *recipe.VARIANTS[v][1]}
    assert "model.qat=mxfp4" in runs["recipe"] and "optimizer.muon_per_head=true" in runs["recipe"]
    # the report on hand-made metrics: the gap at the last common eval, by hand
    curves = {"bf16": [3.0, 2.0, 1.50], "qat": [3.1, 2.05, 1.52], "recipe": [2.9, 1.9, 1.45]}
    for v, evals in curves.items():
        (tmp_path / v).mkdir()
        lines = [{"step": s, "loss": 4.0 - s / 20, "tokens_per_s": 60000.0 + s} for s in range(1, 61)]
        lines += [{"step": 20 * (i + 1), "eval_loss": e, "eval_accuracy": 0.5} for i, e in enumerate(evals)]
        if v == "recipe":
            lines += [{"step": s, "loss": 1.0, "mla_max_logit_max": 30.0 + s, "qk_clipped_heads_max": 0.0}
                      for s in (10, 20)]
        (tmp_path / v / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    assert recipe.main(["--report", "--out", str(tmp_path)]) == 0
    s = json.loads((tmp_path / "recipe.json").read_text())
    assert s["variants"]["qat"]["gap_to_bf16"]["60"] == pytest.approx(0.02)
    assert s["variants"]["recipe"]["gap_to_bf16"]["60"] == pytest.approx(-0.05)
    assert s["variants"]["recipe"]["qk_clip"]["max_logit"] == 50.0
    md = (tmp_path / "recipe.md").read_text()
    assert "| qat |" in md and "+0.0200" in md and "-0.0500" in md
    assert (tmp_path / "eval_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cells_that_fit_are_those_the_source_accepts():
    # the ladder skips a (pairs, length) cell that cannot hold its writes and queries; the MQAR
    # source's own check, an independent statement of the layout, must agree on every cell
    from train.data.mqar import MQARSource
    from train.ladder.tasks import cell_fits, mqar_source

    for overwrite in (False, True):
        for pairs in (2, 4, 8, 16):
            for length in (16, 24, 32, 48, 64):
                s = mqar_source(pairs, length, overwrite)
                try:
                    MQARSource(s.mqar_pairs, s.mqar_queries, 128, 0, seq_len=length,
                               overwrites=s.mqar_overwrites, example_length=s.mqar_length)
                    accepted = True
                except ConfigError:
                    accepted = False
                assert cell_fits(pairs, length, overwrite) == accepted, (pairs, length, overwrite)


def test_rung_patterns_keep_the_unit():
    assert periodic_unit(("kda",) * 16) == ("kda",)
    assert periodic_unit(("kda", "kda", "kda", "mla") * 4) == ("kda", "kda", "kda", "mla")
    assert rung_pattern(("kda", "kda", "kda", "mla") * 4, 8, "hybrid") == "2*(kda,kda,kda,mla)"
    assert rung_pattern(("softmax",) * 16, 3, "softmax") == "3*(softmax)"
    with pytest.raises(ConfigError, match="not a multiple"):
        rung_pattern(("kda", "kda", "kda", "mla") * 4, 6, "hybrid")
