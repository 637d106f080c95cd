"""k3jax.ops.matmul_f32: fp32 result of bf16 operands, backward in bf16, against the plain form."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

from k3jax.model import REMAT_POLICIES
from k3jax.ops.matmul_f32 import matmul_f32_out, matmul_f32_out_reference


def _case(out=(3, 4)):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 5, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((8,) + out) * 0.3, jnp.bfloat16)
    cot = jnp.asarray(rng.standard_normal((2, 5) + out), jnp.float32)
    return x, w, cot


def test_forward_is_the_plain_product_and_backward_is_bf16():
    """Forward: the plain form bit for bit. Backward: exactly the plain form's gradient of the
    cotangent rounded to bf16 (and within bf16 rounding of the fp32 cotangent's); both backward
    products take bf16 operands (no fp32 x bf16 dot, which XLA:GPU runs as TF32)."""
    for out in ((6,), (3, 4)):  # a flat and a multi-axis output side ([d, H, K] kernels)
        x, w, cot = _case(out)
        y = matmul_f32_out(x, w)
        assert y.dtype == jnp.float32
        np.testing.assert_array_equal(y, matmul_f32_out_reference(x, w))
        _, vjp = jax.vjp(matmul_f32_out, x, w)
        dx, dw = vjp(cot)
        _, vjp_ref = jax.vjp(matmul_f32_out_reference, x, w)
        rx, rw = vjp_ref(cot.astype(jnp.bfloat16).astype(jnp.float32))
        assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(rx, np.float32))
        np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(rw, np.float32))
        fx, fw = vjp_ref(cot)
        for a, b in ((dx, fx), (dw, fw)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max()
    dots = _dots(jax.make_jaxpr(jax.vjp(matmul_f32_out, x, w)[1])(cot).jaxpr)  # the backward only
    assert len(dots) == 2 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    plain = _dots(jax.make_jaxpr(jax.vjp(matmul_f32_out_reference, x, w)[1])(cot).jaxpr)
    assert len(plain) == 2 and any(v.aval.dtype == jnp.float32 for e in plain for v in e.invars)


def _dots(jaxpr):
    """Every dot_general equation of a jaxpr, sub-jaxprs included."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general":
            out.append(e)
        for v in e.params.values():
            if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                out += _dots(v.jaxpr)
            elif hasattr(v, "eqns"):
                out += _dots(v)
    return out


def test_fp32_operands_take_the_plain_form():
    x, w, cot = _case()
    x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    g = jax.grad(lambda x, w: jnp.sum(matmul_f32_out(x, w) * cot), argnums=(0, 1))(x, w)
    r = jax.grad(lambda x, w: jnp.sum(matmul_f32_out_reference(x, w) * cot), argnums=(0, 1))(x, w)
    for a, b in zip(g, r):
        np.testing.assert_array_equal(a, b)


def test_save_dots_keeps_the_product():
    """Under model.remat=save_dots the product is saved (as the plain dot's would be), so the
    backward pass does not recompute it."""
    x, w, cot = _case()

    def layer(x, w):
        return jnp.sum(jnp.tanh(matmul_f32_out(jnp.sin(x), w)) * cot)

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(jax.checkpoint(layer, policy=REMAT_POLICIES["save_dots"]), x, w)
    saved = buf.getvalue()
    assert "f32[2,5,3,4] named 'matmul_f32_out'" in saved, saved
