"""The experts' GLU backward kernel (k3jax.ops.glu_grad, Pallas interpreter on CPU) against
float64 derivatives by central differences, and on the kernel path against the XLA backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.glu_grad import glu_grad, glu_grad_reference, glu_of_gate_up, tile

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
    ref = glu_grad_reference(jnp.asarray(gu, jnp.float32), jnp.asarray(dh, jnp.float32), spec)
    np.testing.assert_allclose(np.asarray(ref, np.float64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    # forward: the GLU itself, and the custom VJP's gradient is the kernel's
    h = glu_of_gate_up(jnp.asarray(gu, jnp.float32), spec, True)
    np.testing.assert_allclose(np.asarray(h, np.float64), _glu_f64(spec, a, b), rtol=2e-6, atol=2e-6)
    g = jax.grad(lambda x: jnp.sum(glu_of_gate_up(x, spec, True) * jnp.asarray(dh, jnp.float32)))(
        jnp.asarray(gu, jnp.float32))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(got))


def test_bf16_rounds_once():
    """bf16 gate|up: the kernel computes in fp32 and rounds each gradient once, as the XLA
    backward does (`k3jax.layers.activations`): equal to it within one bf16 rounding."""
    from k3jax.layers.activations import apply_glu

    spec = SPECS[0]
    rng = np.random.default_rng(1)
    gu = jnp.asarray(rng.standard_normal((32, 64)) * 3, jnp.bfloat16)
    dh = jnp.asarray(rng.standard_normal((32, 32)), jnp.bfloat16)
    got = glu_grad(gu, dh, spec, interpret=True)
    _, vjp = jax.vjp(lambda x: apply_glu(spec, x[:, :32], x[:, 32:]), gu)
    want = vjp(dh)[0]
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


def test_launch_line_names_the_opt_in_kernels(monkeypatch):
    """A run says at start which not-yet-default kernels its config turned on; by default none."""
    import k3jax.ops.grouped_matmul as gm
    from k3jax.config import load_config
    from k3jax.kernel_paths import kernel_lines

    tiny = "configs/k3-tiny.yaml"
    assert not any(line.startswith("opt-in") for line in kernel_lines(load_config(tiny, []).model))
    line = kernel_lines(load_config(tiny, ["model.kda.conv_impl=pallas"]).model)[-1]
    assert line.startswith("opt-in: Pallas kernels, not yet timed") and "model.kda.conv_impl" in line
    monkeypatch.setattr(gm, "kernel_unavailable", lambda: None)  # the experts on tokamax's kernel path
    line = kernel_lines(load_config(tiny, ["model.moe.grouped_matmul=kernel", "model.moe.glu_grad=pallas"]).model)[-1]
    assert "model.moe.glu_grad" in line and "model.kda.conv_impl" not in line


def test_config_refuses_a_width_the_kernels_cannot_take():
    from k3jax.config import ConfigError, load_config

    tiny = "configs/k3-tiny.yaml"
    with pytest.raises(ConfigError, match="glu_grad"):
        load_config(tiny, ["model.moe.glu_grad=pallas", "model.moe.expert_hidden=40"])
    with pytest.raises(ConfigError, match="conv_impl"):
        load_config(tiny, ["model.kda.conv_impl=pallas", "model.kda.num_heads=3", "model.kda.head_dim=10"])
    load_config(tiny, ["model.moe.glu_grad=auto", "model.moe.expert_hidden=40"])  # auto: XLA's where it must
