"""`k3jax-ladder --parallel N`: several ladder launches at once on one machine, one rung group
each, their ledgers merged at the end.

The ladder's models are small (a few M to ~31 M parameters): one process leaves a GPU mostly
idle between kernel launches. On 2026-12-06, four MQAR processes on one H200 each ran at close to
the speed of one alone (GPU utilisation 86-87 %, ~3.2x the throughput;
benchmarks/results/ladder-zoology-2026-12-06/). So this launcher:

* splits the rungs with runs still to do (counted from --out's ladder.json) into N groups, in
  ladder order, round robin (neighbouring rungs, which cost alike, go to different processes);
* starts one `k3jax-ladder` child per group on its own copy of the ledger, in `--out/part<i>/`
  (its log there: `cli.log`), with the same arguments, `--shared-device N`, and, unless set,
  XLA_PYTHON_CLIENT_MEM_FRACTION = 0.9 / N so that the children's JAX allocators share the card;
* waits for all of them (an interrupt reaches each child: it keeps every finished run, as a
  time limit's SIGINT does), then merges the parts into --out's ladder.json
  rung by rung (train/ladder/merge.py) and redraws the report.

Throughput measured beside other processes is not a rung's speed: the children mark their
timings `shared_device`, and the cost table's tokens/s leaves those out (`cli.cost_row`).
The parent never imports JAX, so it takes no device memory itself.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from train.ladder.merge import merge_into
from train.ladder.report import read_ledger
from train.ladder.runs import RECALL_TASKS
from train.ladder.sizes import Size

MEMORY_SHARE = 0.9  # of the device's memory, split between the children (XLA's default is 0.75 for one)
GRACE_S = 10.0  # after an interrupt, how long the children have to stop on their own
# a child's last word on its runs (train/ladder/cli.py writes them; status_line reads them back)
UNFINISHED = "k3jax-ladder: unfinished rungs"
ALL_DONE = "k3jax-ladder: every run is done"


def expected_runs(size: Size, tasks, seeds) -> int:
    """Finished-run keys (ladder.json's "done") one rung has when every run of `tasks` is done."""
    recall = sum(t in RECALL_TASKS for t in tasks)
    return (recall * len(size.width_list()) * size.runs_per_width("recall", seeds)
            + ("lm" in tasks) * size.runs_per_width("lm", seeds) + ("cost" in tasks))


def rungs_left(size: Size, rungs, tasks, seeds, done: list[str]) -> list[str]:
    """The rungs of `rungs` whose finished runs in `done` fall short of `expected_runs`
    (a count: each child checks its runs one by one, so an overcount only starts a child
    that finds nothing to do)."""
    want = expected_runs(size, tasks, seeds)
    keys = [k.split("/") for k in done]
    return [rung for rung in rungs if sum(1 for k in keys if k[0] == rung and k[1] in tasks) < want]


def groups(rungs: list[str], n: int) -> list[list[str]]:
    """At most n non-empty groups, round robin in ladder order."""
    return [g for g in (rungs[i::n] for i in range(n)) if g]


def child_argv(a, rungs: list[str], out: Path, shared: int) -> list[str]:
    """The arguments of one child: this launch's, for its rungs and folder."""
    argv = ["--size", a.size, "--out", str(out), "--rungs", ",".join(rungs), "--shared-device", str(shared),
            "--tokenizer", a.tokenizer]
    if a.tasks:
        argv += ["--tasks", ",".join(a.tasks)]
    if a.seeds is not None:
        argv += ["--seeds", ",".join(map(str, a.seeds))]
    if a.configs:
        argv += ["--configs", a.configs]
    if a.stop_after is not None:
        argv += ["--stop-after", f"{a.stop_after:g}"]
    for c in a.corpus:
        argv += ["--corpus", c]
    for o in a.overrides:
        argv += ["--set", o]
    return argv


def status_line(log_text: str) -> str:
    """A child's outcome from its log: its last "unfinished rungs" / "every run is done" line (a
    notice printed at exit, such as tokamax's count of untuned kernel shapes, can follow it), else
    its last line."""
    lines = [line for line in log_text.strip().splitlines() if line.strip()]
    ends = [line for line in lines if line.startswith((UNFINISHED, ALL_DONE))]
    return (ends or lines or ["(no output)"])[-1]


def child_env(parent_env, num_children: int) -> dict:
    """The children's environment: the parent's, with its device-memory fraction split between them."""
    env = dict(parent_env)
    key = "XLA_PYTHON_CLIENT_MEM_FRACTION"
    try:
        share = float(env.get(key, MEMORY_SHARE))
    except ValueError:
        raise SystemExit(f"k3jax-ladder --parallel: {key}={env[key]!r} is not a number") from None
    if not 0.0 < share <= 1.0:
        raise SystemExit(f"k3jax-ladder --parallel: {key}={env[key]!r} is not a fraction in (0, 1]")
    env[key] = f"{share / num_children:.3f}"
    return env


def launch(a, size: Size, rungs: list[str], tasks, seeds, out: Path) -> int:
    """Run the groups as child processes, wait, merge. -> the worst child's exit code."""
    ledger = out / "ladder.json"
    resume = ledger.is_file() and not a.fresh  # --fresh: the parts start empty, the merge replaces the file
    done = read_ledger(ledger, hint="; pass --fresh to start over")["done"] if resume else []
    left = rungs_left(size, rungs, tasks, seeds, done)
    if not left:
        print(f"{ALL_DONE} (nothing for --parallel to start)")
        return 0
    parts = groups(left, a.parallel)
    env = child_env(os.environ, len(parts))
    procs = []
    for i, group in enumerate(parts):
        part = out / f"part{i}"
        if part.exists():
            shutil.rmtree(part)
        part.mkdir(parents=True)
        if resume:
            shutil.copy(ledger, part / "ladder.json")
        log = open(part / "cli.log", "w")
        argv = [sys.executable, "-m", "train.ladder.cli", *child_argv(a, group, part, len(parts))]
        print(f"k3jax-ladder --parallel: part{i} trains {','.join(group)} (log: {part / 'cli.log'})", flush=True)
        procs.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env), log, part))
    try:
        codes = [p.wait() for p, _, _ in procs]
    except KeyboardInterrupt:
        # Ctrl-C and `timeout -s INT` signal the whole process group, children included; pass it
        # on only to a child still running after a grace period (one started apart from this group)
        try:
            for p, _, _ in procs:
                p.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            for p, _, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)
        codes = [p.wait() for p, _, _ in procs]
    for _, log, _ in procs:
        log.close()
    for (p, _, part), code in zip(procs, codes):
        text = (part / "cli.log").read_text() if (part / "cli.log").exists() else ""
        print(f"k3jax-ladder --parallel: part{part.name[4:]} exit {code}: {status_line(text)}")
    merged = [str(part / "ladder.json") for _, _, part in procs if (part / "ladder.json").is_file()]
    if merged:
        merge_into(out, merged, keep_existing=resume)
    else:
        print("k3jax-ladder --parallel: no part wrote a ladder.json; nothing merged")
    return max(codes)


__all__ = ["child_argv", "expected_runs", "groups", "launch", "rungs_left", "status_line"]
