"""train/muon.py: Newton-Schulz batched by shape, against optax's per-parameter form and float64."""

import math
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers as Dims
from optax.contrib._muon import orthogonalize_via_newton_schulz

from jax.sharding import PartitionSpec as P
from reference import newton_schulz_np
from train.muon import NS_COEFFS, muon, newton_schulz, orthogonalize

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "k3-tiny.yaml")
# k3-tiny cut down: one KDA and one MLA layer (a dense first layer, then an MoE one), 16 experts
SMALL_MODEL = ["model.layer_pattern=kda+mla", "model.attn_res_block_size=2", "model.d_model=64",
               "model.moe.latent_dim=32"]

# (shape, dims): plain, tall (its matrices are transposed to [4, 6]: stacked with the plain one),
# stacked layers, heads-merging [H, v, d] (reduce over H and v), a per-head view [R, d, H, K]
# (R and H batch axes), and a second per-head kernel of the same layout (stacked with it)
LEAVES = {
    "plain": ((4, 6), Dims(0, 1)),
    "tall": ((6, 4), Dims(0, 1)),
    "stacked": ((2, 4, 6), Dims(1, 2)),
    "merging": ((2, 3, 5), Dims((0, 1), 2)),
    "per_head": ((2, 7, 3, 4), Dims(1, 3)),
    "per_head_2": ((2, 7, 3, 4), Dims(1, 3)),
}


def _leaves(seed=0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(shape), jnp.float32) for k, (shape, _) in LEAVES.items()}


def _dots(fn, *args):
    """The dot_generals of fn's jaxpr (nested jaxprs included): [(lhs shape, rhs shape)]."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                out.append((e.invars[0].aval.shape, e.invars[1].aval.shape))
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def test_fp32_equals_optax_per_parameter_and_one_chain_per_shape():
    """float32: every leaf's result is optax's own per-parameter Newton-Schulz (same dims) to fp32
    rounding. With partition specs (shardings known, one device) the leaves run as one chain per
    [rows, cols]: 4 chains for 6 leaves (plain + stacked [4, 6], tall [6, 4], merging [6, 5],
    the two per-head kernels [7, 4]), each 3 matmuls a step and no loop; without specs only
    leaves of one batch shape share a chain (5: plain, stacked, tall, merging, per-head)."""
    steps = 4
    xs = _leaves()
    names = list(LEAVES)
    dims = [LEAVES[k][1] for k in names]
    args = [xs[k] for k in names]
    specs = [P()] * len(names)
    fn = lambda *x: orthogonalize(list(x), dims, steps=steps, dtype=jnp.float32, specs=specs)  # noqa: E731
    got = jax.jit(fn)(*args)
    for k, g in zip(names, got):
        want = orthogonalize_via_newton_schulz(xs[k], jnp.asarray(NS_COEFFS), steps, dimension_numbers=LEAVES[k][1])
        assert g.shape == xs[k].shape and g.dtype == jnp.float32
        np.testing.assert_allclose(g, want, atol=2e-6, err_msg=k)
    jaxpr = jax.make_jaxpr(fn)(*args)
    assert not [e for e in jaxpr.eqns if e.primitive.name in ("scan", "while")]
    dots = _dots(fn, *args)
    assert len(dots) == 4 * 3 * steps
    # the first matmul of each chain is its Gram matrix over every matrix of that shape, stacked
    grams = {lhs[1:]: lhs[0] for lhs, _ in dots[::3 * steps]}
    assert grams == {(4, 6): 3, (6, 4): 1, (6, 5): 1, (7, 4): 12}
    unknown = lambda *x: orthogonalize(list(x), dims, steps=steps, dtype=jnp.float32)  # noqa: E731
    assert len(_dots(unknown, *args)) == 5 * 3 * steps
    # and the per-head leaf is per head: each [d, K] slice (d=7 > K=4: a tall matrix) on its own
    x = np.asarray(xs["per_head"], np.float64)
    want = np.stack([np.stack([newton_schulz_np(x[r, :, h, :], steps) for h in range(3)], axis=1) for r in range(2)])
    np.testing.assert_allclose(got[names.index("per_head")], want, atol=5e-6)


def _rel(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


def test_bf16_against_float64():
    """bfloat16 (the default, as Moonlight and K2 run it) against the float64 iteration: each
    leaf within 0.06 in relative Frobenius norm (bf16 rounding of every iterate, amplified by
    the quintic's slope of 3.4 near zero: measured at most 0.041 over 20 seeds of these tiny
    shapes; the previous form, aX + (bA + cA^2)X with three bf16 roundings a step, 0.16), a
    96x64 matrix within 0.03 (measured 0.016), the singular values within 0.15 of the float64
    iteration's (the quintic leaves them in about [0.7, 1.2], not at 1), and far from another
    matrix's result."""
    xs = _leaves(1)
    names = list(LEAVES)
    got = jax.jit(lambda *x: orthogonalize(list(x), [LEAVES[k][1] for k in names], steps=5,
                                           specs=[P()] * len(names)))(*[xs[k] for k in names])
    for k, g in zip(names, got):
        assert g.dtype == jnp.float32  # back in the leaf's dtype
        shape, _ = LEAVES[k]
        x = np.asarray(xs[k], np.float64)
        if k in ("plain", "tall"):
            want = newton_schulz_np(x, 5)
        elif k == "stacked":
            want = np.stack([newton_schulz_np(m, 5) for m in x])
        elif k == "merging":
            want = newton_schulz_np(x.reshape(6, 5), 5).reshape(shape)
        else:
            want = np.stack([np.stack([newton_schulz_np(x[r, :, h, :], 5) for h in range(3)], axis=1) for r in range(2)])
        assert _rel(g, want) < 0.06, (k, _rel(g, want))
        if k == "plain":
            sv = np.linalg.svd(np.asarray(g, np.float64), compute_uv=False)
            np.testing.assert_allclose(sv, np.linalg.svd(want, compute_uv=False), atol=0.15)
            assert _rel(g, newton_schulz_np(np.asarray(xs["tall"], np.float64).T, 5)) > 0.8
    big = np.random.default_rng(3).standard_normal((96, 64))
    out = orthogonalize([jnp.asarray(big, jnp.float32)], [Dims(0, 1)], steps=5)[0]
    assert _rel(out, newton_schulz_np(big, 5)) < 0.03


