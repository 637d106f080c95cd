"""The short convolution's Pallas backward (k3jax.ops.short_conv_grad, Pallas interpreter on
CPU) against a float64 gradient written here from the forward's definition, tap by tap."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.conv import conv_backward, short_conv
from k3jax.ops.short_conv_grad import loop_tiles, short_conv_grad, short_conv_grad_reference, tile
from k3jax.segments import segment_counter


def _grads_f64(w, x, win, seg, g):
    """float64: y[b,s,c] = SiLU(sum_i w[i,c] * x(s-W+1+i)[c], a tap counting 0 when its row lies in
    an earlier document; rows before 0 are the window, of x's first document). The gradient is
    scattered from each output back along its taps (the kernel gathers it: a different order)."""
    B, T, P = x.shape
    W = w.shape[0]
    r = np.cumsum(np.concatenate([np.zeros((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1), axis=1)
    dw, dx, dwin = np.zeros_like(w), np.zeros_like(x), np.zeros_like(win)

    def src(b, q):  # (value row, its segment) of x-coordinate q (q < 0: the window)
        return (win[b, q + W - 1], 0) if q < 0 else (x[b, q], r[b, q])

    for b in range(B):
        for s in range(T):
            taps = [src(b, s - W + 1 + i) for i in range(W)]
            on = [float(seg_q == r[b, s]) for _, seg_q in taps]
            acc = sum(w[i] * on[i] * taps[i][0] for i in range(W))
            sig = 1 / (1 + np.exp(-acc))
            dacc = g[b, s] * sig * (1 + acc * (1 - sig))
            for i in range(W):
                q = s - W + 1 + i
                dw[i] += on[i] * dacc * taps[i][0]
                if q < 0:
                    dwin[b, q + W - 1] += w[i] * on[i] * dacc
                else:
                    dx[b, q] += w[i] * on[i] * dacc
    return dw, dx, dwin


@pytest.mark.parametrize("W", [4, 3])
def test_kernel_gradient_equals_float64(W):
    """Documents start mid-row, on a tile boundary (row 16), one row after one (17) and inside
    the window's reach of row 0 (row 2); two row tiles of 16 and two channel tiles of 16, one
    tile per program and (tiles=2) both row tiles in one program's loop; both forms of the
    program (dacc recomputed per row offset, and once per row through the scratch)."""
    rng = np.random.default_rng(W)
    B, T, P = 2, 32, 32
    seg = np.ones((B, T), np.int32)
    seg[0, 16:] = 2
    seg[0, 17:] = 3
    seg[1, 2:] = 4
    seg[1, 27:] = 5
    w = rng.uniform(-0.6, 0.6, (W, P))
    x, win, g = rng.standard_normal((B, T, P)), rng.standard_normal((B, W - 1, P)), rng.standard_normal((B, T, P))
    want = _grads_f64(w, x, win, seg, g)
    r = segment_counter(jnp.asarray(seg))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    for form, tiles in (("recompute", 1), ("recompute", 2), ("two_pass", 1), ("two_pass", 2)):
        got = short_conv_grad(f32(w), f32(x), f32(win), r, f32(g), interpret=True, rows=16, channels=16, tiles=tiles,
                              form=form)
        for name, a, b in zip(("dw", "dx", "dwindow"), got, want):
            np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=2e-5, atol=2e-5 * np.abs(b).max(),
                                       err_msg=f"{name}, {form}, tiles={tiles}")
    # the plain form the module keeps beside the kernel agrees too
    for a, b in zip(short_conv_grad_reference(f32(w), f32(x), f32(win), r, f32(g)), want):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=2e-5, atol=2e-5 * np.abs(b).max())


def _dy_of_normalized_f64(w, x, win, seg, gn, group, eps):
    """float64: the cotangent of y = SiLU(conv(x)) from gn, that of n = y / sqrt(sum(y^2) + eps)
    over each `group` channels: dy = (gn - n <gn, n>) / sqrt(sum(y^2) + eps)."""
    B, T, P = x.shape
    W = w.shape[0]
    r = np.cumsum(np.concatenate([np.zeros((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1), axis=1)
    xp = np.concatenate([win, x], axis=1)
    rp = np.concatenate([np.zeros((B, W - 1), int), r], axis=1)
    acc = sum(w[i] * (rp[:, i:i + T] == r)[..., None] * xp[:, i:i + T] for i in range(W))
    y = (acc / (1 + np.exp(-acc))).reshape(B, T, P // group, group)
    norm = np.sqrt(np.sum(y * y, axis=-1, keepdims=True) + eps)
    n, g = y / norm, gn.reshape(y.shape)
    return ((g - n * np.sum(g * n, axis=-1, keepdims=True)) / norm).reshape(B, T, P)


@pytest.mark.parametrize("W", [4, 2])
def test_normalized_kernel_gradient_equals_float64(W):
    """normalize=(group, eps): the conv's output l2-normalised per group of 16 channels (KDA's q/k
    per head) and g its cotangent; the kernel (two channel tiles = two groups, 16-row tiles, in a
    loop of 2) against float64 (the norm's backward, then the conv's), and the plain form too.
    Documents start mid-row and within the window's reach; eps = 1e-6 as KDA's."""
    rng = np.random.default_rng(10 + W)
    B, T, P, group, eps = 2, 32, 32, 16, 1e-6
    seg = np.ones((B, T), np.int32)
    seg[0, 9:] = 2
    seg[1, 1:] = 3
    w = rng.uniform(-0.6, 0.6, (W, P))
    x, win, gn = rng.standard_normal((B, T, P)), rng.standard_normal((B, W - 1, P)), rng.standard_normal((B, T, P))
    want = _grads_f64(w, x, win, seg, _dy_of_normalized_f64(w, x, win, seg, gn, group, eps))
    r = segment_counter(jnp.asarray(seg))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    got = short_conv_grad(f32(w), f32(x), f32(win), r, f32(gn), interpret=True, rows=16, normalize=(group, eps))
    two = short_conv_grad(f32(w), f32(x), f32(win), r, f32(gn), interpret=True, rows=16, normalize=(group, eps),
                          form="two_pass")
    ref = short_conv_grad_reference(f32(w), f32(x), f32(win), r, f32(gn), normalize=(group, eps))
    for form, grads in (("kernel", got), ("two_pass kernel", two), ("reference", ref)):
        for name, a, b in zip(("dw", "dx", "dwindow"), grads, want):
            np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=5e-5, atol=5e-5 * np.abs(b).max(),
                                       err_msg=f"{form} {name}")


def _layer_case(seed, P, seg_start):
    """B 2 x T 32 x P channels, 4 taps; row `seg_start[0]` starts a second document at
    `seg_start[1]`; fp32 cotangents of the output and of the next window; and, per dtype (fp32
    with its tolerance, then bf16), the weight, x and window."""
    rng = np.random.default_rng(seed)
    B, T, W = 2, 32, 4
    seg = np.ones((B, T), np.int32)
    seg[seg_start[0], seg_start[1]:] = 2
    cy, cw = rng.standard_normal((B, T, P)), rng.standard_normal((B, W - 1, P))

    def inputs(dt):
        w = jnp.asarray(rng.uniform(-0.5, 0.5, (W, P)), jnp.float32)
        return w, jnp.asarray(rng.standard_normal((B, T, P)), dt), jnp.asarray(rng.standard_normal((B, W - 1, P)), dt)

    return seg, cy, cw, inputs


def test_normalized_layer_backwards_equal_the_conv_then_the_norm():
    """short_conv_normalized (KDA's q/k: conv, SiLU, l2 norm per head under one VJP) against
    short_conv followed by l2_normalize, the two layers KDA ran before, through jax.grad of the
    outputs and the next window, fp32 and bf16: the XLA backward equals it exactly (the same
    operations), the kernel's (interpreter) within fp32 rounding, and in bf16 within one rounding
    of the conv's cotangent."""
    from k3jax.layers.conv import short_conv_normalized
    from k3jax.layers.norms import l2_normalize

    B, T, P, group = 2, 32, 64, 32
    seg, cy, cw, inputs = _layer_case(11, P, (1, 13))
    for dt, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)):
        w, x, win = inputs(dt)

        def unfused(w, x, win):
            y, nxt = short_conv(w, x, jnp.asarray(seg), win, impl="xla")
            return l2_normalize(y.reshape(B, T, P // group, group), 1e-6).reshape(B, T, P), nxt

        def loss(f, w, x, win):
            n, nxt = f(w, x, win)
            return jnp.sum(n.astype(dt).astype(jnp.float32) * cy) + jnp.sum(nxt.astype(jnp.float32) * cw)

        want_n = unfused(w, x, win)[0]
        want = jax.grad(functools.partial(loss, unfused), argnums=(0, 1, 2))(w, x, win)
        for impl in ("xla", "pallas"):
            f = lambda w, x, win, impl=impl: short_conv_normalized(w, x, jnp.asarray(seg), win, group, 1e-6, impl=impl)  # noqa: E731
            np.testing.assert_array_equal(np.asarray(f(w, x, win)[0]), np.asarray(want_n))
            got = jax.grad(functools.partial(loss, f), argnums=(0, 1, 2))(w, x, win)
            for name, a, b in zip(("dw", "dx", "dwindow"), got, want):
                assert a.dtype == b.dtype
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                if impl == "xla":
                    np.testing.assert_array_equal(a, b, err_msg=f"{dt.__name__} {name}")
                else:
                    assert np.abs(a - b).max() <= tol * np.abs(b).max(), (dt, name, np.abs(a - b).max())


def test_layer_with_the_kernel_backward_equals_xla():
    """short_conv(impl="pallas") (the kernel in the interpreter, its default tile) against
    impl="xla", through jax.grad of the whole function (output and next window), fp32 and bf16."""
    seg, cy, cw, inputs = _layer_case(3, 128, (0, 20))
    for dt, tol in ((jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)):
        w, x, win = inputs(dt)

        def loss(impl, w, x, win):
            y, nxt = short_conv(w, x, jnp.asarray(seg), win, impl=impl)
            return jnp.sum(y.astype(jnp.float32) * cy) + jnp.sum(nxt.astype(jnp.float32) * cw)

        got = jax.grad(lambda *a: loss("pallas", *a), argnums=(0, 1, 2))(w, x, win)
        want = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2))(w, x, win)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.abs(a - b).max() <= tol * np.abs(b).max(), (dt, np.abs(a - b).max())


