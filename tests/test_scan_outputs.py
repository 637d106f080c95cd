"""train/scan_outputs.py: scans start their stacked outputs uninitialised (AllocateBuffer on GPU).

On XLA:CPU `lax.empty` is zeros, which would hide a slot the loop never writes. Here its CPU
lowering fills with NaN instead, so every scan form below (plain, unrolled with a remainder,
fully unrolled, reverse, nested, under remat and autodiff, inside shard_map) must match a float64
Python loop that uses no scan at all: a slot left unwritten would be NaN.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax._src.lax import lax as lax_internal
from jax.sharding import PartitionSpec as P

from k3jax.config import ConfigError, load_config
from train import scan_outputs


def _nan_empty_lowering(ctx, *, shape, dtype, out_sharding):
    aval = ctx.avals_out[0]
    fill = np.array(np.nan if jnp.issubdtype(aval.dtype, jnp.floating) else np.iinfo(aval.dtype).min
                    if jnp.issubdtype(aval.dtype, jnp.integer) else True, aval.dtype)
    return [mlir.broadcast_in_dim(ctx, mlir.ir_constant(fill), aval, broadcast_dimensions=[])]


@pytest.fixture
def nan_buffers():
    """lax.empty is NaN (ints: their minimum) on XLA:CPU, and scans use it, for one test."""
    table = mlir._platform_specific_lowerings["cpu"]
    before = table.get(lax_internal.empty_p)
    mlir.register_lowering(lax_internal.empty_p, _nan_empty_lowering, platform="cpu", cacheable=False)
    was_active = scan_outputs.active()
    assert scan_outputs.install("uninitialized")
    try:
        yield
    finally:
        if before is None:
            del table[lax_internal.empty_p]
        else:
            table[lax_internal.empty_p] = before
        scan_outputs.install("uninitialized" if was_active else "zeros")


def _cell(h, w):
    """One step of every scan below: [R, D] x [D, D] -> [R, D]."""
    return jnp.tanh(h @ w) + 0.5 * h


def _loss_loop(ws, x, mods):
    """The reference: a Python loop, no scan. Sum of the last carry and of every step's two
    outputs (a float and, through `mods`, an integer-derived one)."""
    h, total = x, 0.0
    for w, m in zip(ws, mods):
        h = _cell(h, w)
        total = total + jnp.sum(h * h) + jnp.sum(h) * m
    return jnp.sum(h) + total


def _forms():
    """name -> loss(ws, x, mods) through lax.scan (the same value as _loss_loop)."""
    def with_scan(reverse=False, unroll=1, remat=False, nested=False):
        def loss(ws, x, mods):
            def body(h, wm):
                w, m = wm
                h = _cell(h, w)
                return h, (h * h, m * 3, jnp.sum(h))  # a float stack, an int stack, a scalar stack
            step = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable) \
                if remat else body
            if nested:  # the layers in pairs: an outer scan over an inner scan of two
                def pair(h, wm2):
                    h, ys = jax.lax.scan(step, h, wm2)
                    return h, ys
                wsp = ws.reshape(ws.shape[0] // 2, 2, *ws.shape[1:])
                h, (sq, m3, s) = jax.lax.scan(pair, x, (wsp, mods.reshape(-1, 2)))
                sq, m3, s = sq.reshape(-1, *sq.shape[2:]), m3.reshape(-1), s.reshape(-1)
            else:
                seq = (ws[::-1], mods[::-1]) if reverse else (ws, mods)
                h, (sq, m3, s) = jax.lax.scan(step, x, seq, reverse=reverse, unroll=unroll)
                if reverse:  # scan(reverse) over the reversed inputs runs them forward again
                    sq, m3, s = sq[::-1], m3[::-1], s[::-1]
            return jnp.sum(h) + jnp.sum(sq) + jnp.sum(s * (m3 // 3).astype(s.dtype))
        return loss
    return {"plain": with_scan(), "unroll2_remainder": with_scan(unroll=2), "fully_unrolled": with_scan(unroll=6),
            "reverse": with_scan(reverse=True), "remat": with_scan(remat=True),
            "nested_remat": with_scan(remat=True, nested=True)}


def _inputs():
    rng = np.random.default_rng(0)
    ws = rng.normal(0, 0.4, (6, 8, 8)).astype(np.float32)
    x = rng.normal(0, 1, (4, 8)).astype(np.float32)
    mods = np.array([1, -2, 3, 0, 2, -1], np.int32)
    return ws, x, mods


def test_lax_empty_is_nan_under_the_fixture(nan_buffers):
    """The check below can fail: a buffer nothing writes comes out NaN, and scans use lax.empty."""
    assert np.isnan(np.asarray(jax.jit(lambda: lax_internal.empty((3,), jnp.float32))())).all()
    text = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c, c), x, None, length=5)[1]).lower(jnp.ones(3)).as_text()
    assert "0x7FC00000" in text  # the stacked output starts as NaN


@pytest.mark.parametrize("form", list(_forms()))
def test_scan_outputs_match_a_float64_loop_with_nan_buffers(nan_buffers, form):
    ws, x, mods = _inputs()
    fn = _forms()[form]
    value, grads = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(ws, x, mods)
    with jax.enable_x64():
        ref_value, ref_grads = jax.value_and_grad(_loss_loop, argnums=(0, 1))(
            ws.astype(np.float64), x.astype(np.float64), mods.astype(np.float64))
    np.testing.assert_allclose(float(value), float(ref_value), rtol=2e-5)
    for g, r in zip(grads, ref_grads):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_scan_outputs_inside_shard_map_with_nan_buffers(nan_buffers):
    """The buffer's sharding and varying axes (pvary) under a mesh: each device scans its rows."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    ws, _, mods = _inputs()
    x = np.random.default_rng(1).normal(0, 1, (16, 8)).astype(np.float32)
    fn = _forms()["remat"]

    def per_device(ws, x):
        return jax.lax.psum(fn(ws, x, jnp.asarray(mods)), "data")

    sharded = jax.jit(jax.value_and_grad(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")),
                                                       out_specs=P()), argnums=(0, 1)))
    with jax.set_mesh(mesh):
        value, (gw, gx) = sharded(ws, jax.device_put(x, jax.NamedSharding(mesh, P("data"))))
    with jax.enable_x64():
        parts = [jax.value_and_grad(_loss_loop, argnums=(0, 1))(ws.astype(np.float64), x[2 * i:2 * i + 2]
                                                                .astype(np.float64), mods.astype(np.float64))
                 for i in range(8)]
    np.testing.assert_allclose(float(value), sum(float(v) for v, _ in parts), rtol=2e-5)
    np.testing.assert_allclose(np.asarray(gw), sum(np.asarray(g[0]) for _, g in parts), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gx), np.concatenate([np.asarray(g[1]) for _, g in parts]),
                               rtol=1e-4, atol=1e-5)


