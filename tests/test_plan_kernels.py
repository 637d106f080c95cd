"""train.plan.kernels: the kernels a sharded program runs outside any shard_map, read from the
lowered program, against programs built here whose answer is known."""

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from k3jax.layers.conv import short_conv
from k3jax.ops.planning import planning_for
from k3jax.ops.short_conv_grad import short_conv_grad
from train.plan.kernels import unsharded_kernels

H200_MESH = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3,
                         abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
ARGS = (jax.ShapeDtypeStruct((4, 256), jnp.float32), jax.ShapeDtypeStruct((8, 64, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 3, 256), jnp.bfloat16))


def _lowered(fn) -> str:
    with planning_for("gpu", target_compiler=True), jax.sharding.use_abstract_mesh(H200_MESH):
        return jax.jit(fn).trace(*ARGS).lower(lowering_platforms=("cuda",)).as_text()


def test_the_conv_backward_runs_per_shard_and_a_bare_call_does_not():
    """The layer's conv backward (its Triton kernel under a shard_map, reached through a call
    from the manual computation) is not named; the same kernel called on the whole arrays under
    the mesh is, once per call; one call inside a shard_map and one outside: only the outside one."""
    def layer_grad(w, x, win):
        return jax.grad(lambda w, x, win: jnp.sum(short_conv(w, x, jnp.ones(x.shape[:2], jnp.int32), win,
                                                                impl="auto")[0].astype(jnp.float32)),
                        argnums=(0, 1, 2))(w, x, win)

    def bare(w, x, win):
        return short_conv_grad(w, x, win, jnp.zeros(x.shape[:2], jnp.int32), x)

    assert "__gpu$xla.gpu.triton" in _lowered(layer_grad)
    assert unsharded_kernels(_lowered(layer_grad)) == []
    assert unsharded_kernels(_lowered(bare)) == ["short_conv_grad"]
    assert unsharded_kernels(_lowered(lambda *a: (layer_grad(*a), bare(*a)))) == ["short_conv_grad"]


def test_braces_inside_strings_and_nested_regions():
    """A hand-written program: a kernel whose IR string holds an unbalanced brace, inside a
    manual computation; a function called from inside one and from outside; a kernel in a
    region nested in the manual computation; only the kernels reachable outside are named."""
    text = '''module @m {
  func.func public @main(%a: tensor<4xf32>) -> tensor<4xf32> {
    %0 = sdy.manual_computation(%a) in_shardings=[<@mesh, [{"x"}]>] out_shardings=[<@mesh, [{"x"}]>] manual_axes={"x"} (%b: tensor<2xf32>) {
      %1 = stablehlo.custom_call @__gpu$xla.gpu.triton(%b) {mhlo.backend_config = {ir = "{{{", name = "inside"}} : (tensor<2xf32>) -> tensor<2xf32>
      %2 = stablehlo.case %p {
        %3 = stablehlo.custom_call @__gpu$xla.gpu.triton(%1) {mhlo.backend_config = {name = "nested"}} : (tensor<2xf32>) -> tensor<2xf32>
        stablehlo.return %3 : tensor<2xf32>
      }
      %4 = func.call @shared(%2) : (tensor<2xf32>) -> tensor<2xf32>
      sdy.return %4 : tensor<2xf32>
    } : (tensor<4xf32>) -> tensor<4xf32>
    %5 = call @shared(%0) : (tensor<4xf32>) -> tensor<4xf32>
    %6 = call @only_inside_callers(%5) : (tensor<4xf32>) -> tensor<4xf32>
    return %6 : tensor<4xf32>
  }
  func.func private @shared(%c: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.custom_call @__gpu$xla.gpu.triton(%c) {mhlo.backend_config = {name = "shared_kernel"}} : (tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
  func.func private @only_inside_callers(%c: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.custom_call @tpu_custom_call(%c) {backend_config = "x"} : (tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}'''
    # @shared is called inside and outside: its kernel counts; @only_inside_callers is called
    # from main, outside: its (unnamed) kernel counts under its target
    assert unsharded_kernels(text) == ["shared_kernel", "tpu_custom_call"]
