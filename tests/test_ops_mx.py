"""MX fake quantization (k3jax.ops.mx) bit for bit against a NumPy quantizer written from the
formats' definitions (tests/reference.py `np_mx`, over explicit E2M1 / E4M3 value grids): both
scale rules, ties, saturation, zero / tiny / huge / non-finite blocks, idempotence and the
straight-through gradient."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k3jax.ops.mx import E2M1, E4M3, ExpertQuant, fake_quant, mx_quantize, mx_quantize_parts, mx_quantize_reference
from reference import E2M1_GRID, E4M3_GRID, EMAX, FP32_MAX, GRIDS, np_mx

FMTS = {"e2m1": E2M1, "e4m3": E4M3}
RULES = ("ocp", "ceil")


def quantize(x, fmt, rule, axis=-1):
    return np.asarray(jax.jit(lambda v: mx_quantize(v, FMTS[fmt], axis=axis, rule=rule))(jnp.asarray(x)))


def test_grids_are_the_formats_values():
    """The grids above are exactly the codes 0..7 of float4_e2m1fn and 0..0x7E of float8_e4m3fn
    (ml_dtypes), in code order; the module's format descriptions enumerate the same values."""
    e2m1 = np.arange(8, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    e4m3 = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(e2m1, E2M1_GRID)
    np.testing.assert_array_equal(e4m3, E4M3_GRID)
    assert np.isnan(np.uint8(0x7F).view(ml_dtypes.float8_e4m3fn).astype(np.float64))
    np.testing.assert_array_equal(E2M1.grid(), E2M1_GRID)
    np.testing.assert_array_equal(E4M3.grid(), E4M3_GRID)
    assert len(E4M3_GRID) == 127 and E4M3_GRID[1] == 2.0 ** -9 and E4M3_GRID[-1] == 448


def special_blocks(fmt: str, rng) -> np.ndarray:
    """[n, 32] rows exercising ties, powers of two, saturation, zeros, tiny and huge blocks."""
    grid = GRIDS[fmt]
    top, emax = grid[-1], EMAX[fmt]
    mids = (grid[:-1] + grid[1:]) / 2  # every tie between neighbouring codes (X = 1: amax = 2^emax)
    rows = []
    for chunk in np.array_split(mids, -(-len(mids) // 31)):
        rows.append(np.concatenate([[2.0 ** emax], chunk, -chunk[: 31 - len(chunk)] if len(chunk) < 31 else []]))
    for k in (-20, -3, 0, 5, 40):
        base = rng.uniform(-1, 1, 32) * 2.0 ** k
        for top_val in (2.0 ** k, 6 * 2.0 ** k, 7 * 2.0 ** k, top * 2.0 ** k, 480 * 2.0 ** k, 1.5 * 2.0 ** k):
            r = base.copy()
            r[7] = top_val
            r[8] = -top_val * 0.75
            rows.append(r)
    rows.append(np.zeros(32))
    rows.append(-np.zeros(32))
    # tiny: scales at or near the E8M0 floor 2^-127, elements in the formats' subnormal ranges,
    # fp32 subnormal inputs and results (flushed)
    rows.append(rng.standard_normal(32) * 2.0 ** -123 + np.sign(rng.standard_normal(32)) * 2.0 ** -124)
    rows.append(np.where(np.arange(32) % 3, 2.0 ** -126, 0.0) * np.sign(rng.standard_normal(32)))
    rows.append(np.linspace(-1, 1, 32) * 2.0 ** -118)
    rows.append(np.linspace(-1, 1, 32) * 2.0 ** -110)
    rows.append(rng.standard_normal(32) * 1e-40)
    rows.append(np.concatenate([[1.5 * 2.0 ** -125], rng.standard_normal(31) * 2.0 ** -128]))
    rows.append(rng.uniform(-1, 1, 32) * 3.3e38)  # huge
    rows.append(np.full(32, -np.float32(3.4028235e38)))
    return np.stack([np.pad(r, (0, 32 - len(r)))[:32] for r in rows])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_bit_exact_against_numpy(fmt, rule):
    """Random blocks over 2^-100..2^100 and the special rows (all fp32-normal or zero) quantize
    bit for bit like the NumPy quantizer above, with the same scale exponents; so does the
    module's own NumPy reference."""
    rng = np.random.default_rng(7)
    rand = rng.standard_normal((24, 64)) * 2.0 ** rng.integers(-100, 100, (24, 1))
    rand[::5] *= rng.random((5, 64)) < 0.3  # sparse blocks
    x = np.concatenate([rand.reshape(-1, 32), special_blocks(fmt, rng)]).astype(np.float32)
    want, want_s = np_mx(x, fmt, rule)
    got = quantize(x, fmt, rule)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    assert np.all(np.signbit(got) == np.signbit(want))  # -0 stays -0
    _, s = jax.jit(lambda v: mx_quantize_parts(v, FMTS[fmt], rule=rule))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(s)[:, 0], want_s[:, 0])
    np.testing.assert_array_equal(mx_quantize_reference(x, FMTS[fmt], rule=rule), want)


def test_hand_checked_values():
    """A few outcomes written out: ties to even, 7 * 2^k saturating under ocp but not ceil,
    power-of-two amax, zero blocks, the E8M0 floor and the largest fp32."""
    def one(vals, fmt, rule):
        x = np.zeros(32, np.float32)
        x[: len(vals)] = vals
        _, s = mx_quantize_parts(jnp.asarray(x), FMTS[fmt], rule=rule)
        return np.asarray(mx_quantize(jnp.asarray(x), FMTS[fmt], rule=rule))[: len(vals)].tolist(), int(s[0])

    ties = [4, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5, -0.25]
    for rule in RULES:  # amax 4: X = 1 under both rules
        assert one(ties, "e2m1", rule) == ([4, 0, 1, 1, 2, 2, 4, 4, -4, -0.0], 0)
    q, s = one([7 * 2.0 ** 5, 1.0], "e2m1", "ocp")
    assert s == 5 and q == [6 * 2.0 ** 5, 0.0]  # 7 -> 6 (saturates), 1/32 -> 0
    q, s = one([7 * 2.0 ** 5, 1.0], "e2m1", "ceil")
    assert s == 6 and q == [8 * 2.0 ** 5, 0.0]  # 3.5 -> 4 (tie to even code 6)
    for rule in RULES:
        assert one([6 * 2.0 ** 5, 2.0 ** 5, 2.0 ** 3], "e2m1", rule) == ([6 * 2.0 ** 5, 2.0 ** 5, 0.0], 5)
        q, s = one([2.0 ** 9, 3 * 2.0 ** 5], "e2m1", rule)  # amax on a power of two: s = k - 2
        assert s == 7 and q == [2.0 ** 9, 2.0 ** 7]  # 0.75 -> 1 (tie between 0.5 and 1: even code)
        q, s = one([2.0 ** 9, 3 * 2.0 ** 5], "e4m3", rule)  # s = k - 8
        assert s == 1 and q == [2.0 ** 9, 3 * 2.0 ** 5]
        assert one([448.0, 17.0, 19.0, 3 * 2.0 ** -10], "e4m3", rule) == ([448, 16, 20, 2.0 ** -8], 0)
        assert one([0.0], "e2m1", rule) == ([0.0], -127) and one([0.0], "e4m3", rule) == ([0.0], -127)
        assert one([2.0 ** -125], "e2m1", rule) == ([2.0 ** -125], -127)  # clamped scale: 4 * 2^-127
        q, s = one([FP32_MAX, -2.0 ** 127 * 1.25], "e2m1", rule)  # ceil: 4 * 2^126 = 2^128 clamps
        assert q == ([6 * 2.0 ** 125, -4 * 2.0 ** 125] if rule == "ocp" else [FP32_MAX, -2.0 ** 127])
        assert s == (125 if rule == "ocp" else 126)
    q, s = one([480.0, 1.0], "e4m3", "ocp")
    assert s == 0 and q == [448.0, 1.0]  # saturates (a plain float8_e4m3fn cast: NaN at >= 464)
    q, s = one([480.0, 1.0], "e4m3", "ceil")
    assert s == 1 and q == [480.0, 1.0]


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_non_finite_blocks_become_nan(fmt):
    """NaN or +-inf anywhere in a block makes that whole block NaN (a cast to float4_e2m1fn
    would make NaN -0, a silent zero) and leaves the other blocks alone."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    x[0, 3], x[1, 40], x[2, 0] = np.nan, np.inf, -np.inf
    for rule in RULES:
        got = quantize(x, fmt, rule)
        assert np.isnan(got[0, :32]).all() and np.isnan(got[1, 32:]).all() and np.isnan(got[2, :32]).all()
        np.testing.assert_array_equal(got[0, 32:], np_mx(x[0, 32:], fmt, rule)[0].astype(np.float32))
        np.testing.assert_array_equal(got[3], np_mx(x[3], fmt, rule)[0].astype(np.float32))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_outputs_on_grid_idempotent_and_axis(fmt, rule):
    """Every output is a grid value times 2^s (s the block's exponent in [-127, 127]);
    q(q(x)) == q(x); blocks run along `axis` (a weight [E, K, N] along K), and bf16 inputs give
    the fp32 result rounded to bf16 exactly (the values fit)."""
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((3, 64, 5)) * 2.0 ** rng.integers(-30, 30, (3, 1, 5))).astype(np.float32)
    e, s = mx_quantize_parts(jnp.asarray(w), FMTS[fmt], axis=1, rule=rule)
    e, s = np.asarray(e), np.asarray(s)
    assert s.shape == (3, 2, 5) and s.min() >= -127 and s.max() <= 127
    assert np.isin(np.abs(e), GRIDS[fmt]).all()
    q = quantize(w, fmt, rule, axis=1)
    np.testing.assert_array_equal(q, e * 2.0 ** np.repeat(s, 32, axis=1))
    np.testing.assert_array_equal(quantize(q, fmt, rule, axis=1), q)
    moved = quantize(np.ascontiguousarray(np.moveaxis(w, 1, -1)), fmt, rule)
    np.testing.assert_array_equal(np.moveaxis(moved, -1, 1), q)
    np.testing.assert_array_equal(q, np_mx(w, fmt, rule, axis=1)[0].astype(np.float32))
    wb = jnp.asarray(w, jnp.bfloat16)
    qb = mx_quantize(wb, FMTS[fmt], axis=1, rule=rule)
    assert qb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(qb, np.float32), quantize(np.asarray(wb, np.float32), fmt, rule, axis=1))
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        mx_quantize(jnp.ones((4, 48)), FMTS[fmt])


def test_straight_through_gradient():
    """d/dx sum(c * fake_quant(x)) = c exactly (identity), for both formats, under jit, and for
    the experts' weight / input quantizers; the forward is mx_quantize's."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    for fmt in (E2M1, E4M3):
        for rule in RULES:
            val, g = jax.jit(jax.value_and_grad(lambda v: jnp.sum(c * fake_quant(v, fmt, -1, rule, 32))))(x)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(c))
            np.testing.assert_allclose(float(val), float(jnp.sum(c * mx_quantize(x, fmt, rule=rule))), rtol=1e-6)
    qat = ExpertQuant(rule="ceil")
    g = jax.grad(lambda w: jnp.sum(c.T * qat.weight(w)))(x.T)  # a weight [K=64, N=4] along K
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c.T))
    g = jax.grad(lambda v: jnp.sum(c * qat.input(v)))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))
    np.testing.assert_array_equal(np.asarray(qat.weight(x.T)), quantize(np.asarray(x.T), "e2m1", "ceil", axis=0))
    np.testing.assert_array_equal(np.asarray(qat.input(x)), quantize(np.asarray(x), "e4m3", "ceil"))


