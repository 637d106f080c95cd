"""FSDP at a layer's entry (k3jax/layers/weight_gather.py): which splits a weight keeps for its
computation, and that the rules and the layer agree on them."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.config import MeshConfig
from k3jax.layers.weight_gather import compute_spec, gather_layer_weights
from k3jax.ops.mesh_axes import TENSOR, TENSOR_SPLIT_NAMES
from k3jax.sharding import RULES, make_mesh


def test_tensor_split_names_are_the_rules_tensor_names():
    """The names the layer keeps split are exactly those the rules put on `tensor`."""
    assert {name for name, axes in RULES.items() if TENSOR in axes} == set(TENSOR_SPLIT_NAMES)


def test_compute_spec_keeps_only_tensor_parallel_splits():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=2))
    # a stacked [layers, embed, heads] kernel: FSDP's embed gathered, heads stay on tensor
    assert compute_spec((4, 64, 96), ("embed", "heads"), mesh) == P(None, None, TENSOR)
    # o_proj [heads, head_dim, embed]; the router [embed, expert]: nothing tensor-split
    assert compute_spec((6, 16, 64), ("heads", "head_dim", "embed"), mesh) == P(TENSOR, None, None)
    assert compute_spec((64, 16), ("embed", "expert"), mesh) == P(None, None)
    # tensor does not divide 3 heads: whole (as k3jax.sharding.rules' fit drops it)
    assert compute_spec((64, 3), ("embed", "heads"), mesh) == P(None, None)


def test_gathered_layer_weights_keep_their_values_and_drop_fsdp():
    """Under a mesh, a layer's state comes back with the same values, each weight split only
    over tensor (the FSDP split gone), and the routed experts' weights untouched."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, expert=1, tensor=2))
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)
    e = jnp.asarray(rng.standard_normal((4, 8, 6)), jnp.float32)
    state = nnx.State({"proj": nnx.Param(w, axes=("embed", "mlp")),
                       "experts": nnx.Param(e, axes=("expert", "latent", "expert_mlp"))})

    @jax.jit
    def f(state):
        out = gather_layer_weights(state)
        return out["proj"].get_value() * 1.0, out["experts"].get_value() * 1.0

    with jax.set_mesh(mesh):
        sharded = jax.tree.map(lambda v: v, state)
        sharded["proj"] = nnx.Param(jax.device_put(w, NamedSharding(mesh, P("fsdp", "tensor"))), axes=("embed", "mlp"))
        hlo = f.lower(sharded).compile().as_text()
        got_w, got_e = f(sharded)
    np.testing.assert_array_equal(np.asarray(got_w), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(got_e), np.asarray(e))
    assert "all-gather" in hlo  # the FSDP gather of proj over fsdp
    assert gather_layer_weights(state) is state  # no mesh: unchanged