def _gpu_module(fn, *args) -> str:
    return jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()


def test_gpu_lowering_allocates_instead_of_filling():
    """Lowered for a GPU: the stacked outputs (forward, and the backward's weight gradients) come
    from AllocateBuffer, and with train.scan_output_init=zeros from jax's broadcast of zero."""
    ws, x, mods = _inputs()
    was_active = scan_outputs.active()
    try:  # a new function each time: jit's caches hold a function's lowering
        assert scan_outputs.install("zeros") is False
        jax_own = _gpu_module(jax.grad(_forms()["plain"]), ws, x, mods)
        assert scan_outputs.install("uninitialized") is True
        ours = _gpu_module(jax.grad(_forms()["plain"]), ws, x, mods)
    finally:
        scan_outputs.install("uninitialized" if was_active else "zeros")
    assert "AllocateBuffer" not in jax_own
    # forward: the float, int and scalar stacks; backward: ws's stacked gradient at least
    assert ours.count("AllocateBuffer") >= 4
    # a [6, 4, 8] stack filled with zero is gone; the backward's zero cotangents stay
    fills = lambda t: sum(1 for line in t.splitlines() if "broadcast_in_dim" in line and "tensor<6x4x8xf32>" in line)  # noqa: E731
    assert fills(ours) < fills(jax_own)


def test_bad_value_names_the_key():
    with pytest.raises(ValueError, match="train.scan_output_init"):
        scan_outputs.install("random")
    with pytest.raises(ConfigError, match="scan_output_init"):
        load_config("configs/k3-tiny.yaml", ["train.scan_output_init=random"])


def _h200_temp_bytes(num_devices: int) -> int:
    """A scan whose stacked output is split over `num_devices` H200s (compiled here, no GPU):
    XLA:GPU's temporaries per device for the value and gradient."""
    from jax.sharding import NamedSharding

    from k3jax.chips import CHIPS
    from train.plan.target import target_mesh
    from target_compiler import require_target_compiler

    require_target_compiler("gpu")
    mesh = target_mesh(CHIPS["h200"], num_devices, (num_devices,), ("data",))

    def loss(ws, x):
        h, ys = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w),) * 2, x, ws)
        return jnp.sum(h) + jnp.sum(ys * ys)

    ws = jax.ShapeDtypeStruct((16, 256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((8192, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):  # `loss` is a new function each call: lowered afresh under each form
        return jax.jit(jax.grad(loss)).lower(ws, x).compile().memory_analysis().temp_size_in_bytes


def test_a_mesh_keeps_jax_zeros():
    """On 8 H200s an AllocateBuffer is unsharded: the [16, 8192, 256] fp32 stack (134 MB) would
    be whole on every device. install() on more than one device keeps jax's zeros, and their
    per-device temporaries."""
    was_active = scan_outputs.active()
    try:
        scan_outputs.install("zeros")
        zeros = _h200_temp_bytes(8)
        assert scan_outputs.install("uninitialized", num_devices=1)  # forced: what 8 devices must not get
        forced = _h200_temp_bytes(8)
        assert scan_outputs.install("uninitialized", num_devices=8) is False and not scan_outputs.active()
        kept = _h200_temp_bytes(8)
        assert scan_outputs.install("uninitialized", num_devices=1)
        one = _h200_temp_bytes(1)
    finally:
        scan_outputs.install("uninitialized" if was_active else "zeros")
    stack = 16 * 8192 * 256 * 4
    assert forced >= zeros + stack // 2, (forced, zeros)  # the unsharded stack is there
    assert kept == zeros
    assert one > 0


def test_prepare_sets_it_from_the_mesh():
    from train.setup import prepare

    was_active = scan_outputs.active()
    try:
        prepare(load_config("configs/k3-tiny.yaml", ["mesh.num_devices=1"]))
        assert scan_outputs.active()
        prepare(load_config("configs/k3-tiny.yaml", ["mesh.num_devices=1", "train.scan_output_init=zeros"]))
        assert not scan_outputs.active()
        prepare(load_config("configs/k3-tiny.yaml", ["mesh.num_devices=2", "mesh.data=2"]))
        assert not scan_outputs.active()
    finally:
        scan_outputs.install("uninitialized" if was_active else "zeros")
