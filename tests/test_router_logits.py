"""k3jax.ops.router_logits: fp32 router logits from split bf16 GEMMs, and their backward, against
float64 products (numpy) and the HIGHEST fp32 matmul."""

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.router_logits import router_logits, router_logits_reference, split_bf16

N, D, E = 96, 256, 24


def _case(seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((D, E)) * 0.02, jnp.float32)
    g = jnp.asarray(rng.standard_normal((N, E)), jnp.float32)
    return x, w, g


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _rel(a, b):
    return float(np.max(np.abs(_f64(a) - b)) / np.max(np.abs(b)))


def test_split_is_exact_with_three_terms():
    w = jnp.asarray(np.random.default_rng(0).standard_normal(4096) * 10.0 ** np.random.default_rng(1).integers(-30, 30, 4096),
                    jnp.float32)
    parts = split_bf16(w, 3)
    assert parts.dtype == jnp.bfloat16 and parts.shape == (3, 4096)
    total = sum(np.asarray(parts[i].astype(jnp.float32), np.float64) for i in range(3))
    np.testing.assert_array_equal(total, np.asarray(w, np.float64))
    two = sum(np.asarray(parts[i].astype(jnp.float32), np.float64) for i in range(2))
    assert np.max(np.abs(two - np.asarray(w, np.float64)) / np.abs(np.asarray(w, np.float64))) < 2 ** -16


def test_logits_and_gradients_against_float64():
    """Logits and dw as accurate as fp32 (measured 1.1e-7 of the largest; two terms of the split
    give 2.4e-6 / 2.9e-6 and one bf16 pass 1.7e-3); dx, returned in bf16, within its rounding."""
    x, w, g = _case(3)
    x64, w64, g64 = _f64(x), _f64(w), _f64(g)
    out, vjp = jax.jit(lambda x, w: jax.vjp(router_logits, x, w))(x, w)
    dx, dw = vjp(g)
    assert out.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    assert _rel(out, x64 @ w64) < 5e-7, _rel(out, x64 @ w64)
    assert _rel(dw, x64.T @ g64) < 5e-7, _rel(dw, x64.T @ g64)
    dx64 = g64 @ w64.T
    # one bf16 rounding of the exact dx: what the reference form returns at best
    assert np.max(np.abs(_f64(dx) - dx64) / (np.abs(dx64) + 1e-3 * np.max(np.abs(dx64)))) < 2 ** -8
    # the HIGHEST fp32 matmul (the reference form) agrees to fp32 rounding
    assert _rel(out, _f64(router_logits_reference(x, w))) < 1e-6


def test_other_dtypes_take_the_reference_form():
    x, w, _ = _case(4)
    xf = x.astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(router_logits(xf, w)), np.asarray(router_logits_reference(xf, w)))
    jaxpr = str(jax.make_jaxpr(router_logits)(xf, w))
    assert "bf16" not in jaxpr
