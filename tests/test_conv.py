"""k3jax.layers.conv.short_conv (its own VJP) against autodiff of the plain form."""

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.conv import short_conv, short_conv_reference


def test_short_conv_vjp_equals_autodiff_of_the_plain_form():
    """Packed rows (a document starts mid-row, so taps across it count as zero), a window of
    earlier inputs, fp32 and bf16: outputs and next windows bit for bit; gradients of the
    weight, the input and the window within fp32 rounding (or one bf16 rounding)."""
    rng = np.random.default_rng(0)
    B, T, P, W = 2, 11, 6, 4
    seg = np.ones((B, T), np.int32)
    seg[0, 5:] = 2
    seg[1, 9:] = 3
    w0 = rng.uniform(-0.5, 0.5, (W, P))
    x0, win0 = rng.standard_normal((B, T, P)), rng.standard_normal((B, W - 1, P))
    cy, cw = rng.standard_normal((B, T, P)), rng.standard_normal((B, W - 1, P))
    for dt, tol in ((jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)):
        w, x, win = jnp.asarray(w0, jnp.float32), jnp.asarray(x0, dt), jnp.asarray(win0, dt)
        for window in (win, None):
            def loss(fn, w, x, win):
                y, nxt = fn(w, x, jnp.asarray(seg), win)
                return jnp.sum(y.astype(jnp.float32) * cy) + jnp.sum(nxt.astype(jnp.float32) * cw)

            args = (w, x) + ((window,) if window is not None else ())
            f = lambda *a: loss(short_conv, *a, *(() if window is not None else (None,)))  # noqa: E731
            r = lambda *a: loss(short_conv_reference, *a, *(() if window is not None else (None,)))  # noqa: E731
            for got, want in zip(short_conv(w, x, jnp.asarray(seg), window),
                                 short_conv_reference(w, x, jnp.asarray(seg), window)):
                np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
            gots = jax.grad(f, argnums=tuple(range(len(args))))(*args)
            wants = jax.grad(r, argnums=tuple(range(len(args))))(*args)
            for a, b in zip(gots, wants):
                assert a.dtype == b.dtype
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                assert np.abs(a - b).max() <= tol * np.abs(b).max(), (dt, window is None, np.abs(a - b).max())
