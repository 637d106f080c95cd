"""The fused delta-rule kernels (k3jax.ops.kda_kernels), run by the Pallas interpreter on CPU:
outputs and final state against the float64 loop in reference.py, every gradient against
autodiff of the XLA form, the lineage's other gates, the path selection and its errors, the
mesh wrapper, and the Triton lowering of every kernel for an H200 (no GPU needed to lower).

Shapes are small but exercise what the kernels special-case: T not a multiple of the chunk
(padding), three documents in one row (resets inside a chunk and on a chunk edge), an initial
state, K != V, and chunks of 16, 32 and 64 rows (1, 2 and 4 sub-blocks)."""

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh

from k3jax.config import ConfigError, KDAConfig, MeshConfig, ModelConfig, load_config
from k3jax.layers.kda import DeltaMixer, chunk_path
from k3jax.ops import chunk_deltanet, chunk_gated_deltanet, chunk_kda
from k3jax.ops.delta_rule import select_impl
from k3jax.ops.kda_inputs import kda_inputs
from k3jax.ops.kda_kernels import Tuning
from k3jax.sharding import make_mesh
from reference import delta_rule_loop, pallas_kernels, rel_err

ROOT = Path(__file__).resolve().parents[1]
B, T, H = 2, 150, 2
SEG = np.stack([np.repeat([0, 1, 2], [40, 70, 40]), np.repeat([0, 1], [128, 22])])  # row 1: a start on a chunk edge
f32 = functools.partial(jnp.asarray, dtype=jnp.float32)


def inputs(seed, K, V, *, lower_bound=-5.0, decay="channel"):
    """l2-normalised q, k (as the layer feeds them), K3's bounded gate, sigmoid beta, an h0."""
    return kda_inputs(seed, B, T, H, K, V, lower_bound=lower_bound, decay=decay)


@functools.partial(jax.jit, static_argnames=("impl", "chunk_size", "fuse"))
def kda(q, k, v, g, beta, s0, seg, *, impl, chunk_size=64, fuse=-1):
    return chunk_kda(q, k, v, g, beta, initial_state=s0, segment_ids=seg, chunk_size=chunk_size, decay_bound=-5.0,
                     impl=impl, tuning=Tuning(fuse_output=fuse))


@pytest.mark.parametrize("K,V,chunk,fuse", [(32, 32, 64, 1), (64, 64, 64, 0), (32, 64, 32, -1), (16, 16, 16, 1)])
def test_forward_matches_float64_loop(K, V, chunk, fuse):
    """fuse: the output inside the state pass (1), in its own kernel (0), or by shape (-1)."""
    q, k, v, g, beta, s0 = inputs(K + V + chunk, K, V)
    o, S = kda(*map(f32, (q, k, v, g, beta, s0)), jnp.asarray(SEG), impl="pallas", chunk_size=chunk, fuse=fuse)
    ref_o, ref_S = delta_rule_loop(q, k, v, g, beta, initial_state=s0, segment_ids=SEG)
    assert o.dtype == jnp.float32 and S.dtype == jnp.float32 and o.shape == (B, T, H, V)
    assert rel_err(o, ref_o) < 2e-6, rel_err(o, ref_o)
    assert rel_err(S, ref_S) < 2e-6, rel_err(S, ref_S)


def test_bf16_inputs_against_float64_truth():
    """bf16 q/k/v: matmul operands in bf16 (as fla's kernels), state and accumulation fp32.
    Measured 3.9e-3 for o (one bf16 rounding of o is ~1.1e-3 rms) on the H200 and here."""
    q, k, v, g, beta, s0 = inputs(5, 32, 32)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    o, S = kda(*bf, f32(g), f32(beta), f32(s0), jnp.asarray(SEG), impl="pallas")
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    qr, kr, vr = (np.asarray(x.astype(jnp.float32), np.float64) for x in bf)
    ref_o, ref_S = delta_rule_loop(qr, kr, vr, g, beta, initial_state=s0, segment_ids=SEG)
    assert rel_err(o, ref_o) < 8e-3, rel_err(o, ref_o)
    assert rel_err(S, ref_S) < 5e-3, rel_err(S, ref_S)


