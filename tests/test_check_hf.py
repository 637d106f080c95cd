"""benchmarks/checks/hf_crosscheck.py's judging on CPU (its comparisons need torch, fla and a GPU):
the greedy-decode comparison passes equal tokens and a first difference at a near tie, and fails a
difference beyond a tie or a short sequence; the logits' limits pass rounding-sized errors and
fail a 1 % scale (a wrong norm weight) at both TF32 and fp32."""

import numpy as np

from benchmarks.checks import hf_crosscheck as hf
from benchmarks.checks.verdict import Verdicts, max_rel


def test_greedy_tokens_equal_pass():
    assert hf.compare_greedy([5, 6, 7], [5, 6, 7], [1.0, 1.0, 1.0], tie=0.01)["pass"]


def test_a_difference_at_a_near_tie_passes_and_one_beyond_fails():
    near = hf.compare_greedy([5, 9, 1], [5, 6, 7], [1.0, 0.004, 2.0], tie=0.01)
    assert near["pass"] and near["first_difference"] == 1 and near["matching"] == 1
    far = hf.compare_greedy([5, 9, 1], [5, 6, 7], [1.0, 0.5, 2.0], tie=0.01)
    assert not far["pass"] and far["first_difference"] == 1
    assert not hf.compare_greedy([5, 6], [5, 6, 7], [1.0, 1.0, 1.0], tie=0.01)["pass"]


def test_logit_limits_pass_rounding_and_fail_a_scale_fault():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 37, 1024)) * 3
    lim = hf.limits()
    v = Verdicts("hf", out=lambda line: None)
    tf32 = ref * (1 + rng.uniform(-1, 1, ref.shape) * 2.0**-11 * 4)  # four TF32 roundings' worth
    fp32 = ref.astype(np.float32).astype(np.float64)
    assert v.judge("tf32", "logits", max_rel(tf32, ref), *lim["tf32"])
    assert v.judge("fp32", "logits", max_rel(fp32, ref), *lim["fp32"])
    for which in ("tf32", "fp32"):
        assert not v.judge(which, "logits", max_rel(ref * 1.01, ref), *lim[which])
    assert lim["fp32"][0] < 2e-4 < lim["tf32"][0] < 1e-2
