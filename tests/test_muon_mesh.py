"""train/muon_mesh.py: Muon's Newton-Schulz on a mesh, each matrix once, on one device.

On 8 fake CPU devices over fsdp x expert x tensor meshes (and one with data replicas): the
update equals one device's, each output keeps its leaf's sharding, no leaf is gathered whole,
and the compiled program's per-device FLOPs (XLA's cost analysis) are the one-device program's
divided by the 8 devices that share the work, which is also the hand count of Newton-Schulz's
FLOPs over 8. The schedule (replica shares, chunks, padding per all-to-all) against hand counts.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as Dims

from k3jax.config import MeshConfig
from k3jax.sharding import make_mesh
from train.muon import orthogonalize, plan_groups
from train.muon_mesh import exchange_schedule

STEPS = 5
# (shape, dims, logical spec, matrices): each bucket's matrices split evenly over 8 devices on
# both meshes below, so every device orthogonalises exactly 1/8 of them
LEAVES = [
    ((2, 8, 24, 16), Dims(2, 3), P(None, "expert", "fsdp", "tensor"), 16),  # tall expert stack [24, 16]
    ((2, 8, 16, 24), Dims(2, 3), P(None, "expert", "tensor", "fsdp"), 16),  # wide, same pieces: same bucket
    ((8, 16, 32), Dims(1, 2), P(None, ("fsdp", "expert"), "tensor"), 8),    # split over every device
    ((8, 32, 16), Dims(1, 2), P(None, ("fsdp", "expert"), None), 8),        # copies on each tensor rank
    ((2, 16, 4, 8), Dims(1, 3), P(None, ("fsdp", "expert"), "tensor", None), 8),  # per head: heads a batch axis
    ((16, 6, 10), Dims(1, 2), P(), 16),                                     # replicated on every device
]
MESHES = {"fsdp2-expert2-tensor2": dict(data=1, fsdp=2, expert=2, tensor=2),
          "data2-fsdp2-tensor2": dict(data=2, fsdp=2, expert=1, tensor=2)}


def _ns_flops(rows, cols):
    """One matrix's Newton-Schulz by hand, on its wide side: per step X X^T, A A and P X."""
    r, c = min(rows, cols), max(rows, cols)
    return STEPS * (4 * r * r * c + 2 * r ** 3)


def _fn(xs):
    dims = [d for _, d, _, _ in LEAVES]
    specs = [s for _, _, s, _ in LEAVES]
    return orthogonalize(list(xs), dims, steps=STEPS, dtype=jnp.float32, specs=specs)


@pytest.fixture(scope="module")
def one_device():
    """The leaves, one device's result and its compiled FLOPs (shared by the mesh cases)."""
    rng = np.random.default_rng(7)
    xs = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape, *_ in LEAVES]
    compiled = jax.jit(lambda *x: _fn(x)).lower(*xs).compile()
    return xs, compiled(*xs), compiled.cost_analysis()["flops"]


def test_one_device_flops_are_newton_schulz(one_device):
    """The hand count of the matrices' Newton-Schulz FLOPs is what XLA's cost analysis counts
    for the one-device program, within its elementwise work (the polynomial, the norms: a few %)."""
    hand = 0
    for shape, dims, _, n in LEAVES:
        red = (dims.reduction_axis,) if isinstance(dims.reduction_axis, int) else dims.reduction_axis
        out = (dims.output_axis,) if isinstance(dims.output_axis, int) else dims.output_axis
        assert math.prod(shape) // (math.prod(shape[a] for a in red) * math.prod(shape[a] for a in out)) == n
        hand += n * _ns_flops(math.prod(shape[a] for a in red), math.prod(shape[a] for a in out))
    flops = one_device[2]
    assert hand <= flops <= 1.1 * hand, (flops, hand)


@pytest.mark.parametrize("case", list(MESHES))
def test_on_a_mesh_each_matrix_once_and_the_one_device_result(one_device, case):
    xs, want, flops_one = one_device
    mesh = make_mesh(MeshConfig(**MESHES[case]))
    with jax.set_mesh(mesh):
        groups = plan_groups(xs, [d for _, d, _, _ in LEAVES], [s for _, _, s, _ in LEAVES])
        fitted = [groups.placements[i].spec for i in range(len(xs))]
        args = [jax.device_put(x, NamedSharding(mesh, P(*s))) for x, s in zip(xs, fitted)]
        compiled = jax.jit(lambda *x: _fn(x)).lower(*args).compile()
        got = compiled(*args)
    # the tall and the wide expert stacks share a bucket; every leaf is in exactly one
    assert any(set(b.leaves) == {0, 1} for b in groups.buckets)
    assert sorted(i for b in groups.buckets for i in b.leaves) == list(range(len(xs)))
    for g, w, s in zip(got, want, fitted):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, P(*s)), g.ndim)
    # each device: 1/8 of the work, not all of it (no replica repeats a matrix)
    per_device = compiled.cost_analysis()["flops"]
    assert per_device == pytest.approx(flops_one / 8, rel=0.05), (per_device, flops_one)
    # no array of the per-device program is as large as a split leaf whole (4,096 elements, or
    # 6,144 for the expert stacks): the matrices are gathered whole one device's share at a time
    import re

    sizes = [math.prod(map(int, d.split(","))) for d in re.findall(r"f32\[([\d,]+)\]", compiled.as_text())]
    assert max(sizes) < 4096, max(sizes)


def test_exchange_schedule_by_hand():
    """A K3 expert bucket on fsdp 4 x tensor 8 (3,864 pieces a device, no replicas): 121 whole
    matrices a device in 4 chunks of 31, 30, 30, 30; the last chunk's 952 pieces padded to 960
    before the tensor exchange. A layer-0 dense bucket (3 pieces) over expert 64, fsdp 4, tensor
    8: padded to 64, then 4, then 8, one (zero for most devices) matrix each. Eight replicas of
    22 matrices: 3 each, the last replica's 1 padded."""
    share, chunks = exchange_schedule(3864, 1, (4, 8))
    assert share == 3864 and [c.matrices for c in chunks] == [31, 30, 30, 30]
    assert [c.count for c in chunks] == [992, 960, 960, 952] and [c.start for c in chunks] == [0, 992, 1952, 2912]
    assert chunks[0].padded == (992, 248) and chunks[3].padded == (952, 240)
    share, chunks = exchange_schedule(3, 1, (64, 4, 8))
    assert len(chunks) == 1 and chunks[0].padded == (64, 4, 8) and chunks[0].matrices == 1
    share, chunks = exchange_schedule(22, 8, (64, 4))
    assert share == 3 and len(chunks) == 1 and chunks[0].count == 3 and chunks[0].padded == (64, 4)
    share, chunks = exchange_schedule(16, 8, ())  # replicated on every device, nothing to exchange
    assert share == 2 and [(c.count, c.padded, c.matrices) for c in chunks] == [(1, (), 1), (1, (), 1)]
