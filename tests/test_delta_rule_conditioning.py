"""The delta rule with alike keys and no decay: the case that sent the ladder's DeltaNet rung to
NaN on an H200 (chunk 64, fused kernels). With rows of L = beta k k^T alike, the powers of L
grow like binomials; an inverse built from their sums (the old doubling series) lost every digit
at chunk 64 even in exact fp32. Both the UT inverse on its own and the whole operator (XLA form
and the kernels in the Pallas interpreter, forward and every gradient) against float64: numpy's
inverse, the float64 loop in reference.py, and float64 autodiff of the token-recurrent form.

Keys share a direction (mean cosine ~0.8) and beta sits near 1, as in a trained DeltaNet layer;
the independent random keys of the other tests (cosine ~0) never exposed the problem."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from k3jax.ops import chunk_deltanet, chunk_gated_deltanet, recurrent_gated_deltanet
from k3jax.ops.delta_rule import unit_lower_inverse
from k3jax.ops.kda_kernels import intra
from reference import delta_rule_loop, rel_err

B, T, H, K = 1, 128, 2, 32  # two chunks of 64
HI = jax.lax.Precision.HIGHEST


def alike_keys(rng, shape, cosine):
    """Unit vectors whose pairwise cosine is ~`cosine` (a shared direction plus noise)."""
    shared = rng.standard_normal(shape[-1])
    shared /= np.linalg.norm(shared)
    noise = rng.standard_normal(shape) / np.sqrt(shape[-1])
    x = np.sqrt(cosine) * shared + np.sqrt(1 - cosine) * noise
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def block_inverse(L, in_place=intra.block_unit_lower_inverse):
    """The kernel's block-substitution inverse (intra.block_unit_lower_inverse, or
    tile_unit_lower_inverse) in a one-program pallas_call, interpreted: L copied into the output
    ref, inverted there in place."""
    C = L.shape[0]

    def kernel(l_in, l_out):
        l_out[...] = l_in[...]
        in_place(l_out, C, HI, interpret=True)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((C, C), jnp.float32), interpret=True)(L)


@pytest.mark.parametrize("inverse", [unit_lower_inverse, lambda L: intra.unit_lower_inverse(L, HI), block_inverse,
                                     functools.partial(block_inverse, in_place=intra.tile_unit_lower_inverse)],
                         ids=["xla", "kernel", "kernel_blocks", "kernel_tiles"])
@pytest.mark.parametrize("C", [16, 48, 64])
def test_ut_inverse_of_alike_rows(inverse, C):
    """Identical keys and beta = 1 (the worst case: the series' terms reach C(63, 31) ~ 1e18 at
    C = 64, the inverse's entries are 0 and +-1), and correlated keys with beta ~ 0.9."""
    rng = np.random.default_rng(C)
    same = np.tril(np.ones((C, C)), -1)
    k = alike_keys(rng, (C, 64), 0.8)
    beta = 1 / (1 + np.exp(-(2.0 + 0.3 * rng.standard_normal(C))))
    alike = np.tril(k @ k.T, -1) * beta[:, None]
    for L in (same, alike):
        want = np.linalg.inv(np.eye(C) + L)
        got = np.asarray(jax.jit(inverse)(jnp.asarray(L, jnp.float32)), np.float64)
        assert np.abs(got - want).max() < 1e-5, np.abs(got - want).max()


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    q = alike_keys(rng, (B, T, H, K), 0.8)
    k = alike_keys(rng, (B, T, H, K), 0.8)
    v = rng.standard_normal((B, T, H, K))
    beta = 1 / (1 + np.exp(-(2.0 + 0.5 * rng.standard_normal((B, T, H)))))  # ~0.88
    w = rng.standard_normal((B, T, H, K))  # loss weights
    return q, k, v, beta, w


f32 = functools.partial(jnp.asarray, dtype=jnp.float32)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_deltanet_forward_with_alike_keys(data, impl):
    q, k, v, beta, _ = data
    o, S = jax.jit(lambda *a: chunk_deltanet(*a, chunk_size=64, impl=impl))(*map(f32, (q, k, v, beta)))
    ref_o, ref_S = delta_rule_loop(q, k, v, None, beta, decay=None)
    assert rel_err(o, ref_o) < 1e-5, rel_err(o, ref_o)
    assert rel_err(S, ref_S) < 1e-5, rel_err(S, ref_S)


def _loss(fn, q, k, v, g, beta, w, **kw):
    o, S = fn(q, k, v, g, beta, **kw)
    return jnp.sum(o * w) + jnp.sum(S * S)


@pytest.mark.parametrize("impl,gate", [("pallas", None), ("pallas", "zero"), ("xla", None)])
def test_gradients_with_alike_keys_against_float64_recurrence(data, impl, gate):
    """gate None: DeltaNet (the kernels' no-gate form); "zero": gated DeltaNet with its gate
    exactly 0 (the gated kernels, decay factors all 1). Reference: float64 autodiff of the
    token-by-token recurrence (no chunks, no inverse)."""
    q, k, v, beta, w = data
    g = np.zeros((B, T, H))
    if gate is None:
        fn = lambda q, k, v, g, beta: chunk_deltanet(q, k, v, beta, chunk_size=64, impl=impl)  # noqa: E731
    else:
        fn = functools.partial(chunk_gated_deltanet, chunk_size=64, decay_bound=-5.0, impl=impl)
    grads = jax.jit(jax.grad(functools.partial(_loss, fn), argnums=(0, 1, 2, 3, 4)))(*map(f32, (q, k, v, g, beta, w)))
    with jax.enable_x64(True):
        ref = jax.grad(functools.partial(_loss, recurrent_gated_deltanet), argnums=(0, 1, 2, 3, 4))(
            *map(jnp.asarray, (q, k, v, g, beta, w)))
    for name, a, b in zip("q k v g beta".split(), grads, ref):
        if name == "g" and gate is None:
            continue  # DeltaNet has no gate input
        assert np.isfinite(np.asarray(a)).all(), name
        assert rel_err(a, b) < 1e-4, (name, rel_err(a, b))