def _per_matrix_np(x, dims, steps):
    """float64 Newton-Schulz of every matrix of x, one at a time: the axes in neither
    dims.reduction_axis nor dims.output_axis index the matrices; each is [prod(reduction), prod(output)]."""
    red = tuple(np.atleast_1d(dims.reduction_axis) % x.ndim)
    out = tuple(np.atleast_1d(dims.output_axis) % x.ndim)
    batch = tuple(a for a in range(x.ndim) if a not in red + out)
    t = np.transpose(x, batch + red + out)
    m, n = math.prod(x.shape[a] for a in red), math.prod(x.shape[a] for a in out)
    mats = t.reshape(-1, m, n)
    ortho = np.stack([newton_schulz_np(w, steps) for w in mats]).reshape(t.shape)
    return np.transpose(ortho, np.argsort(batch + red + out))


def test_small_config_per_head_and_expert_stacks_against_float64():
    """A small K3 config's Muon leaves under per-head Muon (KDA and MLA per-head views, stacked
    layers, expert stacks [E, d, f]) as build_optimizer hands them over, bf16 by default: every
    matrix within 0.06 (relative Frobenius norm) of its own float64 Newton-Schulz, computed one
    matrix at a time here; one chain per [rows, cols] of the config, and together the chains'
    Gram matmuls cover exactly as many matrices as the leaves hold."""
    from k3jax.config import load_config
    from train.muon import plan_groups
    from train.plan.optimizer import muon_leaves

    cfg = load_config(TINY, SMALL_MODEL + ["optimizer.name=muon", "optimizer.muon_per_head=true"])
    rng = np.random.default_rng(5)
    names, shapes, dims, specs = muon_leaves(cfg)  # build_optimizer's views of the Muon parameters
    leaves = [jnp.asarray(rng.standard_normal(s.shape), jnp.float32) for s in shapes]
    assert any("experts" in k for k in names) and any("q_proj" in k for k in names)
    fn = lambda *x: orthogonalize(list(x), dims, steps=5, specs=specs)  # noqa: E731
    got = jax.jit(fn)(*leaves)
    for name, x, d, g in zip(names, leaves, dims, got):
        want = _per_matrix_np(np.asarray(x, np.float64), d, 5)
        errs = [_rel(a, b) for a, b in zip(np.asarray(g).reshape(-1, *want.shape[-2:]),
                                           want.reshape(-1, *want.shape[-2:]))]
        assert max(errs) < 0.06, (name, max(errs))

    groups = plan_groups(leaves, dims, specs)
    covered = sorted(i for idx in groups.chains.values() for i in idx)
    assert covered == list(range(len(leaves))) and not groups.buckets
    shapes = {groups.layouts[i].matrix for i in range(len(leaves))}
    assert {key[1:] for key in groups.chains} == shapes
    dots = _dots(fn, *leaves)
    assert len(dots) == 15 * len(shapes)
    total = sum(math.prod(groups.layouts[i].batch) for i in range(len(leaves)))
    assert sum(lhs[0] for lhs, _ in dots[::15]) == total


def test_newton_schulz_zero_matrix_stays_finite():
    """A zero momentum (a parameter with no gradient yet) gives a zero update, not NaN."""
    out = newton_schulz(jnp.zeros((2, 3, 5)), steps=5)
    assert np.all(np.asarray(out, np.float32) == 0)