def _loss(impl, q, k, v, g, beta, s0, w_o, w_s, seg, chunk_size=64):
    o, S = chunk_kda(q, k, v, g, beta, initial_state=s0, segment_ids=seg, chunk_size=chunk_size, decay_bound=-5.0,
                     impl=impl)
    return jnp.sum(o * w_o) + jnp.sum(S * w_s)


@pytest.mark.parametrize("K,V", [(32, 64), (64, 32)])
def test_gradients_match_xla_autodiff(K, V):
    """Every gradient (q, k, v, g, beta, h0) of a loss on o and the final state."""
    q, k, v, g, beta, s0 = inputs(9 + K, K, V)
    rng = np.random.default_rng(10)
    w_o, w_s = rng.standard_normal((B, T, H, V)), rng.standard_normal((B, H, K, V))
    args = list(map(f32, (q, k, v, g, beta, s0, w_o, w_s))) + [jnp.asarray(SEG)]
    grad = jax.jit(jax.grad(_loss, argnums=(1, 2, 3, 4, 5, 6)), static_argnums=0)
    gp, gx = grad("pallas", *args), grad("xla", *args)
    # dg sums terms that cancel (row and column sides of the same decay), so both fp32 forms
    # carry ~5e-6 of rounding there; against float64 autodiff both stay under 1e-5
    for name, a, b in zip("q k v g beta h0".split(), gp, gx):
        assert np.isfinite(np.asarray(a)).all(), name
        assert rel_err(a, b) < (2e-5 if name == "g" else 1e-6), (name, rel_err(a, b))


def test_gradient_of_gate_against_float64_autodiff():
    """The cancelling dg against the XLA form's autodiff in float64: the kernels' fp32 error."""
    q, k, v, g, beta, s0 = inputs(21, 32, 32)
    rng = np.random.default_rng(22)
    w_o, w_s = rng.standard_normal((B, T, H, 32)), rng.standard_normal((B, H, 32, 32))
    dg = jax.jit(jax.grad(_loss, argnums=4), static_argnums=0)("pallas", *map(f32, (q, k, v, g, beta, s0, w_o, w_s)),
                                                                jnp.asarray(SEG))
    with jax.enable_x64(True):
        dg64 = jax.jit(jax.grad(_loss, argnums=4), static_argnums=0)(  # one compile, not op by op
            "xla", *map(jnp.asarray, (q, k, v, g, beta, s0, w_o, w_s)), jnp.asarray(SEG))
    assert rel_err(dg, dg64) < 1e-5, rel_err(dg, dg64)


def test_kept_intermediates_skip_the_recompute_and_change_no_number():
    """kernel_residuals=intermediates: under the layer's remat (save_dots' names), the backward
    reads the forward's kernel-1 outputs and chunk states instead of running intra_chunk and
    state_forward again; every gradient is bit-identical to the recomputing form (the same
    kernels on the same inputs). Counted in the differentiated jaxpr: 1 + 1 against 2 + 2."""
    from jax.ad_checkpoint import checkpoint_name
    from k3jax.ops.remat_names import KDA_OUT, SAVED_BY_SAVE_DOTS

    args, _, (_, gx) = _variant_references()  # the variants' inputs, and the XLA form's gradients on them
    w_o = VARIANT_W_O
    policy = jax.checkpoint_policies.save_only_these_names(*SAVED_BY_SAVE_DOTS)

    def loss(keep, q, k, v, g, beta, s0):
        def layer(q, k, v, g, beta, s0):
            o, S = chunk_kda(q * 1.0, k, v, g, beta, initial_state=s0, segment_ids=jnp.asarray(SEG),
                             decay_bound=-5.0, impl="pallas", tuning=Tuning(keep_intermediates=keep))
            return jnp.sum(checkpoint_name(o, KDA_OUT) * w_o) + jnp.sum(S)  # S's own value is not needed
        return jax.checkpoint(layer, policy=policy)(q, k, v, g, beta, s0)

    grads = {}
    for keep in (0, 1):
        fn = jax.grad(functools.partial(loss, keep), argnums=range(6))
        calls = pallas_kernels(jax.make_jaxpr(fn)(*args))
        runs = 1 if keep else 2
        assert calls["kda_intra_chunk"] == runs and calls["kda_state_forward"] == runs, (keep, calls)
        assert calls["kda_state_backward"] == calls["kda_wy_grad"] == calls["kda_score_grad"] == 1, calls
        grads[keep] = jax.jit(fn)(*args)
    for name, a, b in zip("q k v g beta h0".split(), grads[0], grads[1]):
        np.testing.assert_array_equal(a, b, err_msg=name)
    # and the kept form against the XLA form's autodiff (the recomputing form has its own test)
    for name, a, b in zip("q k v g beta h0".split(), grads[1], gx):
        assert rel_err(a, b) < (2e-5 if name == "g" else 1e-6), (name, rel_err(a, b))


