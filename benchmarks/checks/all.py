"""Every GPU correctness check, each judged against its limits, in one command of < 10 minutes.

    python -m benchmarks.checks.all --out DIR [--budget-s 540] [--only kda,gmm,...]

Runs each check of `CHECKS` in its own process, in order, within --budget-s in all (a check
starts only with at least its `least` seconds left, and gets at most its `most`, less what the
later checks need to start where there is room for both), and writes

    DIR/checks.txt    every PASS / FAIL line (benchmarks/checks/verdict.py), a FAIL line for a
                      check that crashed, timed out or was not started, and a last line
                      "checks: N passed, M failed" (nothing else)
    DIR/checks.json   {"checks": [{"name", "command", "returncode", "seconds", "lines", "rows"}]}:
                      each check's PASS / FAIL lines and its own JSON output
    DIR/checks.log    all the checks' output

Exit status 0 only when every verdict passed and every check ran. From the repository root on
the GPU machine, after `source benchmarks/env/gpu_env.sh` (fla's and tokamax's wheels).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    module: str
    args: tuple[str, ...]
    output: str  # "--json" (a file) or "--out" (a folder with summary.json)
    least: float  # seconds it needs to be worth starting
    most: float  # its time limit


CHECKS = (  # the cheap ones first; hf_crosscheck (fla's autotuning, two subprocesses) gets what is left
    Check("decode_kernels", "benchmarks.checks.decode_kernels_check", (), "--json", 30, 100),
    Check("attention", "benchmarks.ops.attention", ("--check-only",), "--json", 30, 80),
    Check("short_conv", "benchmarks.ops.short_conv", ("--check-only",), "--json", 30, 80),
    Check("kda", "benchmarks.checks.kda_check", ("--no-xla",), "--json", 60, 150),
    # k3-small's expert shapes at an eighth of the tokens (32,768 rows, ~512 a group): every call
    # and routing of the full check in a fraction of its time
    Check("gmm", "benchmarks.checks.gmm_check", ("--tokens", "4096", "--dw-pallas", "--check-only"), "--json", 60, 120),
    Check("hf_crosscheck", "benchmarks.checks.hf_crosscheck", ("--parts", "fla,fla_ieee,mla"), "--out", 150, 330),
    Check("kernel_tuning", "benchmarks.checks.kernel_tuning_check", (), "", 20, 60),
)


def verdict_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(("PASS ", "FAIL "))]


def run_check(check: Check, seconds: float, scratch: Path, log) -> dict:
    """One check in its own process, at most `seconds`: its record."""
    target = scratch / (check.name + (".json" if check.output == "--json" else ""))
    cmd = [sys.executable, "-m", check.module, *check.args] + ([check.output, str(target)] if check.output else [])
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=seconds)
        rc, text = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "")
    took = round(time.perf_counter() - t0, 1)
    log.write(f"===== {check.name}: {' '.join(cmd[1:])} (exit {rc}, {took} s)\n{text}\n")
    log.flush()
    lines = verdict_lines(text)
    if rc == "timeout":
        lines.append(f"FAIL {check.name} - ran (timed out after {seconds:.0f} s; the verdicts before it stand)")
    elif rc != 0 and not any(ln.startswith("FAIL ") for ln in lines):
        last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "")
        lines.append(f"FAIL {check.name} - ran (exit {rc}: {last[:200]})")
    elif not lines:
        lines.append(f"FAIL {check.name} - ran (exit {rc} and no verdict printed)")
    rows = None
    path = target / "summary.json" if check.output == "--out" else target
    if check.output and path.exists():
        try:
            rows = json.loads(path.read_text())
        except json.JSONDecodeError:
            rows = None
    return {"name": check.name, "command": " ".join(cmd[1:]), "returncode": rc, "seconds": took, "lines": lines,
            "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--only", default="", help="comma-separated names of CHECKS")
    a = ap.parse_args(argv)
    names = [c.name for c in CHECKS]
    only = [n for n in a.only.split(",") if n]
    if unknown := [n for n in only if n not in names]:
        ap.error(f"--only: unknown checks {unknown}; known: {names}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    records = []
    with tempfile.TemporaryDirectory(prefix="k3jax-checks-") as tmp, open(out / "checks.log", "w") as log:
        chosen = [c for c in CHECKS if not only or c.name in only]
        for i, check in enumerate(chosen):
            left = a.budget_s - (time.perf_counter() - t0)
            # at most its `most`, leaving the later checks their `least` where there is room for it
            allowed = min(check.most, max(check.least, left - sum(c.least for c in chosen[i + 1:])))
            if left < check.least:
                records.append({"name": check.name, "returncode": None, "seconds": 0.0, "rows": None,
                                "lines": [f"FAIL {check.name} - ran (not started: {left:.0f} s of the budget left, "
                                          f"it needs {check.least:.0f})"]})
            else:
                records.append(run_check(check, allowed, Path(tmp), log))
            for line in records[-1]["lines"]:
                print(line, flush=True)
    lines = [ln for r in records for ln in r["lines"]]
    failed = sum(ln.startswith("FAIL ") for ln in lines)
    summary = f"checks: {len(lines) - failed} passed, {failed} failed ({time.perf_counter() - t0:.0f} s)"
    (out / "checks.txt").write_text("\n".join(lines + [summary]) + "\n")
    (out / "checks.json").write_text(json.dumps({"checks": records}, indent=1, default=str))
    print(summary, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
