"""grouped_matmul: both fast forms against a float64 per-row product written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.grouped_matmul import grouped_glu_mlp, grouped_matmul, grouped_matmul_reference


def _np_grouped(x, w, sizes):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = np.zeros((x.shape[0], w.shape[2]))
    r = 0
    for g, s in enumerate(np.asarray(sizes)):
        y[r:r + s] = x[r:r + s] @ w[g]
        r += s
    return y  # rows past sum(sizes) stay zero


def _case(seed, sizes, m, d=5, f=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d)).astype(np.float32)
    w = rng.standard_normal((len(sizes), d, f)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(np.asarray(sizes, np.int32))


# empty first / middle / last groups, a group bigger than a block, rows past the last group
SIZES = [0, 7, 0, 1, 4, 0]


@pytest.mark.parametrize("impl,block", [("ragged", 0), ("blocked", 1), ("blocked", 3), ("blocked", 4),
                                        ("blocked", 64)])
def test_grouped_matmul_forms_equal_float64(impl, block):
    x, w, sizes = _case(0, SIZES, m=14)
    fn = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, impl=impl, block=block or 256))
    want = _np_grouped(x, w, sizes)
    np.testing.assert_allclose(np.asarray(fn(x, w, sizes)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grouped_matmul_reference(x, w, sizes)), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(fn(x, w, sizes))[12:] == 0)  # past sum(sizes)=12


def test_blocked_gradients_equal_float64_reference():
    x, w, sizes = _case(1, [3, 0, 5, 2], m=11)
    cot = jax.random.normal(jax.random.key(2), (11, 3))

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w) * cot)

    got = jax.jit(jax.grad(loss(lambda x, w: grouped_matmul(x, w, sizes, impl="blocked", block=2)),
                           argnums=(0, 1)))(x, w)
    # float64 truth: dy = cot on the grouped rows; dx[r] = cot[r] w[g]^T, dw[g] = x_g^T cot_g
    X, W, C = (np.asarray(v, np.float64) for v in (x, w, cot))
    dx, dw = np.zeros_like(X), np.zeros_like(W)
    r = 0
    for g, s in enumerate(np.asarray(sizes)):
        dx[r:r + s] = C[r:r + s] @ W[g].T
        dw[g] = X[r:r + s].T @ C[r:r + s]
        r += s
    np.testing.assert_allclose(np.asarray(got[0]), dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), dw, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got[1])[1] == 0)  # the empty group gets no gradient


def test_blocked_bf16_keeps_fp32_output():
    x, w, sizes = _case(3, [2, 3], m=5)
    y = grouped_matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), sizes, impl="blocked", block=2,
                       preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32
    want = _np_grouped(x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32), sizes)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


def test_unknown_impl_is_named():
    x, w, sizes = _case(4, [1], m=1)
    with pytest.raises(ValueError, match="blocked"):
        grouped_matmul(x, w, sizes, impl="dense")


@pytest.mark.parametrize("impl", ["ragged", "blocked"])
def test_grouped_glu_mlp_equals_float64(impl):
    """The three matmuls sharing one block layout: each group's w2 silu(w1 x) * (w3 x)."""
    x, w1, sizes = _case(5, SIZES, m=14, d=5, f=4)
    rng = np.random.default_rng(6)
    w3 = jnp.asarray(rng.standard_normal(w1.shape).astype(np.float32))
    w2 = jnp.asarray(rng.standard_normal((len(SIZES), 4, 5)).astype(np.float32))
    glu = lambda a, b: jax.nn.silu(a) * b  # noqa: E731
    got = grouped_glu_mlp(x, w1, w3, w2, sizes, glu, compute_dtype=jnp.float32, impl=impl, block=3)
    a, b = _np_grouped(x, w1, sizes), _np_grouped(x, w3, sizes)
    h = a / (1 + np.exp(-a)) * b
    np.testing.assert_allclose(np.asarray(got), _np_grouped(h, w2, sizes), rtol=1e-5, atol=1e-5)
    assert got.dtype == jnp.float32