def test_backward_choice():
    """auto runs XLA off a GPU; pallas on a shape the kernel cannot take names the config key."""
    x = jnp.zeros((1, 64, 256))
    assert conv_backward("auto", x, 4) == "xla"
    assert conv_backward("pallas", x, 4) == "pallas"
    with pytest.raises(ValueError, match="model.kda.conv_impl=pallas: T=64 and P=40"):
        conv_backward("pallas", jnp.zeros((1, 64, 40)), 4)  # the config's width
    assert conv_backward("pallas", jnp.zeros((1, 1, 256)), 4) == "xla"  # a decode step: no kernel, no error
    assert conv_backward("auto", jnp.zeros((1, 20, 256)), 4) == "xla"
    # with q/k's norm inside: one power-of-two head per channel tile, else the config's fault
    assert conv_backward("pallas", jnp.zeros((1, 64, 256)), 4, norm_group=128) == "pallas"
    with pytest.raises(ValueError, match="model.kda.conv_impl=pallas: the normalised group of 48"):
        conv_backward("pallas", jnp.zeros((1, 64, 96)), 4, norm_group=48)
    assert conv_backward("auto", jnp.zeros((1, 64, 96)), 4, norm_group=48) == "xla"


def test_tile_is_the_largest_dividing_one():
    assert tile(jnp.zeros((8, 4096, 1536))) == (16, 64)
    assert loop_tiles(jnp.zeros((8, 4096, 1536)), 16) == 8  # 16 x 64 tiles, 8 per program: 256 x 8 x 24 programs
    assert tile(jnp.zeros((1, 48, 96))) == (16, 32)
    assert loop_tiles(jnp.zeros((1, 48, 96)), 16) == 1  # 3 tiles: none of 8, 4, 2 divides them
    assert tile(jnp.zeros((1, 64, 192))) == (16, 64)
    assert loop_tiles(jnp.zeros((1, 64, 192)), 16) == 4
    assert tile(jnp.zeros((1, 40, 96))) == (None, 32)


