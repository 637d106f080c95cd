"""MX (OCP Microscaling) fake quantization for quantization-aware training.

    x [..., K, ...] -> the same shape and dtype. Along `axis` (the GEMM's reduction axis), every
    run of `block` = 32 elements shares one scale X = 2^s with s in [-127, 127] (an E8M0 byte),
    and each element becomes X * q, q the element format's value nearest to x / X (ties to the
    even code), saturated at the format's largest magnitude.

Formats: MXFP4 = E2M1 elements, values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; MXFP8 = E4M3 elements
(one sign, 4 exponent, 3 mantissa bits, bias 7, largest value 448, smallest 2^-9, no inf).

The scale rule decides the scale byte of each block, so released bytes depend on it:

* "ocp" (OCP Microscaling v1.0): s = floor(log2 amax) - emax_elem, emax_elem = 2 (E2M1) or 8
  (E4M3). amax / X then lies in [2^emax, 2^(emax+1)), above the format's largest value for
  part of that range, so a block's largest elements may saturate (E2M1: 7 * 2^k -> 6 * 2^k).
* "ceil" (the MX rule of jax.nn.scaled_matmul and qwix): s = ceil(log2(amax / max_elem)), the
  smallest power of two with amax / X <= max_elem, so nothing saturates (7 * 2^k -> 8 * 2^k).
  The exponent is derived exactly from amax's and max_elem's binary exponents and mantissas, with
  no rounding division.

Both rules clamp s to [-127, 127] (E8M0 has no code below 2^-127; 0xFF is NaN), so an all-zero
block gets s = -127 and zeros. (jax.nn.scaled_matmul clamps the same way; qwix instead replaces
scales below ~2^-63 by 1, which zeroes such tiny blocks.) Exponents come from `jnp.frexp` and
powers of two are built from their bits: a cast to float8_e8m0fnu would round, not floor, and
float8_e4m3fn / float4_e2m1fn casts neither saturate (>= 464 becomes NaN) nor keep NaN (E2M1).

Non-finite input: a block holding NaN or ±inf becomes NaN in every element (and the other
blocks are unaffected). For a master weight or an activation this propagates to the loss, and
the training step's finiteness check stops the run ("loss or gradients are not finite") instead
of training on a silently zeroed block.

Arithmetic is fp32 (bf16 inputs are widened; the results, X * q, are exact in bf16 too) and exact.
fp32 subnormals (magnitude below 2^-126), in the input or in a result X * q (possible only where
X is near 2^-127), are flushed to a signed zero, the same on every backend (XLA:CPU would flush
them anyway; the E8M0 floor makes a few such results possible). The one result beyond fp32's
range, X * q = 2^128 (the ceil rule on a block whose amax rounds up to fp32's largest binade
boundary), is clamped to the largest fp32.

`mx_encode` / `mx_decode` are the same values as bytes (E4M3 codes and E8M0 scales), for sending.

`fake_quant` wraps `mx_quantize` in a straight-through estimator: its gradient is the identity
(the cotangent passes unchanged). `mx_quantize_reference` is the naive NumPy form: per block,
nearest value of the enumerated element grid.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

ScaleRule = Literal["ocp", "ceil"]
SCALE_MIN, SCALE_MAX = -127, 127  # E8M0 exponents (codes 0x00..0xFE)
BLOCK = 32


@dataclass(frozen=True)
class MXFormat:
    """A floating-point element format without inf/NaN codes in the finite range used:
    `mantissa` bits, smallest normal exponent `emin`, largest exponent `emax`, largest value `max`."""
    name: str
    mantissa: int
    emin: int
    emax: int
    max: float

    def grid(self) -> np.ndarray:
        """Every non-negative finite value, ascending (index = the element's code without sign)."""
        sub = [k * 2.0 ** (self.emin - self.mantissa) for k in range(2 ** self.mantissa)]
        normal = [(1 + k / 2 ** self.mantissa) * 2.0 ** e
                  for e in range(self.emin, self.emax + 1) for k in range(2 ** self.mantissa)]
        return np.array([v for v in sub + normal if v <= self.max])


E2M1 = MXFormat("e2m1", mantissa=1, emin=0, emax=2, max=6.0)
E4M3 = MXFormat("e4m3", mantissa=3, emin=-6, emax=8, max=448.0)


def _pow2(k):
    """2.0**k in fp32 built from its exponent bits; k int32 in [-126, 127]."""
    return jax.lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.uint32), jnp.float32)


