"""Run a registered benchmark (benchmarks/registry.py), on this tree and optionally on another.

    python benchmarks/run.py --list
    python benchmarks/run.py [--out DIR] [--timeout S] NAME [args ...]
    python benchmarks/run.py --base REV [--out DIR] NAME [args ...]         # A/B in one lease
    python benchmarks/run.py --base-tree DIR NAME [args ...]                # a tree built beforehand
    python benchmarks/run.py --prepare-base REV DIR                         # build it (git archive)

args go to the benchmark after its registered defaults (a later flag wins); a word NAME=value
in capitals (XLA_FLAGS=..., JAX_COMPILATION_CACHE_DIR=...) is set in its environment instead.
Each tree runs the benchmark in its own process (`python -m MODULE`, the tree first on
PYTHONPATH, $OUT its own folder), this tree first, then the base tree in the same lease.
--base REV builds the base tree with `git archive REV` into a temporary folder; on a machine
without the repository (a GPU lease gets a copy of the working tree), build it beforehand with
--prepare-base and pass --base-tree. A base tree from before the benchmarks had folders runs
its benchmarks/NAME.py. Written under --out (default bench-out/NAME):

    this.json, base.json   each side's rows (its --json file, or its --out folder's path, or the
                           JSON lines it printed); this.log, base.log: its output
    NAME.json              {"benchmark", "module", "args", "sides": [{"side", "tree", "commit",
                           "dirty", "lease", "returncode", "seconds", "rows"}], "comparison"}: both
                           sides' rows, each with its tree's commit and the lease it ran in

With two sides, "comparison" pairs their rows in order and gives each pair's measured figures
as base / this (benchmarks/tools/compare_runs.py), or {"refused": why}: a side whose rows are a
failed run (a NaN loss), a row with a figure that is not finite, rows of another lease, or
rows whose `settings` differ (--allow-settings KEY,...|all lets named ones differ: an A/B of a
changed default). A refused comparison exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_util import lease_id  # noqa: E402
from benchmarks.registry import BENCHMARKS, Bench  # noqa: E402
from benchmarks.tools import compare_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMIT_FILE = ".tree_commit"  # written into a tree built from a commit (no .git there)
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def split_env(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the benchmark's arguments, the NAME=value words as environment variables)."""
    env = dict(w.split("=", 1) for w in args if ENV_WORD.match(w))
    return [w for w in args if not ENV_WORD.match(w)], env


def tree_commit(tree: Path) -> tuple[str, bool | None]:
    """(commit, dirty) of a tree: its git HEAD and whether tracked files differ from it; for a
    tree built from a commit, the commit recorded in it; else ("unknown", None)."""
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        top = subprocess.run(["git", "-C", str(tree), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True).stdout.strip()
        if Path(top).resolve() == tree.resolve():
            status = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, check=True).stdout
            return head, bool(status.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    recorded = tree / COMMIT_FILE
    if recorded.exists():
        return recorded.read_text().strip(), False
    return "unknown", None


def prepare_base(rev: str, dest: Path, repo: Path | None = None) -> str:
    """The tree of commit `rev` of `repo` (this one by default) written into dest (git archive),
    its commit recorded in dest/.tree_commit. Returns the commit."""
    repo = repo or ROOT
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True)
    if commit.returncode:
        raise SystemExit(f"run.py: --base {rev}: not a commit of {repo} ({commit.stderr.strip()})")
    sha = commit.stdout.strip()
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", "-C", str(repo), "archive", sha], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait():
        raise SystemExit(f"run.py: git archive {sha} failed")
    (dest / COMMIT_FILE).write_text(sha + "\n")
    return sha


def entry(tree: Path, module: str) -> list[str]:
    """How to start `module` in `tree`: `-m module`, or, in a tree from before the benchmarks were
    grouped into folders (benchmarks/NAME.py), that file."""
    flat = tree / "benchmarks" / (module.rsplit(".", 1)[-1] + ".py")
    if not (tree / (module.replace(".", "/") + ".py")).exists() and flat.exists():
        return [str(flat)]
    return ["-m", module]


def command(bench: Bench, args: list[str], side_out: Path, tree: Path = ROOT) -> list[str]:
    """The benchmark's command line on one side, its output path added where it takes one."""
    cmd = [sys.executable, *entry(tree, bench.module), *bench.defaults, *args]
    if bench.output and bench.output not in args:
        path = side_out.with_suffix(".json") if bench.output == "--json" else side_out
        cmd += [bench.output, str(path)]
    return cmd


