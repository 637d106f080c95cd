"""QAT (model.qat=mxfp4) in every routed-expert path: dropless (both grouped-matmul forms), the
dense reference, expert parallelism (capacity and ragged, on the fake 8-device mesh) and the
Stable LatentMoE layer, against float64 NumPy that quantizes the weights (MXFP4, blocks along
each GEMM's reduction axis) and the GEMM inputs (MXFP8 rows) itself (tests/reference.py)."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import ConfigError, MeshConfig, ModelConfig, MoEConfig, load_config
from train.info import main as info_main
from train.info import report
from k3jax.layers.moe import StableLatentMoE, routed_experts_dense_reference, routed_experts_dropless
from k3jax.ops.grouped_matmul import grouped_glu_mlp
from k3jax.ops.mx import ExpertQuant
from k3jax.sharding import make_mesh
from k3jax.layers.expert_parallel import routed_experts_sharded
from reference import np_mx, rel_err

ROOT = Path(__file__).resolve().parents[1]
GLU = ("situ", 4.0, 25.0)
N, E, K, L, H = 64, 8, 2, 32, 64  # tokens, experts, top-k, routed width, expert hidden


def np_sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def np_situ(a, b, beta=4.0, linear_beta=25.0):
    return beta * np.tanh(a / beta) * np_sigmoid(a) * linear_beta * np.tanh(b / linear_beta)


def np_experts_qat(z, idx, wts, w1, w3, w2, rule, quantize_inputs=True):
    """u[t] = sum_j p_tj Q8(situ(Q8(z_t) Q4(W1_e), Q8(z_t) Q4(W3_e))) Q4(W2_e) in float64, Q4 the
    MXFP4 weight quantizer (blocks along l for W1/W3 [E,l,H], along H for W2 [E,H,l]), Q8 the
    MXFP8 row quantizer; quantize_inputs=False leaves the Q8s out."""
    q8 = (lambda v: np_mx(v, "e4m3", rule)[0]) if quantize_inputs else (lambda v: np.asarray(v, np.float64))
    W1, W3, W2 = (np_mx(w, "e2m1", rule, axis=1)[0] for w in (w1, w3, w2))
    zq = q8(z)
    out = np.zeros((z.shape[0], W2.shape[-1]))
    for t in range(z.shape[0]):
        for j, e in enumerate(np.asarray(idx[t])):
            h = q8(np_situ(zq[t] @ W1[e], zq[t] @ W3[e])[None])[0]
            out[t] += float(wts[t, j]) * (h @ W2[e])
    return out


def moe_inputs(seed=0, n=N):
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.standard_normal((n, L)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(E - 1, K, replace=False) for _ in range(n)]), jnp.int32)  # expert 7 idle
    w = jnp.asarray(rng.uniform(0.1, 1.0, (n, K)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.3 * 2.0 ** rng.integers(-2, 3, (E, 1, 1)), jnp.float32)
          for s in ((E, L, H), (E, L, H), (E, H, L))]
    return z, idx, w, ws


@pytest.mark.parametrize("gmm,rule", [("blocked", "ocp"), ("ragged", "ceil"), ("blocked", "ceil")])
def test_dropless_applies_mxfp4_weights_and_mxfp8_inputs(gmm, rule):
    """Dropless with qat equals the float64 MoE of pre-quantized weights and inputs (1e-5
    relative: fp32 sums), and so does the dense reference; the unquantized MoE, or one that
    quantizes only the weights, is at least 100x further off."""
    z, idx, w, (w1, w3, w2) = moe_inputs()
    qat = ExpertQuant(rule=rule)
    fn = jax.jit(functools.partial(routed_experts_dropless, glu=GLU, gmm=gmm, gmm_block=8, qat=qat))
    got = fn(z, idx, w, w1, w3, w2)
    want = np_experts_qat(z, idx, w, w1, w3, w2, rule)
    assert rel_err(got, want) < 1e-5
    # the dense reference and the unquantized MoE jitted too: run op by op they compiled some
    # 300 single-op programs, 3x the cost of this test's compiles (the same computations)
    dense = jax.jit(functools.partial(routed_experts_dense_reference, glu=GLU, qat=qat))
    assert rel_err(dense(z, idx, w, w1, w3, w2), want) < 1e-5
    plain = jax.jit(functools.partial(routed_experts_dropless, glu=GLU, gmm=gmm))
    assert rel_err(plain(z, idx, w, w1, w3, w2), want) > 1e-3
    assert rel_err(np_experts_qat(z, idx, w, w1, w3, w2, rule, quantize_inputs=False), want) > 1e-3
    # a non-finite master weight is not quantized away: its expert's tokens become NaN (with
    # XLA:CPU's ragged_dot, a dense dot over all experts, every token does)
    bad = np.asarray(fn(z, idx, w, w1.at[3, 5, 7].set(jnp.nan), w3, w2))
    hit = (np.asarray(idx) == 3).any(-1)
    assert hit.any() and np.isnan(bad[hit]).all()
    assert gmm == "ragged" or np.array_equal(bad[~hit], np.asarray(got)[~hit])


def test_dropless_qat_gradients_equal_dense_reference():
    """Gradients through the quantizers (straight-through) of the dropless and dense forms agree,
    and differ from the unquantized gradients."""
    z, idx, w, (w1, w3, w2) = moe_inputs(1)
    qat = ExpertQuant()
    cot = jax.random.normal(jax.random.key(0), (N, L))

    def grads(fn, **kw):
        loss = lambda z, w, w1, w3, w2: jnp.sum(fn(z, idx, w, w1, w3, w2, GLU, **kw) * cot)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=range(5)))(z, w, w1, w3, w2)

    got = grads(routed_experts_dropless, qat=qat, gmm_block=8)
    want = grads(routed_experts_dense_reference, qat=qat)
    plain = grads(routed_experts_dropless, gmm_block=8)
    for name, g, r, p in zip(("z", "weights", "w1", "w3", "w2"), got, want, plain):
        assert rel_err(g, r) < 1e-5, name
        assert rel_err(p, r) > 1e-3, name


@pytest.mark.parametrize("impl", ["blocked", "ragged"])
def test_weights_are_quantized_once_before_any_gather(impl):
    """The traced grouped GLU MLP applies the quantizer five times: to w1, w3 and w2 at their
    stored [E, ., .] shapes (never to per-block or per-row weight copies), to the token rows and to
    the GLU output."""
    z, _, _, (w1, w3, w2) = moe_inputs(n=40)
    sizes = jnp.array([10, 0, 12, 8, 10, 0, 0, 0], jnp.int32)
    jaxpr = jax.make_jaxpr(lambda x, w1, w3, w2: grouped_glu_mlp(
        x, w1, w3, w2, sizes, lambda a, b: a * b, compute_dtype=jnp.float32, impl=impl, block=8,
        qat=ExpertQuant()))(z, w1, w3, w2)
    shapes = [v.aval.shape for e in jaxpr.jaxpr.eqns if e.primitive.name == "custom_vjp_call" for v in e.invars]
    assert shapes[:4] == [(E, L, H), (E, L, H), (E, H, L), (40, L)] and len(shapes) == 5
    assert shapes[4][-1] == H  # the GLU output, rows of H


MESHES = [("capacity", dict(data=2, fsdp=1, expert=4, tensor=1)), ("ragged", dict(data=1, fsdp=2, expert=2, tensor=2))]


@pytest.mark.parametrize("dispatch,shape", MESHES, ids=[m[0] for m in MESHES])
def test_expert_parallel_applies_qat(dispatch, shape):
    """The shard_map MoE with qat (weights quantized per device after the FSDP all-gather, w2's
    blocks inside one tensor shard) equals the float64 pre-quantized MoE, and its gradients
    equal dropless QAT's (1e-5 relative)."""
    z, idx, w, (w1, w3, w2) = moe_inputs(2)
    qat = ExpertQuant(rule="ocp")
    mesh = make_mesh(MeshConfig(**shape))

    def ep(z, w1, w2):
        return routed_experts_sharded(z, idx, w, w1, w3, w2, GLU, jnp.float32, mesh=mesh, capacity_factor=8.0,
                                      dispatch=dispatch, gmm_block=8, qat=qat)

    def loss(z, w1, w2):
        u, drop = ep(z, w1, w2)
        return jnp.sum(u ** 2), (u, drop)

    # output and gradients from one program: a forward of its own compiled the forward again
    with jax.set_mesh(mesh):
        (_, (u, drop)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(z, w1, w2)
    assert float(drop) == 0.0
    assert rel_err(u, np_experts_qat(z, idx, w, w1, w3, w2, "ocp")) < 1e-5
    gr = jax.jit(jax.grad(lambda z, w1, w2: jnp.sum(routed_experts_dropless(z, idx, w, w1, w3, w2, GLU, qat=qat) ** 2),
                          argnums=(0, 1, 2)))(z, w1, w2)  # jitted: op by op it compiled ~150 single-op programs
    for a, b in zip(g, gr):
        assert rel_err(a, b) < 1e-5


def test_expert_parallel_refuses_blocks_across_tensor_shards():
    """With the hidden width split over tensor (ep_tensor=rows) w2's blocks must lie in a shard."""
    z, idx, w, (w1, w3, w2) = moe_inputs(3)
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, expert=2, tensor=4))  # H / tensor = 16
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="expert_hidden / mesh.tensor"):
        routed_experts_sharded(z, idx, w, w1, w3, w2, GLU, jnp.float32, mesh=mesh, qat=ExpertQuant(), tensor="rows")


