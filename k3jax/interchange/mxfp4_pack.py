"""MXFP4 weights as the release stores them (compressed-tensors `mxfp4-pack-quantized`).

A weight W [out, in] (HF layout; `in` is the GEMM reduction axis) becomes
    weight_packed uint8 [out, in/2]: E2M1 codes, element 2i in the low nibble, 2i+1 in the high
    weight_scale  uint8 [out, in/32]: E8M0 block scales, the byte 127 + s for the scale 2^s.
An E2M1 code is sign << 3 | m, m indexing the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; a
negative value that rounds to zero keeps its sign (code 0x8), as the quantizer returns -0.0.

The elements and scales come from `k3jax.ops.mx.mx_quantize_parts`, the quantizer that QAT
trains through, with the run's `model.qat_scale_rule`: a QAT-trained weight exports to exactly
the values its forward pass used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.mx import BLOCK, E2M1, mx_quantize_parts

MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
QUANT_FORMAT = "mxfp4-pack-quantized"


@jax.jit(static_argnames=("rule",))
def _quantize(w, rule: str):
    return mx_quantize_parts(w, E2M1, axis=-1, rule=rule, block=BLOCK)


def pack_mxfp4(w: np.ndarray, rule: str = "ocp", *, name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float -> (weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32])."""
    if w.ndim != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"{name}: MXFP4 packing needs a [out, in] matrix with in a multiple of {BLOCK}, "
                         f"got shape {list(w.shape)}")
    q, s = jax.device_get(_quantize(jnp.asarray(w, jnp.float32), rule))
    if not np.all(np.isfinite(q)):
        raise ValueError(f"{name}: holds non-finite values; MXFP4 has no code for them")
    mag = np.searchsorted(MAGNITUDES, np.abs(q)).astype(np.uint8)  # exact: q is on the grid
    codes = (np.signbit(q).astype(np.uint8) << 3) | mag
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.astype(np.uint8), (s + 127).astype(np.uint8)


def unpack_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(weight_packed [out, n/2], weight_scale [out, n/32]) -> W [out, n] float32."""
    packed = np.asarray(packed, np.uint8)
    codes = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = packed & 0xF, packed >> 4
    vals = MAGNITUDES[codes & 7]
    vals = np.where(codes & 8, -vals, vals)
    if np.any(scale == 0xFF):
        raise ValueError("weight_scale holds 0xFF, the E8M0 NaN code")
    exps = np.repeat(np.asarray(scale, np.int32) - 127, BLOCK, axis=-1)
    if exps.shape != vals.shape:
        raise ValueError(f"weight_scale {list(scale.shape)} does not match weight_packed {list(packed.shape)} "
                         f"(one scale per {BLOCK} elements)")
    return np.ldexp(vals, exps).astype(np.float32)


def quantization_config(ignore: list[str], rule: str) -> dict:
    """The config.json `quantization_config` for routed experts in MXFP4 (groups of 32 along
    `in`), every module named in `ignore` left in bf16."""
    return {
        "quant_method": "compressed-tensors",
        "format": QUANT_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "format": QUANT_FORMAT,
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": BLOCK,
                        "symmetric": True, "dynamic": False, "scale_dtype": "uint8"},
            "input_activations": None,
            "output_activations": None,
        }},
        "ignore": ignore,
        "k3jax_scale_rule": rule,  # which MX scale rule chose the scale bytes (k3jax.ops.mx)
    }
