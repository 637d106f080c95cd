"""benchmarks/checks/kda_check.py on CPU (the fused kernels in the Pallas interpreter, bf16 inputs,
one tiny case with padding, three documents and an initial state): the real kernels pass every
limit against float64, and the check fails on seeded faults: q at a wrong scale, a dropped chunk
of the output, the initial state read transposed."""

import jax.numpy as jnp
import pytest

from benchmarks.checks import kda_check as kc
from benchmarks.checks.verdict import Verdicts

SHAPE = (1, 100, 1, 16, 16)  # B, T (two chunks of 64, the second padded), H, K, V (square: the state transposes)


@pytest.fixture(scope="module")
def case():
    x, w_o = kc.case_inputs(*SHAPE, jnp.bfloat16)
    return x, w_o, kc.reference(x, w_o), kc.limits(jnp.bfloat16, SHAPE[3])


def _judge(got, case):
    _, _, ref, lim = case
    v = Verdicts("kda", out=lambda line: None)
    return kc.judge("bf16 tiny", got, ref, lim, v), v


@pytest.mark.parametrize("tune", ["", "intra_split=1,cumsum_kernel=1"])
def test_real_kernels_pass(case, tune):
    """The defaults, and the check's --tune path with kernel 1 split and the cumsum kernels."""
    x, w_o, _, _ = case
    row, v = _judge(kc.run("pallas", x, w_o, kc.Tuning.parse(tune)), case)
    assert v.passed and row["finite"], v.failed()
    assert 0 < row["o_vs_f64"]  # bf16 operands: never exact, and within the limit


def test_q_at_a_wrong_scale_fails(case):
    x, w_o, _, _ = case
    q = (x[0].astype(jnp.float32) * 1.25).astype(jnp.bfloat16)  # a kernel scaling q by 1/sqrt(K) once too little
    row, v = _judge(kc.run("pallas", [q, *x[1:]], w_o), case)
    assert not v.passed and row["o_vs_f64"] > 0.1


def test_a_dropped_chunk_fails(case):
    x, w_o, _, _ = case
    o, S, grads = kc.run("pallas", x, w_o)
    row, v = _judge((o.at[:, 64:].set(0), S, grads), case)  # the second chunk's rows never written
    assert not v.passed and row["o_vs_f64"] > 0.1


def test_a_transposed_initial_state_fails(case):
    x, w_o, _, _ = case
    x = [*x[:5], jnp.swapaxes(x[5], -1, -2), x[6]]
    row, v = _judge(kc.run("pallas", x, w_o), case)  # the first document (25 tokens) reads it, then resets
    assert not v.passed and row["o_vs_f64"] > 3 * case[3]["out"][0]