def _times_pow2(q, s):
    """q * 2^s, exactly, by adding s to q's exponent bits: q fp32 zero or normal, s int32. A result
    below 2^-126 (an fp32 subnormal) becomes a signed zero, one beyond fp32's range the largest
    fp32. (A multiply by 2^s cannot be used: 2^-127 is itself subnormal, and XLA rewrites a divide
    by 2^-s into a multiply by 2^s.)"""
    bits = jax.lax.bitcast_convert_type(q, jnp.int32)
    exp = (bits >> 23) & 0xFF
    sign = bits & np.int32(-2 ** 31)
    out = jnp.where((exp == 0) | (exp + s <= 0), sign, bits + (s << 23))
    out = jnp.where(exp + s >= 255, sign | np.int32(0x7F7FFFFF), out)
    return jax.lax.bitcast_convert_type(out, jnp.float32)


def _flush(x):
    """fp32 subnormals -> signed zero, whatever the backend's denormal mode."""
    return jnp.where(jnp.abs(x) < np.float32(2.0 ** -126), x * 0, x)


def _split(x, axis: int, block: int):
    """[..., K, ...] -> [..., K/block, block, ...] (axis normalised, the block axis at axis + 1)."""
    axis = axis % x.ndim
    K = x.shape[axis]
    if K % block:
        raise ValueError(f"MX quantization needs the reduction axis ({K} elements) to be a multiple of the "
                         f"block size {block}")
    return x.reshape(x.shape[:axis] + (K // block, block) + x.shape[axis + 1:]), axis


def _block_exponent(amax, fmt: MXFormat, rule: str):
    """Scale exponent s [int32] of blocks with largest magnitude amax (finite, >= 0)."""
    mant, exp = jnp.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1) (exact for fp32 normals)
    if rule == "ocp":
        s = (exp - 1) - fmt.emax  # floor(log2 amax) - emax_elem
    elif rule == "ceil":
        fm, em = math.frexp(fmt.max)  # max_elem = fm * 2^em
        # smallest s with amax <= max_elem * 2^s, i.e. mant * 2^exp <= fm * 2^(em + s)
        s = exp - em + (mant > fm).astype(jnp.int32)
    else:
        raise ValueError(f"scale rule must be 'ocp' or 'ceil', got {rule!r}")
    # below the smallest fp32 normal every rule is already below 2^-127 (and frexp is unreliable
    # where the backend flushes subnormals): the E8M0 floor; all-zero blocks land here too
    s = jnp.where(amax < np.float32(2.0 ** -126), SCALE_MIN, s)
    return jnp.clip(s, SCALE_MIN, SCALE_MAX).astype(jnp.int32)


def _round_to_format(y, fmt: MXFormat):
    """Nearest value of `fmt` to y (fp32; ties to even), saturated at ±fmt.max."""
    a = jnp.abs(y)
    _, exp = jnp.frexp(a)
    e = jnp.where(a < np.float32(2.0 ** fmt.emin), fmt.emin, exp - 1)  # the binade; subnormals share emin's
    e = jnp.minimum(e, fmt.emax + 1)  # a no-op for the scaled values (< 2^(emax+1)); keeps _pow2 in range
    step = e - fmt.mantissa  # spacing of representable values in that binade: 2^step
    q = jnp.round(a * _pow2(-step)) * _pow2(step)  # jnp.round: half to even; both products exact
    q = jnp.minimum(q, np.float32(fmt.max))
    return jnp.where(jnp.signbit(y), -q, q)


def mx_quantize_parts(x, fmt: MXFormat, *, axis: int = -1, rule: ScaleRule = "ocp", block: int = BLOCK):
    """x [..., K, ...] -> (elements [..., K, ...] fp32, each a value of `fmt` (NaN in non-finite
    blocks), scale exponents [..., K/block, ...] int32 in [-127, 127]); x ~ elements * 2^s."""
    xb, ax = _split(_flush(x.astype(jnp.float32)), axis, block)
    amax = jnp.max(jnp.abs(xb), axis=ax + 1, keepdims=True)  # NaN if the block holds one
    finite = jnp.isfinite(amax)
    s = _block_exponent(jnp.where(finite, amax, 0.0), fmt, rule)
    # x / 2^s, exact unless the quotient is < 2^-126; s <= 126 for every finite fp32 block (s = 127
    # would need amax >= 2^129 (ocp) or > 6 * 2^126 (ceil)), so 2^-s is a normal fp32
    q = _round_to_format(xb * _pow2(-s), fmt)
    q = jnp.where(finite, q, jnp.nan)
    return q.reshape(x.shape), jnp.squeeze(s, ax + 1)


def mx_quantize(x, fmt: MXFormat, *, axis: int = -1, rule: ScaleRule = "ocp", block: int = BLOCK):
    """Fake quantization: x [..., K, ...] -> X * q with x's shape and dtype (no gradient rule;
    see `fake_quant`)."""
    q, s = mx_quantize_parts(x, fmt, axis=axis, rule=rule, block=block)
    qb, ax = _split(q, axis, block)
    out = jnp.where(jnp.isnan(qb), qb, _times_pow2(qb, jnp.expand_dims(s, ax + 1)))
    return out.reshape(x.shape).astype(x.dtype)


def mx_encode(x, fmt: MXFormat = None, *, rule: ScaleRule = "ocp", block: int = BLOCK):
    """x [..., K] -> bytes uint8 [..., K + K/block]: the MX elements along the last axis (E4M3
    codes, one byte each) followed by the blocks' E8M0 scale bytes (s + 127). What an MX GEMM
    reads, and what k3jax's expert-parallel exchange sends: `mx_decode` gives back exactly
    `mx_quantize(x, fmt)` (non-finite blocks: NaN), bit for bit. Only byte-wide element formats
    (E4M3) fit; E2M1 would pack two codes a byte."""
    fmt = E4M3 if fmt is None else fmt
    if fmt != E4M3:
        raise ValueError(f"mx_encode sends one byte per element: E4M3 only, got {fmt.name}")
    q, s = mx_quantize_parts(x, fmt, axis=-1, rule=rule, block=block)
    # every q is an E4M3 value (or NaN), so the cast is exact; -0 keeps its sign
    codes = jax.lax.bitcast_convert_type(q.astype(jnp.float8_e4m3fn), jnp.uint8)
    return jnp.concatenate([codes, (s + 127).astype(jnp.uint8)], axis=-1)


def mx_decode(encoded, dtype, *, block: int = BLOCK):
    """`mx_encode`'s bytes [..., K + K/block] -> X * q [..., K] in `dtype` (exact in bf16/fp32)."""
    K = encoded.shape[-1] * block // (block + 1)
    q = jax.lax.bitcast_convert_type(encoded[..., :K], jnp.float8_e4m3fn).astype(jnp.float32)
    s = encoded[..., K:].astype(jnp.int32) - 127
    qb = q.reshape(q.shape[:-1] + (K // block, block))
    out = jnp.where(jnp.isnan(qb), qb, _times_pow2(qb, s[..., None]))
    return out.reshape(q.shape).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def fake_quant(x, fmt: MXFormat, axis: int = -1, rule: ScaleRule = "ocp", block: int = BLOCK):
    """`mx_quantize` with a straight-through estimator: d fake_quant(x) / dx = identity."""
    return mx_quantize(x, fmt, axis=axis, rule=rule, block=block)


def _fake_quant_fwd(x, fmt, axis, rule, block):
    return mx_quantize(x, fmt, axis=axis, rule=rule, block=block), None


def _fake_quant_bwd(fmt, axis, rule, block, _, g):
    return (g,)


fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


@dataclass(frozen=True)
class ExpertQuant:
    """QAT of the routed-expert GEMMs: weights in `weights` format, the GEMM inputs (token rows
    and the GLU output) in `inputs` format, blocks along each GEMM's reduction axis, STE backward.
    Hashable, so it can be a static argument."""
    weights: MXFormat = E2M1
    inputs: MXFormat = E4M3
    rule: ScaleRule = "ocp"
    block: int = BLOCK

    def weight(self, w):
        """w [..., K, N] (x @ w reduces over K) -> fake-quantized w."""
        return fake_quant(w, self.weights, -2, self.rule, self.block)

    def input(self, x):
        """x [..., K] rows of a GEMM input -> fake-quantized x."""
        return fake_quant(x, self.inputs, -1, self.rule, self.block)


def expert_quant(qat: str, rule: str) -> ExpertQuant | None:
    """model.qat / model.qat_scale_rule -> the experts' quantization (None for qat='none')."""
    if qat == "none":
        return None
    if qat == "mxfp4":
        return ExpertQuant(rule=rule)
    raise ValueError(f"qat must be 'none' or 'mxfp4', got {qat!r}")


# ------------------------------------------------------------------------------------------
# naive reference


def mx_quantize_reference(x, fmt: MXFormat, *, axis: int = -1, rule: ScaleRule = "ocp", block: int = BLOCK):
    """NumPy float64, one block at a time: the scale from math.frexp of the block's amax, each
    element the nearest value of the enumerated grid (ties to the even code), saturating; fp32
    subnormals in and out flushed to signed zero."""
    x = np.ascontiguousarray(np.moveaxis(np.asarray(x, np.float64), axis, -1))
    tiny = 2.0 ** -126  # fp32 subnormals in and out: signed zero
    x = np.where(np.abs(x) < tiny, x * 0, x)
    grid = fmt.grid()
    out = np.empty_like(x)
    flat, res = x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1])
    for r in range(flat.shape[0]):
        for b0 in range(0, flat.shape[1], block):
            blk = flat[r, b0:b0 + block]
            if not np.all(np.isfinite(blk)):
                res[r, b0:b0 + block] = np.nan
                continue
            amax = float(np.max(np.abs(blk)))
            if amax == 0.0:
                s = SCALE_MIN
            else:
                m, e = math.frexp(amax)
                s = e - 1 - fmt.emax if rule == "ocp" else math.ceil(math.log2(amax / fmt.max))
                if rule == "ceil":  # log2 may round: settle on the smallest s with amax <= max * 2^s
                    while amax > fmt.max * 2.0 ** s:
                        s += 1
                    while amax <= fmt.max * 2.0 ** (s - 1):
                        s -= 1
                s = min(max(s, SCALE_MIN), SCALE_MAX)
            for i, v in enumerate(blk):
                y = abs(v) / 2.0 ** s
                j = int(np.searchsorted(grid, y))  # grid[j-1] < y <= grid[j]
                if j == len(grid):
                    q = grid[-1]
                elif j == 0 or grid[j] == y:
                    q = grid[j]
                else:
                    lo, hi = grid[j - 1], grid[j]
                    q = lo if (y - lo < hi - y or (y - lo == hi - y and (j - 1) % 2 == 0)) else hi
                mag = min(q * 2.0 ** s, float(np.finfo(np.float32).max))
                res[r, b0 + i] = math.copysign(mag if mag >= tiny else 0.0, v)
    return np.moveaxis(out, -1, axis)