def test_kernel_lowers_to_triton_for_h200():
    """At k3-small's width (P = 1536, bf16, 4 taps) the kernel lowers through Pallas's Triton
    backend for an H200, which enforces Triton's rules (power-of-two blocks) that the
    interpreter does not: one Triton call, no transposes; with the default tiles (16 rows, 8 per
    program: a loop), one tile per program, 4 per program in a pipelined loop, and with KDA's l2
    norm per 128-channel head (row reductions inside the kernel); the two-pass form with and
    without the norm (its scratch block of 9 x 16 rows is not a power of two: only its 16-row
    slices are loaded and stored)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                                     platform="gpu"))
    sd = jax.ShapeDtypeStruct
    shapes = (sd((4, 1536), jnp.float32), sd((1, 256, 1536), jnp.bfloat16), sd((1, 3, 1536), jnp.bfloat16),
              sd((1, 256), jnp.int32), sd((1, 256, 1536), jnp.bfloat16))
    for kw in ({}, {"tiles": 1}, {"tiles": 4, "stages": 2}, {"normalize": (128, 1e-6)},
               {"form": "two_pass"}, {"form": "two_pass", "normalize": (128, 1e-6)}):
        with jax.sharding.use_abstract_mesh(h200):
            text = jax.jit(functools.partial(short_conv_grad, **kw)).trace(*shapes).lower(
                lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1 and "short_conv_grad" in text, kw


def test_kernel_backward_on_a_mesh_equals_one_device():
    """Under a mesh (8 CPU devices: data 2 x fsdp 2 x tensor 2) the kernel backward runs per
    shard (rows over data x fsdp, channels over tensor; the weight gradient summed over the row
    shards): every gradient equals the one-device XLA backward's, for the conv alone and for the
    conv with KDA's per-head l2 norm (whole heads per shard)."""
    from jax.sharding import AxisType

    rng = np.random.default_rng(5)
    B, T, P, W = 8, 32, 64, 4
    seg = np.ones((B, T), np.int32)
    seg[::3, 11:] = 2
    w = jnp.asarray(rng.uniform(-0.5, 0.5, (W, P)), jnp.float32)
    x, win = jnp.asarray(rng.standard_normal((B, T, P)), jnp.float32), jnp.asarray(rng.standard_normal((B, W - 1, P)),
                                                                                     jnp.float32)
    cy = jnp.asarray(rng.standard_normal((B, T, P)), jnp.float32)

    def grads(impl):
        loss = lambda w, x, win: jnp.sum(short_conv(w, x, jnp.asarray(seg), win, impl=impl)[0] * cy)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(w, x, win)

    def grads_normalized(impl):  # KDA's q/k form: two heads of 32 channels, one per tensor shard
        from k3jax.layers.conv import short_conv_normalized

        loss = lambda w, x, win: jnp.sum(short_conv_normalized(w, x, jnp.asarray(seg), win, 32, 1e-6,  # noqa: E731
                                                               impl=impl)[0] * cy)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(w, x, win)

    want, want_n = grads("xla"), grads_normalized("xla")
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    with jax.set_mesh(mesh):
        got, got_n = grads("pallas"), grads_normalized("pallas")
    for form, gs, ws in (("conv", got, want), ("conv + norm", got_n, want_n)):
        for name, a, b in zip(("dw", "dx", "dwindow"), gs, ws):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5,
                                       atol=2e-5 * np.abs(np.asarray(b)).max(), err_msg=f"{form} {name}")


