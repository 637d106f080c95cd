"""benchmarks/checks/decode_kernels_check.py on CPU (the Pallas interpreter, its TINY shapes): the
real kernels pass their limits against the fp32 form, and the check fails on seeded faults: a
wrong scale, a transposed state, a dropped head block of the output, a 3 % output scale. (Two
kernels of the ten, to keep the interpreter's compiles few: the fp32 KDA step and MLA's
finish, the one whose old comparison read 0.0.)"""

import jax.numpy as jnp
import pytest

from benchmarks.checks import decode_kernels_check as dkc
from benchmarks.checks.verdict import Verdicts
from k3jax.ops.decode_kernels import kda_step, mla_layer

ONLY_PLAIN = ("kda_step",)


def _run(fused: bool, only):
    v = Verdicts("decode_kernels", out=lambda line: None)
    rows = (dkc.fused_kernel_check if fused else dkc.kernel_check)(dims=dkc.TINY, verdicts=v, only=only)
    return rows, v


def test_real_kernels_pass_against_the_fp32_form():
    rows, v = _run(False, ONLY_PLAIN)
    fused, vf = _run(True, ("mla_finish",))
    assert v.passed and vf.passed, v.failed() + vf.failed()
    # the error is the kernel's rounding (a bf16 kernel is never exact against fp32) and under the limit
    assert 0 < fused["mla_finish"]["kernel_vs_f32"] < fused["mla_finish"]["limit"]
    assert rows["kda_step"]["kernel_vs_f32"] <= rows["kda_step"]["limit"]


def _fault_fails(monkeypatch, module, name, wrap, fused, kernel):
    real = getattr(module, name)
    monkeypatch.setattr(module, name, wrap(real))
    rows, v = _run(fused, (kernel,))
    assert not v.passed and not rows[kernel]["pass"], rows
    return rows[kernel]


def test_a_wrong_scale_fails(monkeypatch):
    row = _fault_fails(monkeypatch, kda_step, "kda_decode_step",
                       lambda real: lambda *a, scale, **k: real(*a, scale=scale * 1.01, **k), False, "kda_step")
    assert row["kernel_vs_f32"] > 3 * row["limit"]  # 1 % of o: far above fp32's limit


def test_a_transposed_state_fails(monkeypatch):
    row = _fault_fails(monkeypatch, kda_step, "kda_decode_step",
                       lambda real: lambda state, *a, **k: real(jnp.swapaxes(state, -1, -2), *a, **k), False,
                       "kda_step")
    assert row["kernel_vs_f32"] > 1e-2


@pytest.mark.parametrize("fault", ["dropped head block", "3% scale"])
def test_a_dropped_block_or_a_small_scale_error_fails(monkeypatch, fault):
    v = dkc.TINY.n  # each head's output block in mla_finish's [B, H*v]

    def wrap(real):
        if fault == "dropped head block":
            return lambda *a, **k: real(*a, **k).at[:, v:2 * v].set(0)
        return lambda *a, **k: (real(*a, **k).astype(jnp.float32) * 1.03).astype(jnp.bfloat16)
    _fault_fails(monkeypatch, mla_layer, "mla_decode_finish", wrap, True, "mla_finish")
