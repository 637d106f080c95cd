"""The MoE's flat token order (`flatten_tokens`) on a mesh: each device's flat piece holds exactly
its residual-stream tokens, so flattening and unflattening move nothing between devices.

What the MoE computes with it (equal to one device) is covered by test_sharding.py's
`test_train_step_on_a_mesh_equals_one_device` (meshes with 2 rows and 2 token pieces a device).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from k3jax.config import MeshConfig
from k3jax.layers.token_sharding import _token_spec, flat_token_axes, flatten_tokens, unflatten_tokens
from k3jax.sharding import make_mesh

B, T, D = 8, 16, 4  # 4 row pieces of 2 rows, 2 token pieces of 8 (sequence parallel over tensor)
COLLECTIVES = r"all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter"


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=2))


def _ids():
    """x[b, t, :] = b * T + t: every token names itself."""
    return np.broadcast_to((np.arange(B)[:, None] * T + np.arange(T)[None])[..., None], (B, T, D)).astype(np.float32)


def _compiled(mesh, fn):
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, _token_spec(jnp.zeros((B, T, D)), 0, mesh, True))
        flat = NamedSharding(mesh, P(flat_token_axes(B * T, mesh), None))
        return jax.jit(fn, in_shardings=rows, out_shardings=flat).lower(
            jax.ShapeDtypeStruct((B, T, D), jnp.float32)).compile(), rows


def test_flat_pieces_are_the_residual_pieces_and_move_nothing(mesh):
    step, rows = _compiled(mesh, flatten_tokens)
    x = jax.device_put(_ids(), rows)
    y = step(x)
    # the invariant: on every device, the flat piece's tokens are the residual piece's tokens
    by_device = {s.device: set(np.asarray(s.data)[..., 0].ravel().tolist()) for s in x.addressable_shards}
    for s in y.addressable_shards:
        assert set(np.asarray(s.data)[:, 0].tolist()) == by_device[s.device]
    assert not re.search(COLLECTIVES, step.as_text())
    # the plain reshape, for contrast: its pieces are other tokens, so XLA moves them
    plain, _ = _compiled(mesh, lambda a: a.reshape(B * T, D))
    assert re.search(COLLECTIVES, plain.as_text())


def test_unflatten_inverts_flatten_on_and_off_a_mesh(mesh):
    x = _ids() + np.random.default_rng(0).normal(size=(B, T, D)).astype(np.float32)
    np.testing.assert_array_equal(unflatten_tokens(flatten_tokens(x), B, T), x)  # no mesh: reshape
    np.testing.assert_array_equal(flatten_tokens(x), x.reshape(B * T, D))
    with jax.set_mesh(mesh):
        f = jax.jit(lambda a: unflatten_tokens(flatten_tokens(a), B, T))
        np.testing.assert_array_equal(f(x), x)
        # (row piece, token piece, row, token): the first flat piece is rows 0-1, tokens 0-7
        first = np.asarray(jax.jit(flatten_tokens)(x))[: 2 * (T // 2), 0]
        np.testing.assert_array_equal(first, x[:2, : T // 2, 0].ravel())
