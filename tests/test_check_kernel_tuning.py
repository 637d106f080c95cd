"""benchmarks/checks/kernel_tuning_check.py's verdicts (its launches need tokamax): recorded
launches of a working tuner pass, and each seeded fault fails its line: a miss left after
tuning, a second tuned file, a launch that tunes again, tokamax's absl record printed."""

import copy

import pytest

from benchmarks.checks.kernel_tuning_check import judge
from benchmarks.checks.verdict import Verdicts

GOOD = {"before": (2, 2, ["2 kernels have no tuned config for this GPU: their heuristic configs run"]),
        "tuned": (2, 0, ["tuning 2 kernels (budget inf s) ...", "tuned 2 of 2 kernels in 3 s"], 1),
        "next": (0, 0, ["tuned kernel configs loaded from /tmp/x"]),
        "after": (0, 0)}


def _judge(launches, printed=""):
    v = Verdicts("kernel_tuning", out=lambda line: None)
    return judge(v, launches, printed), v


def test_a_working_tuner_passes():
    ok, v = _judge(GOOD)
    assert ok and v.passed and len(v.rows) == 7


@pytest.mark.parametrize("key,value,printed", [
    ("tuned", (2, 1, GOOD["tuned"][2], 1), ""),  # a miss left after tuning
    ("tuned", (2, 0, GOOD["tuned"][2], 2), ""),  # two files for one run
    ("next", (2, 0, ["tuning 2 kernels ..."]), ""),  # the next launch tuned again
    (None, None, "WARNING absl: Autotuning cache miss for ragged_dot"),  # the record got through
])
def test_a_seeded_fault_fails(key, value, printed):
    launches = copy.deepcopy(GOOD)
    if key:
        launches[key] = value
    ok, v = _judge(launches, printed)
    assert not ok and len(v.failed()) >= 1