def test_kernel_backward_is_one_shard_each_on_an_h200_mesh():
    """Traced for 8 H200s (data 2 x fsdp 2 x tensor 2, deviceless), the backward's Triton call
    sees one shard: 2 of the 8 rows and 768 of the 1,536 channels (its grid: 2 rows x 2
    programs of 8 16-row tiles x 12 channel tiles). A kernel left to XLA's SPMD partitioner would take every operand
    whole on each device (k3.yaml's plan: 310 GB of temporaries per device)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    from k3jax.ops.planning import planning_for

    mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3,
                        abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    sd = jax.ShapeDtypeStruct

    def loss(w, x, win):
        return jnp.sum(short_conv(w, x, jnp.ones((8, 256), jnp.int32), win, impl="auto")[0].astype(jnp.float32))

    with planning_for("gpu", target_compiler=True), jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
            sd((4, 1536), jnp.float32), sd((8, 256, 1536), jnp.bfloat16), sd((8, 3, 1536), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1
    assert "grid_x = 2 : i32, grid_y = 2 : i32, grid_z = 12 : i32" in calls[0]
    assert "tensor<2x256x768xbf16>" in calls[0]


def test_kda_layer_takes_the_backward_from_the_config():
    """model.kda.conv_impl reaches the three convs of a KDA layer: gradients of the layer's output
    with the kernel backward (interpreter) equal the XLA backward's."""
    from flax import nnx

    from k3jax.config import KDAConfig, ModelConfig
    from k3jax.layers.kda import DeltaMixer

    def grads(conv_impl):
        cfg = ModelConfig(d_model=32, compute_dtype="float32",
                          kda=KDAConfig(num_heads=2, head_dim=16, chunk_size=16, conv_impl=conv_impl))
        m = DeltaMixer(cfg, "kda", rngs=nnx.Rngs(0))
        assert {m.q_conv1d.impl, m.k_conv1d.impl, m.v_conv1d.impl} == {conv_impl}
        x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 32))
        seg = jnp.asarray(np.stack([np.repeat([0, 1], [13, 19]), np.zeros(32, int)]))
        graphdef, state = nnx.split(m)
        grad = jax.grad(lambda s: jnp.sum(nnx.merge(graphdef, s)(x, segment_ids=seg)[0] ** 2))
        g = jax.jit(grad)(state)  # one compile, not the layer's backward op by op
        jaxpr = str(jax.make_jaxpr(grad)(state))
        calls = jaxpr.count("name=short_conv_grad")  # three jitted calls (+ the kernel in their shared body)
        assert calls >= 3 if conv_impl == "pallas" else calls == 0
        return {str(k): v for k, v in jax.tree_util.tree_leaves_with_path(g) if "conv" in str(k)}

    got, want = grads("pallas"), grads("xla")
    assert len(got) == 3
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6 * np.abs(want[k]).max())