VARIANTS = {  # a variant, and a setting of its key that is refused
    "slices16": (Tuning(intra_block_k=16), Tuning(intra_block_k=24), "intra_block_k=24"),
    "inverse_blocks": (Tuning(intra_inverse=1), Tuning(intra_inverse=3), "intra_inverse=3"),
    "inverse_tiles": (Tuning(intra_inverse=2), Tuning(intra_inverse=3), "intra_inverse=3"),
    "split": (Tuning(intra_split=1), Tuning(intra_split=2), "intra_split=2"),
    "split_inverse_blocks": (Tuning(intra_split=1, intra_inverse=1), Tuning(intra_split=1, intra_inverse=3),
                             "intra_inverse=3"),
    "cumsum_kernel": (Tuning(cumsum_kernel=1), Tuning(cumsum_kernel=2), "cumsum_kernel=2"),
    "score_split": (Tuning(score_split_k=2), Tuning(score_split_k=3), "split_k=3"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_intra_kernel_variants(name):
    """Kernel 1's variants give the default form's numbers: Tuning.intra_block_k=16 (K and V in two
    16-wide slices instead of one 32-wide one: its per-slice exps, dots and stores),
    Tuning.intra_inverse=1 (the UT inverse by 16 x 16 block substitution; chunk 64: four blocks,
    and the backward reads its Ainv) and =2 (the same in registers), Tuning.intra_split=1 (kernel 1 as two kernels, with either
    inverse; the second inverts the first's L in place when by blocks) and Tuning.cumsum_kernel=1
    (the gate's in-chunk cumsum and its transpose as kernels; the transpose's total - cumsum form
    rounds differently, within the g tolerance), and the backward's Tuning.score_split_k=2 (the
    score-gradient kernel's channels over two programs per block, dbeta summed from their halves
    in XLA; dg's cancelling terms round as 16- against 32-wide products, measured 2.2e-6): the
    loss and every gradient as the default form's and the XLA form's; a bad setting of each key
    is refused by name."""
    variant, bad, match = VARIANTS[name]
    args, default, (lx, gx) = _variant_references()
    tuned = jax.jit(jax.value_and_grad(functools.partial(_variant_loss, variant), argnums=range(6)))(*args)
    assert abs(float(tuned[0]) - float(lx)) <= 1e-5 * abs(float(lx)), (tuned[0], lx)
    for name, a, b, c in zip("q k v g beta h0".split(), default[1], tuned[1], gx):
        assert rel_err(a, b) < (2e-5 if name == "g" else 1e-6), (name, rel_err(a, b))
        assert rel_err(b, c) < (2e-5 if name == "g" else 1e-6), (name, rel_err(b, c))
    with pytest.raises(ValueError, match=match):
        jax.grad(functools.partial(_variant_loss, bad), argnums=0)(*args)


VARIANT_W_O = np.random.default_rng(63).standard_normal((B, T, H, 32)).astype(np.float32)


def _variant_loss(tuning, q, k, v, g, beta, s0):
    o, S = chunk_kda(q, k, v, g, beta, initial_state=s0, segment_ids=jnp.asarray(SEG), decay_bound=-5.0,
                     impl="pallas", tuning=tuning)
    return jnp.sum(o * VARIANT_W_O) + jnp.sum(S)


@functools.cache
def _variant_references():
    """The variants' inputs, and the default form's and the XLA form's loss and gradients on them:
    computed once for every variant (each is an interpreted-kernel compile and run)."""
    q, k, v, g, beta, s0 = inputs(62, 32, 32)
    args = list(map(f32, (q, k, v, g, beta, s0)))
    default = jax.jit(jax.value_and_grad(functools.partial(_variant_loss, Tuning()), argnums=range(6)))(*args)
    xla = jax.jit(jax.value_and_grad(loss_xla, argnums=range(6)))(*args, f32(VARIANT_W_O))
    return args, default, xla


def loss_xla(q, k, v, g, beta, s0, w_o):
    o, S = chunk_kda(q, k, v, g, beta, initial_state=s0, segment_ids=jnp.asarray(SEG), decay_bound=-5.0, impl="xla")
    return jnp.sum(o * w_o) + jnp.sum(S)


def test_gated_deltanet_and_deltanet_run_the_same_kernels():
    """A per-head gate is broadcast over K; DeltaNet runs with no decay (in both forms of kernel 1)."""
    q, k, v, g, beta, s0 = inputs(30, 32, 32, decay="scalar")
    args = list(map(f32, (q, k, v, g, beta)))
    o, S = chunk_gated_deltanet(*args, initial_state=f32(s0), segment_ids=jnp.asarray(SEG), decay_bound=-5.0,
                                impl="pallas")
    ref_o, ref_S = delta_rule_loop(q, k, v, g, beta, initial_state=s0, segment_ids=SEG, decay="scalar")
    assert rel_err(o, ref_o) < 2e-6 and rel_err(S, ref_S) < 2e-6
    ref_o, ref_S = delta_rule_loop(q, k, v, None, beta, initial_state=s0, segment_ids=SEG, decay=None)
    for tuning in (Tuning(), Tuning(intra_split=1, intra_inverse=2)):  # kernel 1 split: its no-gate form too
        o, S = chunk_deltanet(args[0], args[1], args[2], args[4], initial_state=f32(s0),
                              segment_ids=jnp.asarray(SEG), impl="pallas", tuning=tuning)
        assert rel_err(o, ref_o) < 2e-6 and rel_err(S, ref_S) < 2e-6, tuning

    def loss(impl, q, k, v, g, beta):
        o, S = chunk_gated_deltanet(q, k, v, g, beta, segment_ids=jnp.asarray(SEG), decay_bound=-5.0, impl=impl)
        return jnp.sum(o * o) + jnp.sum(S)

    # the per-head dg sums K channels of cancelling terms: measured 3.0e-5 (kernels) and 1.6e-5
    # (XLA form) against float64 autodiff
    grad = jax.jit(jax.grad(loss, argnums=4), static_argnums=0)  # one compile each, not op by op
    dg = grad("pallas", *args)
    with jax.enable_x64(True):
        dg64 = grad("xla", *map(jnp.asarray, (q, k, v, g, beta)))
    assert dg.shape == (B, T, H) and rel_err(dg, dg64) < 1e-4, rel_err(dg, dg64)


def test_path_selection_and_errors():
    x = jnp.zeros((1, 8, 2, 32))
    pick = functools.partial(select_impl, decay="channel", delta=True, chunk_size=64)
    assert pick("auto", x, x, decay_bound=-5.0) == "xla"  # CPU: the kernels would only be interpreted
    assert pick("pallas", x, x, decay_bound=-5.0) == "pallas"
    assert pick("xla", x, x, decay_bound=-5.0) == "xla"
    with pytest.raises(ValueError, match="no static lower bound"):
        pick("pallas", x, x, decay_bound=None)  # the softplus gate
    with pytest.raises(ValueError, match="decay spans"):
        pick("pallas", x, x, decay_bound=-8.0)  # 15 x 8 > 80: a diagonal block could overflow
    with pytest.raises(ValueError, match="K=48 is not a power of two"):
        pick("pallas", jnp.zeros((1, 8, 2, 48)), x, decay_bound=-5.0)
    with pytest.raises(ValueError, match="chunk_size=128"):
        select_impl("pallas", x, x, decay="channel", delta=True, chunk_size=128, decay_bound=-5.0)
    with pytest.raises(ValueError, match="impl must be one of"):
        pick("triton", x, x, decay_bound=-5.0)
    with pytest.raises(ValueError, match="impl='pallas' cannot run"):
        chunk_kda(x, x, x, x, x[..., 0], impl="pallas")  # no decay_bound given


def test_model_reports_its_path_and_refuses_impossible_pallas():
    """The training CLI logs this line at start; an impossible `model.kda.impl=pallas` is a
    config error naming the key, before anything is compiled."""
    tiny = str(ROOT / "configs" / "k3-tiny.yaml")
    assert chunk_path(load_config(tiny, []).model) == "xla (cpu)"
    assert chunk_path(load_config(tiny, ["model.kda.impl=pallas"]).model) == "pallas (fused kernels)"
    assert chunk_path(load_config(tiny, ["model.kda.impl=xla"]).model) == "xla (model.kda.impl=xla)"
    assert chunk_path(load_config(tiny, ["model.layer_pattern=4*mla", "model.kda.impl=pallas"]).model) is None
    with pytest.raises(ConfigError, match=r"model.kda.impl: .*no static lower bound"):
        chunk_path(load_config(tiny, ["model.kda.gate=softplus", "model.kda.impl=pallas"]).model)
    with pytest.raises(ConfigError, match=r"model.kda.impl: .*K=24 is not a power of two"):
        chunk_path(load_config(tiny, ["model.kda.head_dim=24", "model.kda.impl=pallas"]).model)


def test_layer_with_kernels_equals_layer_with_xla():
    """kda.impl reaches the operator from the config; prefill with a cache (initial state) too."""
    cfg = ModelConfig(d_model=32, compute_dtype="float32",
                      kda=KDAConfig(num_heads=2, head_dim=16, chunk_size=16, impl="pallas"))
    m = DeltaMixer(cfg, "kda", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 40, 32))
    seg = jnp.asarray(np.stack([np.repeat([0, 1], [13, 27]), np.zeros(40, int)]))
    run = nnx.jit(lambda m: m(x, segment_ids=seg)[0])  # one compile per path, not op by op
    y_p = run(m)
    m.impl = "xla"
    y_x = run(m)
    assert rel_err(y_p, y_x) < 2e-6


def test_mesh_runs_the_kernels_per_shard():
    """Under a mesh the pallas_call runs inside shard_map (rows over data, heads over tensor),
    never on a gathered copy; the result equals one device's."""
    q, k, v, g, beta, s0 = inputs(40, 16, 16)
    args = list(map(f32, (q, k, v, g, beta, s0))) + [jnp.asarray(SEG)]
    want = kda(*args, impl="pallas")
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, expert=1, tensor=2, num_devices=4))
    with jax.set_mesh(mesh):
        got = kda(*args, impl="pallas")
        jaxpr = str(jax.make_jaxpr(lambda *a: chunk_kda(*a[:5], initial_state=a[5], segment_ids=a[6],
                                                        decay_bound=-5.0, impl="pallas"))(*args))
    assert "shard_map" in jaxpr
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-6)


