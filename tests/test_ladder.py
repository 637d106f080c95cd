"""k3jax-ladder: the smoke size end to end (every rung and task, a few steps), its resume, and
the pieces checked against hand-computed values: rung patterns, decode-state bytes, claims."""

import json
import math

import pytest

from k3jax.config import ConfigError
from train.ladder import cli
from train.ladder.claims import check_claims
from train.ladder.sizes import RUNGS, SIZES, default_configs_dir, periodic_unit, rung_config, rung_pattern, total_params

ROW_KEYS = {
    "mqar": {"rung", "task", "pairs", "seq_len", "accuracy", "params", "steps"},
    "mqar_overwrite": {"rung", "task", "pairs", "seq_len", "accuracy", "params", "steps"},
    "lm": {"rung", "task", "tokens", "eval_loss", "params"},
    "cost": {"rung", "task", "tokens_per_s", "state_bytes_4k", "state_bytes_128k"},
}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("ladder")
    assert cli.main(["--size", "smoke", "--out", str(out)]) == 0
    return out, json.loads((out / "ladder.json").read_text())


def test_smoke_ladder_writes_every_rung_and_task(smoke):
    out, data = smoke
    rows = data["rows"]
    size = SIZES["smoke"]
    for rung in RUNGS:
        for task, keys in ROW_KEYS.items():
            mine = [r for r in rows if r["rung"] == rung and r["task"] == task]
            assert mine, (rung, task)
            for r in mine:
                assert set(r) == keys  # exactly the row schema
                assert all(math.isfinite(v) for k, v in r.items() if k not in ("rung", "task")), r
        acc = [r["accuracy"] for r in rows if r["rung"] == rung and r["task"] in ("mqar", "mqar_overwrite")]
        assert all(0.0 <= a <= 1.0 for a in acc)
        lm = [r for r in rows if r["rung"] == rung and r["task"] == "lm"]
        assert len(lm) == size.lm.evals and all(0 < r["eval_loss"] < 2 * math.log(320) for r in lm)
        assert [r["tokens"] for r in lm] == sorted({r["tokens"] for r in lm})  # tokens seen grow
    # one parameter budget: every rung within 3 % of the kda rung, and the counts are the models'
    params = {r: data["rungs"][r]["params"] for r in RUNGS}
    assert all(abs(p / params["kda"] - 1) < 0.03 for p in params.values()), params
    ffn = data["rungs"]["softmax"]["ffn_hidden"]
    assert total_params(rung_config(size, "softmax", default_configs_dir(), ffn_hidden=ffn).model) == params["softmax"]
    md = (out / "ladder.md").read_text()
    for heading in ("## Recall (MQAR)", "## Overwrite", "## Language modelling", "## Cost",
                    "## Expectations from the literature"):
        assert heading in md
    assert all(f"| {r} |" in md for r in RUNGS)
    # the tables print ladder.json's numbers, cell by cell
    for task, heading in (("mqar", "## Recall (MQAR)"), ("mqar_overwrite", "## Overwrite")):
        header, *lines = markdown_table(md, heading)
        cells = [c.split(" pairs @ ") for c in header[3:]]
        assert len(lines) == len(RUNGS) and [line[0] for line in lines] == list(RUNGS)
        for line in lines:
            for (pairs, length), shown in zip(cells, line[3:]):
                (row,) = [r for r in rows if r["rung"] == line[0] and r["task"] == task
                          and r["pairs"] == int(pairs) and r["seq_len"] == int(length)]
                assert shown == f"{row['accuracy']:.3f}"
    header, *lines = markdown_table(md, "## Cost")
    for line in lines:
        (row,) = [r for r in rows if r["rung"] == line[0] and r["task"] == "cost"]
        assert line[1] == f"{row['tokens_per_s']:.0f}"
    for png in ("ladder_recall.png", "ladder_lm.png", "ladder_cost.png", "ladder_train_loss.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def test_smoke_decode_state_bytes_by_hand(smoke):
    _, data = smoke
    cost = {r["rung"]: r for r in data["rows"] if r["task"] == "cost"}
    # smoke: 4 layers, d_model 32, one head of 32, float32 (4 bytes), conv 4 (3 cached steps)
    layers, heads, dk, f32, conv_steps = 4, 1, 32, 4, 3
    kv_per_token = layers * 2 * heads * dk * f32
    assert cost["softmax"]["state_bytes_4k"] == 4096 * kv_per_token
    assert cost["softmax"]["state_bytes_128k"] == 131072 * kv_per_token
    recurrent = layers * (heads * dk * dk * f32 + 3 * conv_steps * heads * dk * f32)  # state + q/k/v windows
    for rung in ("linear", "deltanet", "gated_deltanet", "kda"):
        assert cost[rung]["state_bytes_4k"] == cost[rung]["state_bytes_128k"] == recurrent
    # hybrid: 3 KDA layers + 1 MLA layer caching its latent (16) and shared rope key (8) per token
    assert cost["hybrid"]["state_bytes_4k"] == 3 * recurrent // layers + 4096 * (16 + 8) * f32


def test_smoke_ladder_resumes_without_retraining(smoke, capsys):
    out, before = smoke
    assert cli.main(["--size", "smoke", "--out", str(out)]) == 0
    logged = capsys.readouterr().out
    assert ": training" not in logged and logged.count("done before, skipped") == len(RUNGS) * 4
    after = json.loads((out / "ladder.json").read_text())
    assert after["rows"] == before["rows"]
    # other settings in the same folder are refused, naming the file
    assert cli.main(["--size", "smoke", "--out", str(out), "--set", "optimizer.lr=1e-4"]) == 2
    assert "ladder.json" in capsys.readouterr().err
    # so is a rung whose config file changed since its tasks finished (as if configs/ladder/linear.yaml
    # had been edited: the fingerprint recorded then no longer matches); the file is left as it was
    original = (out / "ladder.json").read_text()
    edited = json.loads(original)
    edited["rungs"]["linear"]["config"] = "0" * 16
    (out / "ladder.json").write_text(json.dumps(edited))
    try:
        assert cli.main(["--size", "smoke", "--out", str(out), "--rungs", "linear"]) == 2
        err = capsys.readouterr().err
        assert "linear rung" in err and "linear.yaml" in err
        assert json.loads((out / "ladder.json").read_text()) == edited
    finally:
        (out / "ladder.json").write_text(original)


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


def test_claims_read_the_rows():
    def recall(rung, task, accs, length=64):
        return [{"rung": rung, "task": task, "pairs": p, "seq_len": length, "accuracy": a, "params": 1, "steps": 1}
                for p, a in zip((4, 8, 16), accs)]

    rows = (recall("softmax", "mqar", (1.0, 1.0, 0.95)) + recall("softmax", "mqar", (0.2, 0.1, 0.1), length=256)
            + recall("linear", "mqar", (0.9, 0.5, 0.2)) + recall("deltanet", "mqar", (1.0, 0.9, 0.6))
            + recall("linear", "mqar_overwrite", (0.5, 0.5, 0.4))
            + recall("deltanet", "mqar_overwrite", (0.4, 0.4, 0.4))
            + [{"rung": "deltanet", "task": "lm", "tokens": 10, "eval_loss": 3.0, "params": 1},
               {"rung": "gated_deltanet", "task": "lm", "tokens": 10, "eval_loss": 2.9, "params": 1}])
    claims = check_claims(rows, train_length=64)

    def verdict(words):
        (c,) = [c for c in claims if words in c["claim"]]
        return c["verdict"]

    assert verdict("attention solves") == "agrees"  # mean 0.983 at length 64
    assert verdict("attention recalls better") == "agrees"  # softmax 0.983 > linear 0.533 at length 64
    assert verdict("linear attention's fixed") == "agrees"  # 0.9 -> 0.2
    assert verdict("delta rule recalls better than linear") == "agrees"  # 0.833 > 0.533 over every cell
    assert verdict("edits memories") == "disagrees"  # 0.4 < 0.467
    assert verdict("rewriting keys") == "disagrees"  # linear loses 0.533 - 0.467, deltanet 0.833 - 0.4
    assert all(c["likely_if_not"] for c in claims if c["verdict"] == "disagrees")
    assert verdict("forget gate on top of the delta rule lowers") == "agrees"  # LM 2.9 < 3.0
    assert verdict("forget gate on top of the delta rule recalls") == "not measured"  # no gated_deltanet recall
    worse = rows + recall("gated_deltanet", "mqar", (0.5, 0.5, 0.5))
    (gate,) = [c for c in check_claims(worse, train_length=64) if "delta rule recalls better" in c["claim"]
               and "forget" in c["claim"]]
    assert gate["verdict"] == "disagrees" and "gated_deltanet 0.500 vs deltanet 0.833" in gate["evidence"]
    assert verdict("degrades on sequences longer") == "agrees"  # 0.133 at 256 < 0.983
    assert verdict("3:1 with MLA beats full attention at equal training (LM") == "not measured"
    # a rung that never learned at its trained length says nothing about longer ones
    unlearned = [dict(r, accuracy=0.3) if r["rung"] == "softmax" else r for r in rows]
    (rope,) = [c for c in check_claims(unlearned, train_length=64) if "longer" in c["claim"]]
    assert rope["verdict"] == "inconclusive"
