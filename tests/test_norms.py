"""k3jax.layers.norms: the hand-written VJPs against autodiff of the plain forms."""

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.norms import (l2_normalize, l2_normalize_reference, rms_norm, rms_norm_reference, rms_normalize,
                                rms_normalize_reference)


def _close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.abs(got - want).max() <= tol * np.abs(want).max(), np.abs(got - want).max() / np.abs(want).max()


def test_norm_vjps_equal_autodiff_of_the_plain_forms():
    """Forward bit for bit; gradients within fp32 rounding (fp32 inputs) or one bf16 rounding
    (bf16 inputs, the weight's gradient summed in fp32 here and in bf16 by autodiff)."""
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((3, 5, 16)) * np.array([0.01, 1.0, 30.0])[:, None, None]  # rows of every scale
    w0 = 1.0 + 0.3 * rng.standard_normal(16)
    g0 = rng.standard_normal((3, 5, 16))
    for dt, tol in ((jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)):
        x, w = jnp.asarray(x0, dt), jnp.asarray(w0, jnp.float32)
        cases = (  # (fast, plain, differentiated arguments)
            (lambda x: rms_normalize(x, 1e-5), lambda x: rms_normalize_reference(x, 1e-5), (x,)),
            (lambda x: l2_normalize(x, 1e-6), lambda x: l2_normalize_reference(x, 1e-6), (x,)),
            (lambda x, w: rms_norm(x, w, 1e-5), lambda x, w: rms_norm_reference(x, w, 1e-5), (x, w)),
        )
        for fn, ref, args in cases:
            y, vjp = jax.vjp(fn, *args)
            y_ref, vjp_ref = jax.vjp(ref, *args)
            np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
            g = jnp.asarray(g0, y.dtype)
            for a, b in zip(vjp(g), vjp_ref(g)):
                assert a.dtype == b.dtype and a.shape == b.shape
                _close(a, b, tol)
    # the default eps of l2_normalize (the KDA layer calls it without one)
    np.testing.assert_array_equal(l2_normalize(jnp.asarray(x0, jnp.float32)),
                                  l2_normalize_reference(jnp.asarray(x0, jnp.float32)))
