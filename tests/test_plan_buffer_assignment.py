"""k3jax-plan on a GPU stops XLA's compile after buffer assignment and reads its figures from the
dump (train/plan/compile.py): those must be the bytes memory_analysis() reports."""

import glob

import jax
import jax.numpy as jnp
import pytest

from train.plan.compile import buffer_assignment_figures


def test_buffer_assignment_dump_reads_as_memory_analysis(tmp_path):
    """A donated step compiled by XLA:CPU: arguments, temporaries and the outputs not aliased to
    the donated input, read from its buffer-assignment dump, equal XLA's memory_analysis()."""

    def step(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g, jnp.tanh(x @ w).sum(0)

    compiled = jax.jit(step, donate_argnums=0).lower(jnp.ones((64, 128)), jnp.ones((256, 64))).compile(
        compiler_options={"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True})
    ma = compiled.memory_analysis()
    (dump,) = glob.glob(str(tmp_path / "*after_optimizations-buffer-assignment.txt"))
    with open(dump) as f:
        got = buffer_assignment_figures(f.read())
    assert ma.temp_size_in_bytes > 0 and ma.alias_size_in_bytes > 0  # the test exercises each term
    assert got == {"arguments": ma.argument_size_in_bytes, "temporaries": ma.temp_size_in_bytes,
                   "outputs_not_aliased": ma.output_size_in_bytes - ma.alias_size_in_bytes}


def test_buffer_assignment_colours():
    """XLA:GPU's layout of the dump: the collectives' temporaries in colour 1 are device memory
    (counted), colour 5 is host memory (left out, as memory_analysis() reports it apart);
    a donated parameter that is live out is aliased, the output tuple is not."""
    text = """BufferAssignment:
allocation 0: size 1000, page 0, parameter 0, shape |f32[250]| at ShapeIndex {}, maybe-live-out:
 value: <1 p0 @0> (size=1000,offset=0): f32[250]{0}
allocation 1: size 40, page 0, parameter 1, shape |f32[10]| at ShapeIndex {}:
allocation 2: size 16, page 0, output shape is |(f32[250], f32[3])|, maybe-live-out:
allocation 3: size 12, page 0, maybe-live-out:
allocation 4: size 64, page 0, constant:
allocation 5: size 4, page 0, thread-local:
allocation 6: size 5000, page 0, preallocated-temp:
allocation 7: size 300, color 1, page 0, preallocated-temp:
allocation 8: size 7000, color 5, page 0, preallocated-temp:
"""
    assert buffer_assignment_figures(text) == {"arguments": 1040, "temporaries": 5300, "outputs_not_aliased": 28}


class _Lowered:
    """Stands for a lowered step: records the options of each compile, fails the first with `error`."""

    def __init__(self, error):
        self.error, self.calls = error, []

    def compile(self, compiler_options):
        self.calls.append(compiler_options)
        if len(self.calls) == 1 and self.error:
            raise jax.errors.JaxRuntimeError(self.error)
        return "compiled"


def test_fusion_autotuner_is_turned_on_only_for_a_fusion_that_needs_it():
    """The GPU plan compiles without XLA:GPU's fusion autotuner, and again with it when a fusion
    has no config without it; any other error, or the TPU, is not retried."""
    from k3jax.chips import CHIPS
    from train.plan.compile import PLAN_AUTOTUNE_OPTIONS, compile_lowered

    (key, off), = PLAN_AUTOTUNE_OPTIONS.items()
    plain = _Lowered(None)
    assert compile_lowered(plain, CHIPS["h200"], "/tmp/d") == ("compiled", False)
    assert plain.calls[0][key] == off and plain.calls[0]["xla_dump_to"] == "/tmp/d"
    needs = _Lowered("INTERNAL: No supported config found for HLO: %gemm_fusion_dot_general.414 = ...")
    retried = []
    assert compile_lowered(needs, CHIPS["h200"], "/tmp/d", on_retry=lambda: retried.append(1)) == ("compiled", True)
    assert [key in c for c in needs.calls] == [True, False] and retried == [1]
    for chip, error in (("h200", "INTERNAL: something else"), ("v5p", "INTERNAL: No supported config found")):
        with pytest.raises(jax.errors.JaxRuntimeError):
            compile_lowered(_Lowered(error), CHIPS[chip], "/tmp/d")


# The stopped compile against the whole one for XLA:GPU and XLA:TPU: tests/test_plan.py's
# test_target_compile_of_the_sharded_step (the plan's own compile, compared there).