def test_transformation_is_optax_muon():
    """`muon` against optax.contrib.muon on the same tree (two Muon matrices, one leaf Muon does
    not take): the same state tree (checkpoints do not depend on which one ran) and, in fp32,
    the same two updates (momentum, Nesterov, Newton-Schulz, 0.2 sqrt(max(m, n)), decay, lr)."""
    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.standard_normal((4, 6)), jnp.float32),
              "stack": jnp.asarray(rng.standard_normal((3, 5, 2)), jnp.float32),
              "bias": jnp.zeros((6,), jnp.float32)}
    dims = {"w": Dims(0, 1), "stack": Dims(1, 2), "bias": None}
    kw = dict(weight_decay=0.1, consistent_rms=0.2, ns_steps=5)
    ours = muon(0.05, dimension_numbers=dims, dtype=jnp.float32, **kw)
    theirs = optax.contrib.muon(0.05, nesterov=True, muon_weight_dimension_numbers=dims, **kw)
    muon_only = {"w": params["w"], "stack": params["stack"], "bias": optax.MaskedNode()}  # as a partition hands it
    s_ours, s_theirs = ours.init(muon_only), theirs.init(muon_only)
    assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)
    assert [x.shape for x in jax.tree.leaves(s_ours)] == [x.shape for x in jax.tree.leaves(s_theirs)]
    for step in range(2):
        g = {"w": jnp.asarray(rng.standard_normal((4, 6)), jnp.float32),
             "stack": jnp.asarray(rng.standard_normal((3, 5, 2)), jnp.float32), "bias": optax.MaskedNode()}
        u_ours, s_ours = ours.update(g, s_ours, muon_only)
        u_theirs, s_theirs = theirs.update(g, s_theirs, muon_only)
        for k in ("w", "stack"):
            np.testing.assert_allclose(u_ours[k], u_theirs[k], atol=1e-6, err_msg=(step, k))


def test_sharded_leaves_give_the_one_device_result():
    """Leaves sharded over a 4-device mesh (a batch axis, as experts are over `expert`; a
    matrix axis, as FSDP shards one): the stacked chains give the one-device result, and the
    outputs keep the leaves' shardings."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    devices = jax.devices()[:4]
    if len(devices) < 4:  # the suite's conftest provides 8 host devices
        raise AssertionError("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    mesh = jax.sharding.Mesh(np.asarray(devices), ("x",))
    rng = np.random.default_rng(4)
    xs = [jnp.asarray(rng.standard_normal((4, 6, 8)), jnp.float32) for _ in range(2)]
    xs.append(jnp.asarray(rng.standard_normal((8, 12)), jnp.float32))
    dims = [Dims(1, 2), Dims(1, 2), Dims(0, 1)]
    specs = [P("x"), P("x"), P(None, "x")]
    fn = jax.jit(lambda *x: orthogonalize(list(x), dims, steps=3, dtype=jnp.float32))
    want = fn(*xs)
    sharded = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(xs, specs)]
    got = fn(*sharded)
    for g, w, s in zip(got, want, specs):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, s), g.ndim)


def test_known_shardings_on_a_mesh_give_the_one_device_result():
    """With partition specs: off a mesh every leaf is flattened into its [rows, cols] chain; on
    an fsdp 2 x expert 2 x tensor 2 mesh the leaves go in buckets of the same per-device piece
    and split (train/muon_mesh.py): the expert stacks split over `expert` along a batch axis
    (the tall one turned wide) in one, the replicated leaves in another, the leaf split along
    its matrix dimensions in a third; the result equals one device's, each output in its leaf's
    sharding (tests/test_muon_mesh.py: FLOPs per device, more meshes)."""
    from jax.sharding import NamedSharding

    from k3jax.config import MeshConfig
    from k3jax.sharding import make_mesh
    from train.muon import plan_groups

    rng = np.random.default_rng(6)
    shapes = [(2, 4, 6, 8), (2, 4, 6, 8), (1, 4, 8, 6), (6, 8), (3, 6, 8), (4, 16, 24)]
    xs = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    dims = [Dims(2, 3), Dims(2, 3), Dims(2, 3), Dims(0, 1), Dims(1, 2), Dims(1, 2)]
    specs = [P(None, "expert"), P(None, "expert"), P(None, "expert"), P(), P(), P(None, "fsdp", "tensor")]
    fn = lambda *x: orthogonalize(list(x), dims, steps=5, dtype=jnp.float32, specs=specs)  # noqa: E731
    want = jax.jit(fn)(*xs)
    assert sorted(plan_groups(xs, dims, specs).chains.values()) == [[0, 1, 3, 4], [2], [5]]  # one device
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=2))
    with jax.set_mesh(mesh):
        groups = plan_groups(xs, dims, specs)
        assert not groups.chains and sorted(b.leaves for b in groups.buckets) == [(0, 1, 2), (3, 4), (5,)]
        args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(xs, specs)]
        got = jax.jit(fn)(*args)
    for g, w, s in zip(got, want, specs):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, s), g.ndim)
