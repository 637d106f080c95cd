"""benchmarks/tools/record.py: BENCHMARKS.md's tables and README.md's marked figures are what the
results files under benchmarks/results/ hold, and the check fails on any figure that differs from
its file or cannot be found there. Reads files only (no JAX, no GPU)."""

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks.tools import record
from benchmarks.tools.record import Agg, Cat, Div, Fig, J, Range, Spec, Sub, Sum, T, Table, TraceError, check, generate
from benchmarks.tools.record_spec import spec as repo_spec

ROOT = Path(__file__).resolve().parents[1]
DOCS = {n: (ROOT / n).read_text() for n in record.DOCS}


@pytest.fixture(scope="module")
def spec():
    return repo_spec(ROOT / record.RESULTS)


def test_the_repository_record_matches_its_results(spec):
    assert check(spec, DOCS) == []
    # the check covers what it claims: generated tables, marked figures in both documents
    assert len(record.BLOCK.findall(DOCS["BENCHMARKS.md"])) == len(spec.tables) >= 30
    assert len(record.SPAN.findall(DOCS["README.md"])) >= 30
    assert "0.87×" not in DOCS["README.md"] and "0.64–0.92×" not in DOCS["README.md"]


def test_benchmarks_md_holds_the_current_figures_only():
    """Issue 41: at most 600 lines; the history lives in the results folders' READMEs."""
    assert len(DOCS["BENCHMARKS.md"].splitlines()) <= 600


def _first_row_line(text: str) -> tuple[int, str]:
    """The first data row of the first generated table (line index, line)."""
    start = text.index("<!-- record:")
    lines = text.splitlines()
    i = text.count("\n", 0, start) + 3  # marker, header, separator
    assert lines[i].startswith("| ")
    return i, lines[i]


def test_an_altered_table_figure_fails_naming_line_and_file(spec):
    i, row = _first_row_line(DOCS["BENCHMARKS.md"])
    number = re.search(r"\| (\d+\.\d)\b", row)  # the row's first decimal figure (ms/step)
    altered = row[: number.start(1)] + str(round(float(number.group(1)) + 0.1, 1)) + row[number.end(1) :]
    lines = DOCS["BENCHMARKS.md"].splitlines()
    lines[i] = altered
    errors = check(spec, {"BENCHMARKS.md": "\n".join(lines) + "\n", "README.md": DOCS["README.md"]})
    assert len(errors) == 1
    assert errors[0].startswith(f"BENCHMARKS.md:{i + 1}: table ") and altered in errors[0] and row in errors[0]


def test_an_altered_readme_figure_fails_naming_its_files(spec):
    m = re.search(r"<!--fig:(fla\.ratio)-->([\d.]+)×<!--/fig-->", DOCS["README.md"])
    wrong = DOCS["README.md"][: m.start(2)] + "0.87" + DOCS["README.md"][m.end(2) :]
    errors = check(spec, {"BENCHMARKS.md": DOCS["BENCHMARKS.md"], "README.md": wrong})
    assert len(errors) == 1
    assert "fig:fla.ratio reads '0.87×'" in errors[0] and "3-fla-peer/fla_model.json" in errors[0]


def test_an_unmarked_figure_in_the_readme_fails(spec):
    stale = DOCS["README.md"] + "\nKDA runs at 0.64–0.92× fla's speed, the step at 43–46 k tokens/s.\n"
    errors = check(spec, {"BENCHMARKS.md": DOCS["BENCHMARKS.md"], "README.md": stale})
    assert [e.split(": ", 1)[1].split(" is ")[0] for e in errors] == ["'0.64–0.92×'", "'43–46 k tokens/s'"]
    # shapes and the chip's spec are no measurement
    ok = DOCS["README.md"] + "\n8×4096 rows, 16 × 4096 tokens, against the 989 TFLOP/s spec.\n"
    assert check(spec, {"BENCHMARKS.md": DOCS["BENCHMARKS.md"], "README.md": ok}) == []


def test_a_figure_missing_from_its_results_file_fails(spec, tmp_path):
    """A temp copy of the results with one file's key removed and another file gone."""
    results = tmp_path / "results"
    shutil.copytree(ROOT / record.RESULTS, results)
    fla = results / "kernels-2026-12-04/3-fla-peer/fla_model.json"
    data = json.loads(fla.read_text())
    del data["kda-peer-340m-safe-gate"]["tokens_per_s"]
    fla.write_text(json.dumps(data))
    (results / "issue23-close-2026-12-03/2-op-compile/k3jax_op.json").unlink()
    errors = check(repo_spec(results), DOCS)
    assert errors and all("fla_model.json" in e or "k3jax_op.json" in e for e in errors)
    assert any("table fla_step" in e and "no key 'tokens_per_s'" in e for e in errors)
    assert any("fig:fla.ratio" in e and "README.md" in e for e in errors)
    assert any("table kda_op" in e and "k3jax_op.json: no such file" in e for e in errors)


def test_the_command_line_check_exits_1_on_a_changed_figure(tmp_path, capsys):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks/results").symlink_to(ROOT / record.RESULTS)
    (tmp_path / "README.md").write_text(DOCS["README.md"])
    (tmp_path / "BENCHMARKS.md").write_text(DOCS["BENCHMARKS.md"].replace("| 69,309 |", "| 69,399 |", 1))
    assert record.main(["--check", "--root", str(tmp_path)]) == 1
    assert "69,399" in capsys.readouterr().out
    assert record.main(["--root", str(tmp_path)]) == 0  # regenerates the table from the results
    assert (tmp_path / "BENCHMARKS.md").read_text() == DOCS["BENCHMARKS.md"]
    assert record.main(["--check", "--root", str(tmp_path)]) == 0


