"""benchmarks/run.py: one registered benchmark on this tree and on a base commit's tree, each
side's rows recorded with its tree's commit; and the registry names modules that exist."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from benchmarks import run
from benchmarks.registry import BENCHMARKS, Bench

ROOT = Path(__file__).resolve().parents[1]

FAKE = '''import argparse, json, os
p = argparse.ArgumentParser()
p.add_argument("--n", type=int, default=1)
p.add_argument("--json")
a = p.parse_args()
rows = [{"version": VERSION, "n": a.n, "flag": os.environ.get("FLAG")}]
if os.environ.get("LEASE"):  # a row as benchmarks.bench_util.Rows writes it, with its settings
    rows[0].update(lease=os.environ["LEASE"], settings={"batch": a.n, "remat": os.environ.get("REMAT", "full")},
                   ms=10.0 * VERSION)
print(json.dumps(rows[0]))
json.dump(rows, open(a.json, "w"))
'''


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A repository whose benchmark says VERSION 1 at its commit and 2 in the working tree."""
    repo = tmp_path_factory.mktemp("repo")
    _git(repo, "init", "-q")
    (repo / "fakebench.py").write_text(FAKE.replace("VERSION", "1"))
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "v1")
    (repo / "fakebench.py").write_text(FAKE.replace("VERSION", "2"))
    return repo


def test_env_words_leave_the_arguments():
    args, env = run.split_env(["--n", "3", "XLA_FLAGS=--a=b", "model.remat=full", "FLAG=x"])
    assert args == ["--n", "3", "model.remat=full"] and env == {"XLA_FLAGS": "--a=b", "FLAG": "x"}


def test_both_trees_rows_with_their_commits(repo, tmp_path, monkeypatch):
    monkeypatch.setattr(run, "ROOT", repo)
    monkeypatch.setitem(run.BENCHMARKS, "fake", Bench("fakebench", ("--n", "1")))
    head = _git(repo, "rev-parse", "HEAD")
    out = tmp_path / "out"
    # rows without a lease or settings: run, recorded, but their comparison is refused (exit 2)
    assert run.main(["--base", "HEAD", "--out", str(out), "fake", "--n", "5", "FLAG=on"]) == 2
    summary = json.loads((out / "fake.json").read_text())
    assert "no lease id" in summary["comparison"]["refused"]
    this, base = summary["sides"]
    assert (this["side"], this["commit"], this["dirty"]) == ("this", head, True)  # the uncommitted v2
    assert (base["side"], base["commit"], base["dirty"]) == ("base", head, False)
    assert this["rows"] == [{"version": 2, "n": 5, "flag": "on"}]  # the caller's --n after the default
    assert base["rows"] == [{"version": 1, "n": 5, "flag": "on"}]
    assert json.loads((out / "base.json").read_text()) == base["rows"]
    assert '{"version": 1' in (out / "base.log").read_text()


def test_the_sides_rows_compared_or_refused(repo, tmp_path, monkeypatch):
    monkeypatch.setattr(run, "ROOT", repo)
    monkeypatch.setitem(run.BENCHMARKS, "fake", Bench("fakebench", ("--n", "1")))
    out = tmp_path / "out"
    assert run.main(["--base", "HEAD", "--out", str(out), "fake", "LEASE=L1"]) == 0
    summary = json.loads((out / "fake.json").read_text())
    (pair,) = summary["comparison"]["pairs"]
    assert pair["figures"]["ms"] == {"this": 20.0, "base": 10.0, "base_over_this": 0.5}
    assert summary["sides"][0]["lease"] == summary["sides"][1]["lease"]  # one lease: the runner's
    # settings that differ between the sides (here, by the environment) are refused unless allowed
    monkeypatch.setenv("REMAT", "none")
    monkeypatch.setattr(run, "run_side", _side_with_env(run.run_side, "base", "REMAT", "full"))
    assert run.main(["--base", "HEAD", "--out", str(out), "fake", "LEASE=L1"]) == 2
    refused = json.loads((out / "fake.json").read_text())["comparison"]["refused"]
    assert "other settings (remat: 'none' vs 'full')" in refused
    assert run.main(["--base", "HEAD", "--out", str(out), "--allow-settings", "remat", "fake", "LEASE=L1"]) == 0


def _side_with_env(real, side_name, key, value):
    """run_side, with env word key=value on one side only."""
    def side(name, bench, args, env_words, side, *rest):
        return real(name, bench, args, {**env_words, key: value} if side == side_name else env_words, side, *rest)
    return side


def test_a_prepared_base_tree_keeps_its_commit(repo, tmp_path):
    head = _git(repo, "rev-parse", "HEAD")
    assert run.prepare_base("HEAD", tmp_path / "base", repo) == head
    assert (tmp_path / "base" / "fakebench.py").read_text() == FAKE.replace("VERSION", "1")  # the commit's
    assert run.tree_commit(tmp_path / "base") == (head, False)
    with pytest.raises(SystemExit, match="not a commit"):
        run.prepare_base("no-such-rev", tmp_path / "x", repo)


def test_a_tree_from_before_the_folders_runs_its_flat_file(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "kda_op.py").write_text("")
    assert run.entry(tmp_path, "benchmarks.ops.kda_op") == [str(tmp_path / "benchmarks" / "kda_op.py")]
    assert run.entry(ROOT, "benchmarks.ops.kda_op") == ["-m", "benchmarks.ops.kda_op"]


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_registered_modules_exist_and_take_their_output_flag(name):
    bench = BENCHMARKS[name]
    source = (ROOT / (bench.module.replace(".", "/") + ".py")).read_text()
    assert "def main(" in source
    if bench.output:
        assert re.search(rf"add_argument\(\s*\"{bench.output}\"", source), (name, bench.output)
