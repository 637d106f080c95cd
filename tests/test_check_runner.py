"""benchmarks/checks/all.py: every check's PASS / FAIL lines into one checks.txt, a FAIL line for a
check that crashed, timed out, printed no verdict or had no time left, and a failing exit then."""

import json

import pytest

from benchmarks.checks import all as checks

FAKES = {
    "fake_pass": 'print("PASS fake_pass tiny err = 1.000e-03 <= 2.000e-03 (2 x u)")\nimport json, sys\n'
                 'json.dump([{"err": 1e-3}], open(sys.argv[sys.argv.index("--json") + 1], "w"))',
    "fake_fail": 'print("FAIL fake_fail tiny err = 5.000e-02 > 2.000e-03 (2 x u)")\nraise SystemExit(1)',
    "fake_crash": 'raise RuntimeError("no GPU here")',
    "fake_slow": 'import time\nprint("PASS fake_slow first = 0 <= 1 (x)", flush=True)\ntime.sleep(30)',
    "fake_silent": 'pass',
}


@pytest.fixture
def fake_checks(tmp_path, monkeypatch):
    for name, text in FAKES.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(checks, "CHECKS", tuple(
        checks.Check(n, n, (), "--json" if n == "fake_pass" else "", 2, 3) for n in FAKES) + (
        checks.Check("fake_late", "fake_pass", (), "", 1e9, 10),))  # never fits: the others get their least
    return tmp_path


def test_lines_summary_and_exit(fake_checks, tmp_path):
    out = tmp_path / "out"
    assert checks.main(["--out", str(out), "--budget-s", "50"]) == 1
    lines = (out / "checks.txt").read_text().splitlines()
    assert lines[0].startswith("PASS fake_pass tiny err")
    assert lines[1].startswith("FAIL fake_fail tiny err")
    assert lines[2].startswith("FAIL fake_crash - ran (exit 1: RuntimeError: no GPU here)")
    assert lines[3].startswith("PASS fake_slow first") and lines[4].startswith("FAIL fake_slow - ran (timed out")
    assert lines[5].startswith("FAIL fake_silent - ran (exit 0 and no verdict printed)")
    assert lines[6].startswith("FAIL fake_late - ran (not started")
    assert lines[7].startswith("checks: 2 passed, 5 failed")
    record = json.loads((out / "checks.json").read_text())["checks"][0]
    assert record["rows"] == [{"err": 1e-3}] and record["returncode"] == 0
    assert "no GPU here" in (out / "checks.log").read_text()


def test_only_runs_the_named_and_passes(fake_checks, tmp_path):
    assert checks.main(["--out", str(tmp_path / "o"), "--only", "fake_pass"]) == 0
    assert (tmp_path / "o" / "checks.txt").read_text().splitlines()[-1].startswith("checks: 1 passed, 0 failed")
    with pytest.raises(SystemExit):
        checks.main(["--out", str(tmp_path / "o"), "--only", "nope"])
