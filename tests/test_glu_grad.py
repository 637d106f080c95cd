"""The experts' GLU backward (k3jax.ops.glu_grad), as the Pallas kernel (interpreter on CPU) and as
one XLA fusion, against float64 derivatives by central differences, and on the kernel path
against the plain GLU (autodiff on the two halves, the blocked form)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.glu_grad import glu_grad, glu_grad_reference, glu_grad_xla, glu_of_gate_up, tile

SPECS = [("situ", 4.0, 25.0), ("situ", 4.0, None), ("swiglu", 4.0, 25.0)]


def _glu_f64(spec, a, b):
    """The GLU as the design states it, float64: SiTU-GLU = [beta tanh(a/beta) sigmoid(a)] *
    [beta' tanh(b/beta')] (b itself when beta' is None); SwiGLU = silu(a) b."""
    name, beta, lb = spec
    sig = 1 / (1 + np.exp(-a))
    if name == "situ":
        return beta * np.tanh(a / beta) * sig * (b if lb is None else lb * np.tanh(b / lb))
    return a * sig * b


@pytest.mark.parametrize("spec", SPECS)
def test_kernel_equals_float64_central_differences(spec):
    """Rows and columns of 3 tiles each (16 x 16), inputs out to |a| = 12 (the tanh and sigmoid
    saturate), fp32 operands; both halves of d(gate|up)."""
    rng = np.random.default_rng(0)
    M, H = 48, 48
    gu = rng.standard_normal((M, 2 * H)) * 4
    dh = rng.standard_normal((M, H))
    a, b, e = gu[:, :H], gu[:, H:], 1e-6
    want = np.concatenate([dh * (_glu_f64(spec, a + e, b) - _glu_f64(spec, a - e, b)) / (2 * e),
                           dh * (_glu_f64(spec, a, b + e) - _glu_f64(spec, a, b - e)) / (2 * e)], axis=1)
    got = glu_grad(jnp.asarray(gu, jnp.float32), jnp.asarray(dh, jnp.float32), spec, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    fused = glu_grad_xla(jnp.asarray(gu, jnp.float32), jnp.asarray(dh, jnp.float32), spec)
    np.testing.assert_allclose(np.asarray(fused, np.float64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    ref = glu_grad_reference(jnp.asarray(gu, jnp.float32), jnp.asarray(dh, jnp.float32), spec)
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    # forward: the GLU itself, and the custom VJP's gradient is the chosen backward's
    every = jnp.int32(M)
    h = glu_of_gate_up(jnp.asarray(gu, jnp.float32), every, spec, "pallas")
    np.testing.assert_allclose(np.asarray(h, np.float64), _glu_f64(spec, a, b), rtol=2e-6, atol=2e-6)
    for backward, direct in (("pallas", got), ("xla", fused)):
        g = jax.grad(lambda x: jnp.sum(glu_of_gate_up(x, every, spec, backward) * jnp.asarray(dh, jnp.float32)))(
            jnp.asarray(gu, jnp.float32))
        np.testing.assert_array_equal(np.asarray(g), np.asarray(direct))


def test_rows_past_valid_rows_are_zero_whatever_they_hold():
    """The grouped GEMMs leave their unrouted rows unwritten, so the op zeroes rows >= valid_rows
    of h and of d(gate|up) by a select: NaN and inf there (forward input and cotangent) give
    exactly 0, and the valid rows equal the unmasked kernel's (checked against float64 above).
    valid_rows = 37 cuts the second of three 16-row tiles."""
    spec = SPECS[0]
    rng = np.random.default_rng(2)
    M, H, n = 48, 32, 37
    gu = rng.standard_normal((M, 2 * H)).astype(np.float32) * 3
    dh = rng.standard_normal((M, H)).astype(np.float32)
    gu_bad, dh_bad = gu.copy(), dh.copy()
    gu_bad[n:, ::2], gu_bad[n:, 1::2], dh_bad[n:] = np.nan, np.inf, np.nan
    whole = np.asarray(glu_grad(jnp.asarray(gu), jnp.asarray(dh), spec, interpret=True))
    got = np.asarray(glu_grad(jnp.asarray(gu_bad), jnp.asarray(dh_bad), spec, valid_rows=jnp.int32(n),
                              interpret=True))
    np.testing.assert_array_equal(got[:n], whole[:n])
    assert np.all(got[n:] == 0)
    fused = np.asarray(glu_grad_xla(jnp.asarray(gu_bad), jnp.asarray(dh_bad), spec, valid_rows=jnp.int32(n)))
    np.testing.assert_allclose(fused[:n], whole[:n], rtol=1e-6, atol=1e-6 * np.abs(whole).max())
    assert np.all(fused[n:] == 0)
    for backward, direct in (("pallas", got), ("xla", fused)):
        h, vjp = jax.vjp(lambda x: glu_of_gate_up(x, jnp.int32(n), spec, backward), jnp.asarray(gu_bad))
        np.testing.assert_allclose(np.asarray(h)[:n], _glu_f64(spec, gu[:n, :H].astype(np.float64),
                                                               gu[:n, H:].astype(np.float64)), rtol=2e-6, atol=2e-6)
        assert np.all(np.asarray(h)[n:] == 0)
        np.testing.assert_array_equal(np.asarray(vjp(jnp.asarray(dh_bad))[0]), direct)


def test_kernel_path_with_the_glu_op_equals_the_plain_glu(monkeypatch):
    """grouped_glu_mlp on the kernel path (tokamax's calls faked by per-group products whose
    unwritten rows hold NaN) with the packed GLU op, its backward as the kernel and as one XLA
    fusion, where neither GEMM masks the unrouted rows, against the blocked form, which runs the
    plain GLU on the two halves under autodiff (checked against float64 in
    tests/test_ops_grouped_matmul.py): equal outputs and gradients, zero rows past the routed
    ones, nothing non-finite anywhere."""
    import k3jax.ops.grouped_matmul as gm
    from test_ops_grouped_matmul import _case, _fake_tokamax

    _fake_tokamax(monkeypatch)
    garbage7 = gm._tokamax_call

    def nan_past_the_routed_rows(lhs, rhs, sizes, kind, out_dtype):
        y = garbage7(lhs, rhs, sizes, kind, out_dtype)
        if kind == "contract":
            return y
        past = jnp.arange(y.shape[0]) >= jnp.sum(sizes)
        return jnp.where(past[:, None], jnp.nan, y).astype(out_dtype)

    monkeypatch.setattr(gm, "_tokamax_call", nan_past_the_routed_rows)
    spec = SPECS[0]
    from k3jax.layers.activations import apply_glu

    x, w1, sizes = _case(7, [9, 0, 13, 10], m=48, d=16, f=16)  # rows 32..47 past the routed ones
    rng = np.random.default_rng(8)
    w1 = w1 * 0.3
    w3 = jnp.asarray(0.3 * rng.standard_normal(w1.shape).astype(np.float32))
    w2 = jnp.asarray(0.3 * rng.standard_normal((4, 16, 16)).astype(np.float32))
    cot = jnp.asarray(rng.standard_normal((48, 16)).astype(np.float32))

    def run(impl, glu_grad):
        def loss(x, w1, w3, w2):
            y = gm.grouped_glu_mlp(x, w1, w3, w2, sizes, lambda a, b: apply_glu(spec, a, b),
                                   compute_dtype=jnp.float32, impl=impl, block=16, glu_spec=spec, glu_grad=glu_grad)
            return jnp.sum(y * cot), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, w1, w3, w2)

    (_, y_plain), grads_plain = run("blocked", "xla")
    for glu_grad in ("pallas", "xla"):
        (_, y), grads = run("kernel", glu_grad)
        assert np.all(np.asarray(y)[32:] == 0) and np.all(np.isfinite(np.asarray(y)))
        np.testing.assert_allclose(np.asarray(y), np.asarray(y_plain), rtol=1e-5, atol=1e-6)
        for got, want in zip(grads, grads_plain):
            assert np.all(np.isfinite(np.asarray(got)))
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bf16_rounds_once():
    """bf16 gate|up: the kernel and the fused XLA backward compute in fp32 and round each
    gradient once, as the plain GLU's backward does (`k3jax.layers.activations`): equal to it
    within one bf16 rounding."""
    from k3jax.layers.activations import apply_glu

    spec = SPECS[0]
    rng = np.random.default_rng(1)
    gu = jnp.asarray(rng.standard_normal((32, 64)) * 3, jnp.bfloat16)
    dh = jnp.asarray(rng.standard_normal((32, 32)), jnp.bfloat16)
    _, vjp = jax.vjp(lambda x: apply_glu(spec, x[:, :32], x[:, 32:]), gu)
    want = vjp(dh)[0]
    for got in (glu_grad(gu, dh, spec, interpret=True), glu_grad_xla(gu, dh, spec)):
        assert got.dtype == want.dtype == jnp.bfloat16
        a, b = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.abs(a - b).max() <= 2 ** -7 * np.abs(b).max()


def test_tile_and_the_shapes_it_refuses():
    assert tile(jnp.zeros((262144, 1024))) == (64, 128)
    assert tile(jnp.zeros((48, 96))) == (16, 16)
    with pytest.raises(ValueError, match="must be multiples of 16"):
        glu_grad(jnp.zeros((20, 64)), jnp.zeros((20, 32)), SPECS[0], interpret=True)


def test_kernel_lowers_to_triton_for_h200():
    """At k3-small's expert shape (262,144 rows, H = 512, bf16) the kernel lowers through
    Pallas's Triton backend for an H200 (Triton's block rules, which the interpreter does not
    check): one Triton call."""
    from jax.sharding import AbstractDevice, AbstractMesh

    h200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                                     platform="gpu"))
    sd = jax.ShapeDtypeStruct
    with jax.sharding.use_abstract_mesh(h200):
        text = jax.jit(lambda gu, dh: glu_grad(gu, dh, SPECS[0])).trace(
            sd((262144, 1024), jnp.bfloat16), sd((262144, 512), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "glu_grad" in text


def test_backward_choice_names_the_config_key():
    from k3jax.ops.grouped_matmul import glu_backward

    assert glu_backward("auto", jnp.zeros((64, 256))) == "xla"  # off a GPU
    assert glu_backward("pallas", jnp.zeros((64, 256))) == "pallas"
    assert glu_backward("auto", jnp.zeros((20, 256))) == "xla"
    assert glu_backward("pallas", jnp.zeros((20, 256))) == "xla"  # the rows vary with the batch
    with pytest.raises(ValueError, match="model.moe.glu_grad=pallas: M=64 and H=20"):
        glu_backward("pallas", jnp.zeros((64, 40)))  # the config's width


def test_launch_line_names_the_conv_backward_and_the_opt_in_glu_kernel(monkeypatch):
    """A run says at start how its short convolutions' backward runs (XLA on CPU under the default
    auto, the kernel in the interpreter under pallas) and names the opt-in GLU kernel only when
    its config turned it on."""
    import k3jax.ops.grouped_matmul as gm
    from k3jax.config import load_config
    from k3jax.kernel_paths import kernel_lines

    tiny = "configs/k3-tiny.yaml"
    lines = kernel_lines(load_config(tiny, []).model)
    assert "short convolutions: xla" in lines and not any(line.startswith("opt-in") for line in lines)
    lines = kernel_lines(load_config(tiny, ["model.kda.conv_impl=pallas"]).model)
    assert any(line.startswith("short convolutions: backward kernel (Pallas, in the Pallas interpreter (no GPU); q and "
                               "k's l2 norm inside it") for line in lines)
    assert not any(line.startswith("short convolutions") for line in kernel_lines(
        load_config(tiny, ["model.layer_pattern=8*(mla)"]).model))  # no linear-attention layer
    monkeypatch.setattr(gm, "kernel_unavailable", lambda: None)  # the experts on tokamax's kernel path
    line = kernel_lines(load_config(tiny, ["model.moe.grouped_matmul=kernel", "model.moe.glu_grad=pallas"]).model)[-1]
    assert line.startswith("opt-in: experts' GLU backward kernel (model.moe.glu_grad)") and "no faster" in line


def test_config_refuses_a_width_the_kernels_cannot_take():
    from k3jax.config import ConfigError, load_config

    tiny = "configs/k3-tiny.yaml"
    with pytest.raises(ConfigError, match="glu_grad"):
        load_config(tiny, ["model.moe.glu_grad=pallas", "model.moe.expert_hidden=40"])
    with pytest.raises(ConfigError, match="conv_impl"):
        load_config(tiny, ["model.kda.conv_impl=pallas", "model.kda.num_heads=3", "model.kda.head_dim=10"])
    with pytest.raises(ConfigError, match="conv_impl.*head_dim must be a power of two"):  # q/k's norm per head
        load_config(tiny, ["model.kda.conv_impl=pallas", "model.kda.num_heads=3", "model.kda.head_dim=48"])
    load_config(tiny, ["model.moe.glu_grad=auto", "model.moe.expert_hidden=40"])  # auto: XLA's where it must


def test_xla_backward_is_one_fusion_for_h200():
    """The point of `glu_grad_xla`: compiled by XLA:GPU for an H200 (no device needed), the op's
    backward is one fusion that reads gate_up and dh and writes d(gate|up) in bf16, with no fp32
    [M, H] array in between (autodiff of the sliced forward stores the tanh/sigmoid terms in fp32,
    `loop_tanh_fusion`), and the forward is one more."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from k3jax.chips import CHIPS
    from train.plan.compile import PLAN_CODEGEN_OPTIONS
    from train.plan.target import target_mesh
    from target_compiler import require_target_compiler

    require_target_compiler("gpu")
    M, H = 256, 512
    mesh = target_mesh(CHIPS["h200"], 1, (1,), ("x",))
    sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))  # noqa: E731

    def fwd_bwd(gu, dh, n):
        h, vjp = jax.vjp(lambda x: glu_of_gate_up(x, n, SPECS[0], "xla"), gu)
        return h, vjp(dh)[0]

    text = jax.jit(fwd_bwd).lower(sd((M, 2 * H), jnp.bfloat16), sd((M, H), jnp.bfloat16), sd((), jnp.int32)).compile(
        compiler_options=PLAN_CODEGEN_OPTIONS).as_text()
    entry = text[text.index("ENTRY"):]
    kernels = [l for l in entry.split("\n") if " fusion(" in l or "custom-call(" in l]
    assert len(kernels) == 2, kernels
    assert sum(f"bf16[{M},2,{H}]" in l.split(" = ")[1].split(" fusion(")[0] for l in kernels) == 1, kernels
    assert not any("f32[" in l.split(" = ")[1].split(" fusion(")[0] for l in kernels), kernels
