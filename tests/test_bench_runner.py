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
    assert run.main(["--base", "HEAD", "--out", str(out), "fake", "--n", "5", "FLAG=on"]) == 0
    summary = json.loads((out / "fake.json").read_text())
    this, base = summary["sides"]
    assert (this["side"], this["commit"], this["dirty"]) == ("this", head, True)  # the uncommitted v2
    assert (base["side"], base["commit"], base["dirty"]) == ("base", head, False)
    assert this["rows"] == [{"version": 2, "n": 5, "flag": "on"}]  # the caller's --n after the default
    assert base["rows"] == [{"version": 1, "n": 5, "flag": "on"}]
    assert json.loads((out / "base.json").read_text()) == base["rows"]
    assert '{"version": 1' in (out / "base.log").read_text()


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