@pytest.mark.parametrize("rule", RULES)
def test_encoded_bytes_decode_to_the_quantized_values(rule):
    """mx_encode's bytes (E4M3 codes, then E8M0 scale bytes) decode to exactly mx_quantize's
    values, bit for bit, in fp32 and bf16: zero, tiny, huge, -0 and non-finite blocks included;
    the codes and scales are the NumPy quantizer's."""
    from k3jax.ops.mx import mx_decode, mx_encode

    rng = np.random.default_rng(4)
    x = (rng.standard_normal((6, 96)) * 2.0 ** rng.integers(-140, 120, (6, 96))).astype(np.float32)
    x[0, :32], x[0, 40] = 0.0, -0.0
    x[1, 3], x[2, 40], x[3, :32] = np.nan, np.inf, 1e-40
    for dt in (jnp.bfloat16, jnp.float32):
        v = jnp.asarray(x, dt)
        enc = jax.jit(lambda v: mx_encode(v, rule=rule))(v)
        assert enc.dtype == jnp.uint8 and enc.shape == (6, 96 + 3)
        dec = np.asarray(mx_decode(enc, dt))
        want = np.asarray(mx_quantize(v, E4M3, rule=rule))
        bits = np.uint16 if dt == jnp.bfloat16 else np.uint32
        np.testing.assert_array_equal(dec.view(bits), want.view(bits))
    # the fp32 input's bytes: E4M3 codes times 2^(scale byte - 127) are the NumPy quantizer's values
    ref, exps = np_mx(x, "e4m3", rule)
    codes = np.asarray(enc[:, :96]).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scales = np.asarray(enc[:, 96:]).astype(int) - 127
    ok = np.isfinite(ref)
    np.testing.assert_array_equal((codes * 2.0 ** np.repeat(scales, 32, axis=1))[ok], ref[ok])
    np.testing.assert_array_equal(scales[ok[:, ::32]], exps[ok[:, ::32]])
    with pytest.raises(ValueError, match="E4M3 only"):
        mx_encode(v, E2M1)
