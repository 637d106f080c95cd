"""benchmarks/checks/gmm_check.py's verdicts on CPU (tokamax needs a GPU): k3jax's Pallas weight
gradient (the interpreter) and the blocked forms pass the per-call fp32 accumulation bound and
the MLP's limits; the check fails on seeded faults: a 1 % wrong scale, one group's block
dropped, the operands swapped (a transposed dw), a 1e-2 error at one element (tokamax's
2026-12-02 dw), the MLP's gate and up swapped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.checks import gmm_check as gc
from benchmarks.checks.verdict import Verdicts
from k3jax.ops.grouped_dw import grouped_dw
from k3jax.ops.grouped_matmul import grouped_glu_mlp

M, E, L, H = 96, 4, 16, 16  # L == H: a transposed dw has the right shape
SIZES = np.array([30, 0, 40, 20])  # an empty group, and 6 unrouted rows at the end


@pytest.fixture(scope="module")
def data():
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (M, L), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (E, L, H), jnp.float32) * 0.03).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[2], (M, H), jnp.bfloat16)
    sizes = jnp.asarray(SIZES, jnp.int32)
    refs, bounds, Ks = gc.references(x, w, sizes, dy)
    dw = grouped_dw(x, dy, sizes, out_dtype=jnp.float32, interpret=True)
    return x, w, dy, sizes, refs, bounds, Ks, dw


def _dw_verdict(dw, data):
    *_, refs, bounds, Ks, _ = data
    v = Verdicts("gmm", out=lambda line: None)
    e = gc.call_error(dw, refs[2], bounds[2], E)
    return gc.judge_call(v, "tiny dw", e, Ks[2]), e


def test_the_pallas_dw_passes_and_empty_groups_are_exact(data):
    ok, e = _dw_verdict(data[-1], data)
    assert ok and e["bound_ratio"] < 1 and np.all(np.asarray(data[-1])[1] == 0)


@pytest.mark.parametrize("fault", [
    lambda dw, x, dy, s: dw * 1.01,
    lambda dw, x, dy, s: dw.at[2, :8].set(0),  # half of group 2's first tile never written
    lambda dw, x, dy, s: grouped_dw(dy, x, s, out_dtype=jnp.float32, interpret=True),  # x^T dy as dy^T x
    lambda dw, x, dy, s: dw.at[0, 3, 5].add(1e-2 * jnp.max(jnp.abs(dw))),
], ids=["1% scale", "dropped block", "operands swapped", "one element off by 1e-2"])
def test_a_seeded_dw_fault_fails(data, fault):
    x, w, dy, sizes, *_, dw = data
    ok, e = _dw_verdict(fault(dw, x, dy, sizes), data)
    assert not ok and e["bound_ratio"] > 1


def _mlp(data, swap=False):
    x, w, dy, sizes, *_ = data
    w3 = (w.astype(jnp.float32) * 0.5 + 0.01).astype(jnp.bfloat16)
    w2 = jnp.swapaxes(w, 1, 2)
    cot = jax.random.normal(jax.random.key(5), (M, L), jnp.float32)

    def grads(x, w1, w3, w2, cd, impl):
        loss = lambda *p: jnp.sum(grouped_glu_mlp(*p, sizes, lambda a, b: jax.nn.silu(a) * b,  # noqa: E731
                                                  compute_dtype=cd, impl=impl, block=16) * cot)
        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, w1, w3, w2)
    got = grads(x, *((w3, w) if swap else (w, w3)), w2, jnp.bfloat16, "blocked")
    with jax.default_matmul_precision("highest"):
        want = grads(*(t.astype(jnp.float32) for t in (x, w, w3, w2)), jnp.float32, "blocked")
    if swap:
        got = (got[0], got[2], got[1], got[3])
    v = Verdicts("gmm", out=lambda line: None)
    return gc.mlp_rows(v, "tiny", got, want, int(SIZES.sum()), "blocked bf16"), v


def test_the_mlp_in_bf16_passes_and_a_swapped_gate_fails(data):
    _, v = _mlp(data)
    assert v.passed, v.failed()
    _, v = _mlp(data, swap=True)
    assert not v.passed