# --- the engine, on hand-written files --------------------------------------------------------------


@pytest.fixture
def results(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run/rows.json").write_text(
        json.dumps(
            [
                {"B": 8, "what": "fwd", "ms": 2.0, "cfg": {"bk": 64}},
                {"B": 8, "what": "bwd", "ms": 6.5, "cfg": {"bk": 128}},
                {"B": 2, "what": "fwd", "ms": float("nan")},
            ]
        )
    )
    (tmp_path / "run/metrics.jsonl").write_text(
        "\n".join(
            json.dumps(d)
            for d in (
                {"step": 0, "compile_s": 40.0},
                {"step": 1, "loss": 4.0, "clip": [0, 0]},
                {"step": 2, "loss": 3.0, "clip": [0, 2]},
                {"step": 3, "loss": 1.0, "clip": [1, 0]},
                {"step": 3, "eval_loss": 2.5},
            )
        )
    )
    (tmp_path / "run/log.txt").write_text("compiled in 12.5 s\nstep 1 at 1,234 tokens/s\nstep 2 at 1,300 tokens/s\n")
    return tmp_path


def test_values_read_and_formatted_as_computed_by_hand(results):
    rows, m, log = "run/rows.json", "run/metrics.jsonl", "run/log.txt"
    assert J(rows, "[what=bwd].ms").get(results) == 6.5
    assert J(rows, "[cfg.bk=64].what").get(results) == "fwd"
    assert J(rows, "[1].cfg.bk").get(results) == 128
    assert J(m, "[step=3,eval_loss].eval_loss").get(results) == 2.5
    assert T(log, r"compiled in ([\d.]+) s").get(results) == 12.5
    assert T(log, r"at ([\d,]+) tokens/s", nth=1).get(results) == 1300.0
    assert Agg(m, "loss", "mean_last", 2).get(results) == pytest.approx((3.0 + 1.0) / 2)
    assert Agg(m, "clip", "count_positive").get(results) == 2 and Agg(m, "clip", "count").get(results) == 3
    a, b = J(rows, "[what=fwd,B=8].ms"), J(rows, "[what=bwd].ms")
    assert Fig(Div(b, a), "{:.2f}×").render(results) == "3.25×"
    assert Fig(Sub(b, a), "{:.1f}").render(results) == "4.5"
    assert Fig(Sum(a, b, a), "{:.1f}").render(results) == "10.5"
    assert Fig(J(rows, "[what=bwd].ms"), "{:.0f} %", 10).render(results) == "65 %"
    assert Range((b, a), "{:.1f}", unit=" ms").render(results) == "2.0–6.5 ms"
    assert Range((a, a), "{:.1f}").render(results) == "2.0"
    assert Cat(Fig(a, "{:.1f}"), " (", Fig(b, "{:.1f}"), ")").render(results) == "2.0 (6.5)"


@pytest.mark.parametrize(
    "value, message",
    [
        (J("run/gone.json", "ms"), "run/gone.json: no such file"),
        (J("run/rows.json", "[what=fwd].ms"), "matches 2 items, not one"),
        (J("run/rows.json", "[what=up].ms"), "matches 0 items, not one"),
        (J("run/rows.json", "[0].us"), "no key 'us'"),
        (J("run/rows.json", "[B=2].ms"), "is NaN"),
        (J("run/rows.json", "[0].cfg"), "is a dict, not a figure"),
        (T("run/log.txt", r"step \d at ([\d,]+)"), "matches 2 times, not once"),
        (T("run/log.txt", r"eval (\d+)"), "matches 0 times, not once"),
        (Agg("run/metrics.jsonl", "loss", "mean_last", 5), "3 lines have 'loss', not 5"),
    ],
)
def test_a_value_that_cannot_be_traced_names_file_and_key(results, value, message):
    with pytest.raises(TraceError, match=re.escape(message)):
        value.get(results)


def test_generate_fills_markers_and_check_refuses_what_the_spec_does_not_name(results):
    table = Table("t", ("shape", "ms"), (("8", Fig(J("run/rows.json", "[what=bwd].ms"), "{:.2f}")),), ("run it",))
    sp = Spec({"t": table}, {"loss": Fig(J("run/metrics.jsonl", "[step=3,loss].loss"), "{:.3f}")}, results=results)
    doc = "Intro.\n<!-- record:t -->\n<!-- /record:t -->\nLoss <!--fig:loss-->?<!--/fig-->.\n"
    out, errors = generate(doc, sp, "BENCHMARKS.md", tables=True)
    assert errors == []
    assert out == (
        "Intro.\n<!-- record:t -->\n| shape | ms | results (`benchmarks/results/`) |\n|---|---|---|\n"
        "| 8 | 6.50 | `run/rows.json` |\n\n    run it\n<!-- /record:t -->\nLoss <!--fig:loss-->1.000<!--/fig-->.\n"
    )
    assert check(sp, {"BENCHMARKS.md": out, "README.md": "See BENCHMARKS.md.\n"}) == []
    errors = check(
        sp,
        {
            "BENCHMARKS.md": out.replace("<!--fig:loss-->", "<!--fig:lost-->"),
            "README.md": "<!-- record:t -->\n<!-- /record:t -->\n",
        },
    )
    assert any("fig:lost is no figure of the spec" in e for e in errors)
    assert any(e.startswith("README.md:1: record:t is no table") for e in errors)
    assert check(sp, {"BENCHMARKS.md": "no tables\n", "README.md": ""}) == [
        "BENCHMARKS.md: the spec's table t has no <!-- record:t --> block"
    ]
    with pytest.raises(ValueError, match="reads no results file"):
        Table("u", ("a",), (("literal only",),))