H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                                    platform="gpu"))


@pytest.mark.parametrize("fuse,gate,keep,split,inverse,isplit,csum",
                         [(1, True, 1, 1, 0, 0, 0), (0, True, 1, 2, 0, 0, 0), (1, False, 1, 2, 0, 1, 0),
                          (1, True, 0, 1, 1, 1, 1), (1, True, 1, 1, 2, 1, 0)])
def test_kernels_lower_to_triton_for_h200(fuse, gate, keep, split, inverse, isplit, csum):
    """Every kernel, forward and backward, at production head dims (bf16, K = V = 128, chunk 64,
    segments, h0) lowers through Pallas's Triton backend for an H200: the lowering enforces
    Triton's rules (power-of-two blocks, 2-D dots of >= 16, no value slicing) that the
    interpreter does not. The GPU compile itself is checked by benchmarks/checks/kda_check.py.

    gate=False: DeltaNet, the kernels' no-gate form. Its program has no gate tensor at all: a
    cumsum of zeros there (the old form) was a constant XLA:GPU folded for 2m22s at the
    ladder's h200 size. keep: the forward keeps its intermediates (the default), so the backward
    runs three kernels; 0: it recomputes kernels 1 and 2 first (five). split: the score gradient's
    channels over two programs per block (a 4-D grid). inverse: kernel 1's UT inverse by 16 x 16
    block substitution (ref slices of its scratch and barriers between row blocks). isplit:
    kernel 1 as two kernels (one more launch per kernel-1 call). csum: the gate's in-chunk cumsum
    and its transpose as kernels (two more launches)."""
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    shapes = [sd((1, 256, 2, 128), bf)] * 2 + [sd((1, 256, 2, 128), bf), sd((1, 256, 2, 128), jnp.float32),
                                               sd((1, 256, 2), bf), sd((1, 2, 128, 128), jnp.float32),
                                               sd((1, 256), jnp.int32)]

    tuning = Tuning(fuse_output=fuse, keep_intermediates=keep, score_split_k=split, intra_inverse=inverse,
                    intra_split=isplit, cumsum_kernel=csum)

    def loss(q, k, v, g, beta, s0, seg):
        if gate:
            o, S = chunk_kda(q, k, v, g, beta, initial_state=s0, segment_ids=seg, decay_bound=-5.0, impl="pallas",
                             tuning=tuning)
        else:
            o, S = chunk_deltanet(q, k, v, beta, initial_state=s0, segment_ids=seg, impl="pallas", tuning=tuning)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(S)

    from k3jax.ops.kda_kernels import op
    orig = op._on_cpu
    op._on_cpu = lambda: False  # lower the compiled kernels, not the interpreter
    try:
        with jax.sharding.use_abstract_mesh(H200):
            step = jax.jit(jax.value_and_grad(loss, argnums=range(6)))
            text = step.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
            jaxpr = str(jax.make_jaxpr(step)(*shapes))
    finally:
        op._on_cpu = orig
    names = [*(["kda_intra_scores", "kda_intra_wy"] if isplit else ["kda_intra_chunk"]), "kda_state_forward",
             "kda_state_backward", "kda_wy_grad", "kda_score_grad"]
    if not fuse:
        names.append("kda_chunk_output")
    if csum and gate:
        names += ["kda_chunk_cumsum", "kda_reverse_cumsum"]
    calls = text.count("__gpu$xla.gpu.triton")
    intra_calls = 1 if keep else 2
    assert calls == (2 if fuse else 3) + (3 if keep else 5) + isplit * intra_calls + 2 * (csum and gate), calls
    for name in names:
        assert name in text, name
    # XLA's float cumsums over [B, NT, C, H, K]: the gate's in-chunk cumsum and its transpose, only
    # where there is a gate and no cumsum kernel (the segment counters' cumsum is int32; a kernel's
    # own scan is over its [C, K] block)
    gate_sums = [line for line in jaxpr.splitlines() if re.search(r"f32\[\d+,\d+,\d+,\d+,\d+\] = cumsum\[", line)]
    assert len(gate_sums) == (2 if gate and not csum else 0), gate_sums