def test_mxfp8_wire_is_bit_exact():
    """The token rows sent as MXFP8 bytes (moe.ep_wire=auto under qat) give the experts the very
    values the compute-dtype wire gives them after quantizing (wire=compute, the GEMM's own
    qat.input): output and gradients bit for bit equal, on 2 nodes x 2 shards x tensor 2 (both
    hops, and the bytes go on to the other tensor rank). bf16 compute. So do they when remat
    keeps the MXFP8 bytes received (moe.ep_keep_received, the model's remat=full policy)."""
    from k3jax.model import REMAT_POLICIES

    z, idx, w, (w1, w3, w2) = moe_inputs(4)
    z = z.astype(jnp.bfloat16)
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, expert=4, tensor=2))

    def run(wire, keep=False):
        def f(z, w, w1, w2):
            u, _ = routed_experts_sharded(z, idx, w, w1, w3, w2, GLU, jnp.bfloat16, mesh=mesh, capacity_factor=8.0,
                                          gmm_block=8, qat=ExpertQuant(rule="ceil"), wire=wire, devices_per_node=4,
                                          dispatch="ragged", tensor="rows", keep_received=keep)
            return jnp.sum(u ** 2), u
        if keep:
            f = jax.checkpoint(f, policy=REMAT_POLICIES["full"], prevent_cse=False)
        return jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(z, w, w1, w2)

    with jax.set_mesh(mesh):
        ((_, u8), g8), ((_, uc), gc), ((_, uk), gk) = jax.jit(
            lambda: (run("auto"), run("compute"), run("auto", keep=True)))()
    for u, g in ((uc, gc), (uk, gk)):
        np.testing.assert_array_equal(np.asarray(u8), np.asarray(u))
        for a, b in zip(g8, g):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert rel_err(u8, np_experts_qat(np.asarray(z, np.float32), idx, w, w1, w3, w2, "ceil")) < 2e-2  # bf16 rows


