"""The experts' weight-gradient kernel (Pallas interpreter) against float64 per-group products."""

import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.grouped_dw import grouped_dw, grouped_dw_reference, unsupported_reason


def _np_dw(x, dy, sizes):
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    out, r = [], 0
    for s in sizes:
        out.append(x[r:r + s].T @ dy[r:r + s])
        r += s
    return np.stack(out)


def test_grouped_dw_equals_float64_at_group_edges():
    """Groups that start and end inside a 16-row step, an empty first, middle and last group, a
    group longer than several steps, and 11 rows past sum(group_sizes) that must not count;
    two K and two N tiles so the program grid is walked in all three axes."""
    sizes = [0, 17, 3, 0, 40, 1, 0]
    M, K, N = 72, 32, 32
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
    dy = jnp.asarray(rng.standard_normal((M, N)).astype(np.float32))
    gs = jnp.asarray(sizes, jnp.int32)
    want = _np_dw(x, dy, sizes)
    got = grouped_dw(x, dy, gs, interpret=True, rows=16, tile_k=16, tile_n=16)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[[0, 3, 6]] == 0)
    np.testing.assert_allclose(np.asarray(grouped_dw_reference(x, dy, gs)), want, rtol=1e-5, atol=1e-5)


def test_grouped_dw_bf16_rounds_once_from_fp32():
    """bf16 operands, fp32 accumulation, one rounding to the output dtype."""
    sizes = [20, 12]
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((32, 32)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    got = grouped_dw(x, dy, gs, interpret=True, rows=16, tile_k=16, tile_n=16, out_dtype=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), _np_dw(x, dy, sizes), rtol=1e-5, atol=1e-5)
    got16 = grouped_dw(x, dy, gs, interpret=True, rows=16, tile_k=16, tile_n=16)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got16), np.asarray(got.astype(jnp.bfloat16)))


def test_grouped_dw_names_what_it_cannot_take():
    x, dy = jnp.zeros((32, 24)), jnp.zeros((32, 32))
    assert "multiples" in unsupported_reason(x, dy, 16, 16, 16)
    assert "power of two" in unsupported_reason(jnp.zeros((32, 16)), dy, 24, 16, 16)
    with pytest.raises(ValueError, match="grouped_dw: K=24"):
        grouped_dw(x, dy, jnp.asarray([32], jnp.int32), interpret=True, rows=16, tile_k=16, tile_n=16)
