"""train.plan.breakdown: the buffers live at a compiled program's peak, named by the code that
made them, against a program whose peak is known by hand."""

import os

import jax
import jax.numpy as jnp

from train.plan.breakdown import peak_breakdown

HERE = os.path.dirname(os.path.abspath(__file__))


def _layer(h, w):
    return jnp.tanh(h @ w) + h, None


def _loss(x, w):
    h, _ = jax.lax.scan(jax.checkpoint(_layer), x, w)
    return jnp.sum(h ** 2)


def test_scan_residuals_are_named_and_sized(tmp_path):
    """A remat'd scan of 8 layers over h [512, 256] fp32 saves each layer's input for the
    backward: 8 x 512 x 256 x 4 bytes, stacked by the scan's loop, named after this file."""
    x = jax.ShapeDtypeStruct((512, 256), jnp.float32)
    w = jax.ShapeDtypeStruct((8, 256, 256), jnp.float32)
    jax.jit(jax.grad(_loss, argnums=(0, 1))).lower(x, w).compile(
        compiler_options={"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True})
    peak, terms = peak_breakdown(str(tmp_path), (HERE,))
    named = dict(terms)
    assert sum(named.values()) == peak
    stacked = {k: v for k, v in named.items() if "stacked by a scan" in k}
    assert list(stacked.values()) == [8 * 512 * 256 * 4], terms
    assert "test_plan_breakdown.py:" in next(iter(stacked))
    assert named.get("arguments: the train state and the batch", 0) >= (512 * 256 + 8 * 256 * 256) * 4