def layer_cfg(qat="mxfp4", rule="ceil"):
    moe = MoEConfig(num_experts=E, top_k=K, expert_hidden=H, latent_dim=0, num_shared_experts=1,
                    ep_capacity_factor=8.0)  # nothing dropped on the mesh
    return ModelConfig(d_model=L, compute_dtype="float32", init_std=0.3, moe=moe, qat=qat, qat_scale_rule=rule)


def test_layer_uses_the_configured_quantization():
    """StableLatentMoE with model.qat=mxfp4 (no latent projection: z = x) equals the float64
    layer built from the pre-quantized MoE plus the unquantized shared experts and routing; the
    same layer runs the expert-parallel path under a mesh to the same output."""
    cfg = layer_cfg()
    m = StableLatentMoE(cfg, rngs=nnx.Rngs(1))
    assert m.qat == ExpertQuant(rule="ceil") and StableLatentMoE(layer_cfg("none"), rngs=nnx.Rngs(1)).qat is None
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 16, L)).astype(np.float32)
    bias = np.zeros(E, np.float32)
    fwd = nnx.jit(lambda m, x, b: m(x, b)[0])
    y = fwd(m, jnp.asarray(x), jnp.asarray(bias))
    xf = x.reshape(-1, L).astype(np.float64)
    s = np_sigmoid(xf @ np.asarray(m.gate.weight[...], np.float64))
    idx = np.argsort(-s, axis=-1, kind="stable")[:, :K]
    p = np.take_along_axis(s, idx, -1)
    p = p / p.sum(-1, keepdims=True)
    sh = m.shared_experts
    f = lambda v: np.asarray(v[...], np.float64)  # noqa: E731
    shared = np_situ(xf @ f(sh.gate_proj.kernel), xf @ f(sh.up_proj.kernel)) @ f(sh.down_proj.kernel)
    want = np_experts_qat(xf, idx, p, f(m.experts.w1), f(m.experts.w3), f(m.experts.w2), "ceil") + shared
    assert rel_err(y, want.reshape(x.shape)) < 1e-5
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, expert=4, tensor=1))
    with jax.set_mesh(mesh):
        y_ep = fwd(m, jnp.asarray(x), jnp.asarray(bias))
    assert rel_err(y_ep, y) < 1e-5


