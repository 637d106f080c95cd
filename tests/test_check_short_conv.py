"""benchmarks/ops/short_conv.py's check on CPU (the kernel in the Pallas interpreter, a tiny packed
shape, plain and normalised): the real kernel passes its limits against the XLA backward in fp32,
and the check fails on seeded faults (the weight at a wrong scale, the taps in reverse order,
a dropped row tile of dx)."""

import pytest

from benchmarks.checks.verdict import Verdicts
from benchmarks.ops import short_conv as sc
from k3jax.ops.short_conv_grad import short_conv_grad

TINY = dict(B=1, T=64, P=32, W=4, head=16)


def real(*a, normalize):
    return short_conv_grad(*a, normalize=normalize, interpret=True)


def _check(kernel):
    v = Verdicts("short_conv", out=lambda line: None)
    return sc.check_rows(v, kernel=kernel, **TINY), v


def test_the_real_kernel_passes():
    rows, v = _check(real)
    assert v.passed, v.failed()
    assert all(0 < r["rel_dx"] for r in rows)


@pytest.mark.parametrize("fault", [
    lambda w, *a, normalize: real(1.25 * w, *a, normalize=normalize),
    lambda w, *a, normalize: real(w[::-1], *a, normalize=normalize),
    lambda *a, normalize: (lambda o: (o[0], o[1].at[:, 16:32].set(0), o[2]))(real(*a, normalize=normalize)),
], ids=["weight scale", "taps reversed", "dropped dx tile"])
def test_a_seeded_fault_fails(fault):
    rows, v = _check(fault)
    assert not v.passed and not any(r["pass"] for r in rows)
