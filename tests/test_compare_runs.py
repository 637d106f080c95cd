"""benchmarks/tools/compare_runs.py refuses what it cannot vouch for, and
benchmarks/bench_util.timing_row writes a run with a NaN loss as failed, not timed."""

import json
import math

import pytest

from benchmarks.bench_util import Rows, lease_id, timing_row
from benchmarks.tools import compare_runs as cr

SETTINGS = {"batch": [8, 4096], "remat": "full", "compute_dtype": "bfloat16", "gate": "lower_bound",
            "kernels": ["attention: kernel"]}
MEASURED = ("step_ms", "tokens_per_s")


def row(step_ms, lease="L1", losses=(10.7, 9.1, 8.0), **settings):
    return timing_row({"model": "k3-small", "step_ms": step_ms, "tokens_per_s": 32768 / step_ms * 1e3,
                       "lease": lease, "settings": {**SETTINGS, **settings}}, losses, MEASURED)


def write(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return str(path)


def test_a_nan_loss_makes_a_failed_row():
    r = row(567.6, losses=(10.7, float("nan"), 9.0))
    assert r["status"] == "failed" and "1 of 3 losses not finite (from step 1)" in r["failure"]
    assert "step_ms" not in r and r["discarded"]["step_ms"] == 567.6 and r["settings"] == SETTINGS
    assert row(544.0)["status"] == "timed"


def test_rows_of_one_lease_and_settings_compare(tmp_path, capsys):
    a, b = write(tmp_path, "a.json", row(544.0)), write(tmp_path, "b.json", [row(617.4)])
    assert cr.main([a, b]) == 0
    assert "x1.135" in capsys.readouterr().out  # 617.4 / 544.0


@pytest.mark.parametrize("b,why", [
    (row(574.5, losses=(10.7,) + (float("nan"),) * 7), "was written as failed"),
    (dict(row(574.5), status="timed", losses=[10.7, math.nan]), "losses that are not finite"),
    (dict(row(574.5), step_ms=math.nan), "step_ms not finite"),
    (row(472.8, lease="L2"), "come from different leases (L1, L2)"),
    ({k: v for k, v in row(472.8).items() if k != "lease"}, "has no lease id"),
    (row(472.8, remat="none"), "other settings (remat: 'full' vs 'none')"),
    ({k: v for k, v in row(472.8).items() if k != "settings"}, "records no settings"),
], ids=["failed row", "nan loss", "nan figure", "two leases", "no lease", "other remat", "no settings"])
def test_refused(tmp_path, capsys, b, why):
    a, b = write(tmp_path, "a.json", [row(480.2)]), write(tmp_path, "b.json", [b])
    assert cr.main([a, b]) == 2
    assert why in capsys.readouterr().err


def test_flags_allow_leases_and_named_settings_only(tmp_path):
    a = write(tmp_path, "a.json", [row(480.2)])
    assert cr.main([a, write(tmp_path, "b.json", [row(472.8, lease="L2")]), "--allow-leases"]) == 0
    other = write(tmp_path, "c.json", [row(472.8, remat="none", gate="softplus")])
    assert cr.main([a, other, "--allow-settings", "remat"]) == 2  # gate still differs
    assert cr.main([a, other, "--allow-settings", "remat,gate"]) == 0
    nan = write(tmp_path, "d.json", [row(574.5, losses=(math.nan,))])
    assert cr.main([a, nan, "--allow-leases", "--allow-settings", "all"]) == 2  # a NaN: never


def test_rows_get_this_lease():
    rows = Rows()
    assert rows.add({"ms": 1.0})["lease"] == lease_id() and len(lease_id()) >= 8


def _run(tmp_path, name, losses, remat="full"):
    d = tmp_path / name
    d.mkdir()
    d.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": v}) + "\n"
                                                   for i, v in enumerate(losses)))
    d.joinpath("config.yaml").write_text(f"model:\n  remat: {remat}\nrun_dir: {d}\n")
    return str(d)


def test_run_folders_refuse_a_nan_and_other_settings(tmp_path, capsys):
    a = _run(tmp_path, "a", [10.7, 9.0])
    assert cr.main([a, _run(tmp_path, "b", [10.7, 9.1])]) == 0  # run_dir differs: a path, allowed
    assert "max relative loss difference" in capsys.readouterr().out
    assert cr.main([a, _run(tmp_path, "c", [10.7, float("nan")])]) == 2
    assert "not finite at step 2" in capsys.readouterr().err
    other = _run(tmp_path, "d", [10.7, 9.1], remat="none")
    assert cr.main([a, other]) == 2
    assert "model.remat" in capsys.readouterr().err
    assert cr.main([a, other, "--allow-settings", "model.remat"]) == 0