def test_qat_config_rules():
    load_config(None, ["model.qat=mxfp4", "model.moe.latent_dim=64", "model.moe.expert_hidden=32"])
    with pytest.raises(ConfigError, match=r"model\.moe\.expert_hidden: qat=mxfp4 .* 48 is not a multiple of 32"):
        load_config(None, ["model.qat=mxfp4", "model.moe.latent_dim=64", "model.moe.expert_hidden=48"])
    with pytest.raises(ConfigError, match=r"model\.d_model: qat=mxfp4 .* 80 is not a multiple of 32"):
        load_config(None, ["model.qat=mxfp4", "model.d_model=80", "model.moe.latent_dim=0",
                           "model.kda.num_heads=5", "model.kda.head_dim=16"])
    with pytest.raises(ConfigError, match=r"model\.qat: mxfp4 quantizes the routed experts.*no MoE layer"):
        load_config(None, ["model.qat=mxfp4", "model.moe_every=0"])
    with pytest.raises(ConfigError, match=r"model\.qat_scale_rule: must be one of"):
        load_config(None, ["model.qat_scale_rule=floor"])
    with pytest.raises(ConfigError, match=r"model\.qat: must be one of"):
        load_config(None, ["model.qat=mxfp8"])


def test_info_reports_mxfp4_expert_bytes(capsys):
    """k3-tiny: 7 MoE layers x 16 experts x (w1, w3, w2) of 64 x 64 = 1,376,256 weights: 2,752,512
    bytes in bf16; in MXFP4 688,128 bytes of 4-bit elements + 43,008 one-byte scales (one per 32)."""
    cfg_path = str(ROOT / "configs" / "k3-tiny.yaml")
    n = 7 * 16 * 3 * 64 * 64
    assert n == 1_376_256
    r = report(load_config(cfg_path, ["model.qat=mxfp4"]).model, 128)
    assert r["routed_experts_bytes"] == {"bf16": 2_752_512, "mxfp4": 688_128 + 43_008}
    assert (688_128 + 43_008) * 8 / n == 4.25
    assert report(load_config(cfg_path).model, 128)["routed_experts_bytes"] == {"bf16": 2_752_512}
    assert info_main(["--config", cfg_path, "model.qat=mxfp4"]) == 0
    assert "routed experts' weights: 2.753 MB in bf16, 731.1 KB in MXFP4 (4.25 bits per weight)" in capsys.readouterr().out
