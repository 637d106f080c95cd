"""Routed experts as compressed-tensors mxfp4-pack-quantized: the packer against a NumPy packer
written here from the format's description (E2M1 codes, element 2i in the low nibble, scale
byte 127 + exponent, a negative value rounding to zero keeping its sign), for both scale rules;
and an --mxfp4 export imports back as exactly the weights QAT's forward pass uses."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interchange_util import flat, micro_config, random_weights
from reference import np_mx
from safetensors.numpy import load_file

from k3jax.interchange.hf_reader import import_checkpoint
from k3jax.interchange.hf_writer import export_weights
from k3jax.interchange.mxfp4_pack import pack_mxfp4, unpack_mxfp4
from k3jax.ops.mx import E2M1, mx_quantize

# the eight E2M1 magnitudes; a code is sign << 3 | index
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def numpy_pack(w: np.ndarray, rule: str):
    """Element by element: quantize each block of 32 (tests/reference.np_mx), look each value up
    in the E2M1 table, and write two codes per byte, the even element in the low nibble."""
    q, exps = np_mx(w, "e2m1", rule)
    rows, n = w.shape
    packed = np.zeros((rows, n // 2), np.uint8)
    for r in range(rows):
        for i in range(n):
            s = int(exps[r, i // 32])
            mag = abs(q[r, i]) / 2.0 ** s
            code = E2M1_VALUES.index(mag) | (8 if np.signbit(q[r, i]) else 0)
            packed[r, i // 2] |= code if i % 2 == 0 else code << 4
    return packed, (exps + 127).astype(np.uint8)


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_pack_matches_numpy_packer(rule):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((5, 96)) * np.exp(rng.uniform(-6, 6, (5, 1)))).astype(np.float32)
    w[0, :32] = 0.0                      # an all-zero block: scale byte 0 (2^-127)
    w[1, 32:64] = 7.0 * np.sign(rng.standard_normal(32))  # saturates (ocp) or not (ceil)
    w[2, 5] = -1e-9                      # rounds to -0: code 0x8
    packed, scale = pack_mxfp4(w, rule)
    ref_p, ref_s = numpy_pack(w, rule)
    np.testing.assert_array_equal(scale, ref_s)
    np.testing.assert_array_equal(packed, ref_p)
    assert scale[0, 0] == 0 and packed[2, 2] >> 4 == 0x8  # element 5: high nibble of byte 2
    # bytes written out by hand: [1, -6, 0.5, 3] with amax 6 -> scale 2^0 under both rules
    w2 = np.zeros((1, 32), np.float32)
    w2[0, :4] = [1.0, -6.0, 0.5, 3.0]
    p2, s2 = pack_mxfp4(w2, rule)
    assert list(p2[0, :2]) == [0xF2, 0x51] and s2[0, 0] == 127
    # unpacking gives the quantizer's values back, bit for bit (signed zeros included)
    back = unpack_mxfp4(packed, scale)
    ref = np.asarray(mx_quantize(jnp.asarray(w), E2M1, axis=-1, rule=rule))
    np.testing.assert_array_equal(back, ref)
    np.testing.assert_array_equal(np.signbit(back), np.signbit(ref))


def test_pack_errors_name_the_tensor():
    with pytest.raises(ValueError, match="experts.3.w1.weight.*multiple of 32"):
        pack_mxfp4(np.ones((4, 48), np.float32), name="experts.3.w1.weight")
    w = np.ones((2, 32), np.float32)
    w[1, 3] = np.nan
    with pytest.raises(ValueError, match="w2.weight: holds non-finite"):
        pack_mxfp4(w, name="w2.weight")


def test_mxfp4_export_imports_as_the_qat_weights(tmp_path):
    cfg = micro_config(qat="mxfp4", qat_scale_rule="ceil")
    params, rest = random_weights(cfg.model, seed=3)
    export_weights(cfg, params, rest, tmp_path, mxfp4=True)
    conf = json.loads((tmp_path / "config.json").read_text())
    q = conf["quantization_config"]
    assert q["format"] == "mxfp4-pack-quantized" and q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    tensors = {}
    for f in tmp_path.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    name = "model.layers.2.block_sparse_moe.experts.1.w3"
    assert name + ".weight" not in tensors
    assert tensors[name + ".weight_packed"].dtype == np.uint8 and tensors[name + ".weight_packed"].shape == (32, 16)
    assert tensors[name + ".weight_scale"].shape == (32, 1)
    assert "model.layers.2.block_sparse_moe.shared_experts.up_proj" in q["ignore"]
    assert not any("experts." in n and "shared" not in n for n in q["ignore"])
    _, arrays = import_checkpoint(tmp_path, cfg)
    a, b = flat({"params": params, "rest": rest}), flat(arrays)
    qat = jax.jit(lambda w: mx_quantize(w, E2M1, axis=-2, rule="ceil"))  # QAT's weight quantizer (ExpertQuant)
    for k in a:
        if "['experts']" in k:  # k3jax [.., E, in, out]: the blocks run along `in`, axis -2
            ref = np.asarray(qat(a[k]))
            np.testing.assert_array_equal(b[k], ref, err_msg=k)
        elif any(t in k for t in ("A_log", "dt_bias", "conv1d", "router_bias")):  # kept fp32 in the file
            np.testing.assert_array_equal(b[k], a[k], err_msg=k)
        else:  # everything else went through bf16
            np.testing.assert_array_equal(b[k], a[k].astype(jnp.bfloat16).astype(np.float32), err_msg=k)
    # sharded over 8 devices (experts' `in` axis split below one 32-block): the same values
    from k3jax.config.schema import replace
    from train.setup import prepare

    cfg8 = replace(cfg, **{"mesh.data": 1, "mesh.fsdp": 2, "mesh.expert": 2, "mesh.tensor": 2})
    setup = prepare(cfg8)
    with jax.set_mesh(setup.mesh):
        _, sharded = import_checkpoint(tmp_path, cfg8, shardings={k: setup.shardings[k] for k in ("params", "rest")})
    c = flat(sharded)
    assert all(np.array_equal(b[k], c[k]) for k in b)