def json_lines(text: str) -> list:
    """The lines of a benchmark's output that are JSON objects (its rows as it printed them)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def run_side(name: str, bench: Bench, args: list[str], env_words: dict[str, str], side: str, tree: Path,
             out: Path, timeout: float | None) -> dict:
    """Run the benchmark in `tree`; its record: the tree's commit, exit status, time and rows."""
    side_out = out / side
    cmd = command(bench, args, side_out, tree)
    env = dict(os.environ, **env_words)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))
    env["OUT"] = str(side_out)
    side_out.mkdir(parents=True, exist_ok=True)
    commit, dirty = tree_commit(tree)
    print(f"run.py: {name} on {side} ({tree}, {commit[:12]}{' + changes' if dirty else ''}): "
          f"{' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(out / f"{side}.log", "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout)
            returncode, text = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as e:  # what it printed before its time ran out
            output = e.stdout or ""
            returncode, text = "timeout", output.decode() if isinstance(output, bytes) else output
        log.write(text)
    seconds = round(time.perf_counter() - t0, 1)
    rows_file = side_out.with_suffix(".json")
    if bench.output == "--json" and rows_file.exists():
        rows = json.loads(rows_file.read_text())
    elif bench.output == "--out":
        rows = {"folder": str(side_out)}
    else:
        rows = json_lines(text)
        rows_file.write_text(json.dumps(rows, indent=1))
    if not any(side_out.iterdir()):
        side_out.rmdir()
    print(f"run.py: {name} on {side}: exit {returncode} in {seconds} s", flush=True)
    return {"side": side, "tree": str(tree), "commit": commit, "dirty": dirty, "lease": lease_id(),
            "returncode": returncode, "seconds": seconds, "rows": rows}


def compare_sides(records: list[dict], allow_settings: tuple[str, ...]) -> dict:
    """The two sides' rows paired in order: each pair's figures (base / this), or why not."""
    this, base = records
    if any(not isinstance(r["rows"], list) for r in records):
        return {"refused": "a side wrote a folder, not rows: compare its files by hand"}
    if this["returncode"] != 0 or base["returncode"] != 0:
        return {"refused": f"a side failed (exit {this['returncode']} / {base['returncode']}): its rows are not "
                           "measurements"}
    if len(this["rows"]) != len(base["rows"]) or not this["rows"]:
        return {"refused": f"{len(this['rows'])} rows against {len(base['rows'])}: pair them by hand"}
    pairs = []
    try:
        for i, (a, b) in enumerate(zip(this["rows"], base["rows"])):
            notes = compare_runs.comparable((f"this[{i}]", a), (f"base[{i}]", b), allow_settings=allow_settings)
            pairs.append({"figures": {k: {"this": a[k], "base": b[k], "base_over_this": b[k] / a[k]}
                                      for k in compare_runs.MEASURED if isinstance(a.get(k), (int, float))
                                      and isinstance(b.get(k), (int, float)) and a[k]}, "notes": notes})
    except compare_runs.Refused as e:
        return {"refused": str(e)}
    return {"pairs": pairs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="the registered benchmarks")
    p.add_argument("--base", metavar="REV", help="also run it on the tree of this commit (git archive)")
    p.add_argument("--base-tree", metavar="DIR", help="also run it on this tree (built with --prepare-base)")
    p.add_argument("--prepare-base", nargs=2, metavar=("REV", "DIR"), help="only build a base tree and stop")
    p.add_argument("--out", help="where the rows go (default bench-out/NAME)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per side")
    p.add_argument("--allow-settings", default="", help="settings keys the two sides' rows may differ in (or all)")
    p.add_argument("name", nargs="?")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.list:
        for name, b in BENCHMARKS.items():
            print(f"{name:22s} {b.module:36s} {b.doc}")
        return 0
    if a.prepare_base:
        sha = prepare_base(a.prepare_base[0], Path(a.prepare_base[1]))
        print(f"run.py: {a.prepare_base[1]} holds {sha}")
        return 0
    if a.name not in BENCHMARKS:
        p.error(f"unknown benchmark {a.name!r}; registered: {', '.join(BENCHMARKS)}")
    if a.base and a.base_tree:
        p.error("--base and --base-tree: give one")
    bench = BENCHMARKS[a.name]
    args, env_words = split_env(a.args)
    out = Path(a.out or Path("bench-out") / a.name).absolute()
    out.mkdir(parents=True, exist_ok=True)
    sides = [("this", ROOT)]
    with tempfile.TemporaryDirectory(prefix="k3jax-base-") as tmp:
        if a.base:
            prepare_base(a.base, Path(tmp))
            sides.append(("base", Path(tmp)))
        elif a.base_tree:
            sides.append(("base", Path(a.base_tree).absolute()))
        records = [run_side(a.name, bench, args, env_words, side, tree, out, a.timeout) for side, tree in sides]
    summary = {"benchmark": a.name, "module": bench.module, "args": [*bench.defaults, *a.args], "sides": records}
    if len(records) == 2:
        summary["comparison"] = compare_sides(records, tuple(k for k in a.allow_settings.split(",") if k))
        if "refused" in summary["comparison"]:
            print(f"run.py: comparison refused: {summary['comparison']['refused']}", flush=True)
    (out / f"{a.name}.json").write_text(json.dumps(summary, indent=1))
    print(f"run.py: {out / (a.name + '.json')}")
    if not all(r["returncode"] == 0 for r in records):
        return 1
    return 2 if "refused" in summary.get("comparison", {}) else 0


if __name__ == "__main__":
    sys.exit(main())
