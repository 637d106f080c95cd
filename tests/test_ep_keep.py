"""moe.ep_keep_results + moe.ep_keep_received under remat: the backward pass's recompute of a MoE
layer issues no collective of the expert exchange, and the layer's loss and gradients do not
change (8 fake CPU devices, see conftest.py).

One StableLatentMoE layer, checkpointed with the model's remat=full policy as `Unit._apply`
does, on meshes with tensor > 1 in one node, with nodes > 1, and with both. Reference values:
the same layer on one device (the dropless path). The collectives are read from XLA's compiled
HLO: the instructions whose op_name lies in the exchange's named stages (ep_dispatch*,
ep_combine*), and of those the recompute's, which JAX names `rematted_computation`. And the
whole model, whose stages scan checkpointed units of checkpointed layers: its gradient's jaxpr."""

import collections
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from k3jax.config import MeshConfig, ModelConfig, MoEConfig, load_config
from k3jax.layers.moe import StableLatentMoE
from k3jax.model import REMAT_POLICIES, create_model
from k3jax.sharding import make_mesh
from reference import rel_err

TINY = Path(__file__).resolve().parents[1] / "configs" / "k3-tiny.yaml"
KEEP = dict(ep_keep_results=True, ep_keep_received=True)
# (mesh, devices per node, dispatch, how a tensor group shares its experts)
CASES = {
    "tensor2-one-node": (dict(expert=4, tensor=2), 8, "capacity", "rows"),  # hop 2 (NVLink) + the tensor group's rows
    "nodes2x2": (dict(data=2, expert=4), 2, "capacity", "auto"),  # hop 1 (network) + hop 2, tensor 1
    "nodes4-tensor2": (dict(expert=4, tensor=2), 2, "ragged", "weights"),  # k3.yaml's form: tensor fills the node
}
_COLLECTIVE = re.compile(r" (all-to-all|ragged-all-to-all|all-gather|all-reduce|reduce-scatter)\(.*"
                         r"op_name=\"([^\"]*(ep_dispatch|ep_combine))")


def _cfg(**moe):
    moe = dict(num_experts=8, top_k=2, expert_hidden=16, latent_dim=16, num_shared_experts=1,
               ep_capacity_factor=8.0, **moe)
    return ModelConfig(d_model=32, compute_dtype="float32", init_std=0.3, moe=MoEConfig(**moe))


def _loss_and_grads(cfg, remat: str | None, mesh=None):
    """(loss, d loss / d (layer state, x)) of one layer, and the compiled HLO's exchange
    collectives {(op, in the recompute?, stage): count} (None without a mesh)."""
    graphdef, state = nnx.split(StableLatentMoE(cfg, rngs=nnx.Rngs(3)))
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model))
    bias = jnp.linspace(-0.2, 0.2, cfg.moe.num_experts)

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x, bias)
        return jnp.sum(y ** 2)

    if remat is not None:
        loss = jax.checkpoint(loss, policy=REMAT_POLICIES[remat], prevent_cse=False)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    if mesh is None:
        return step(state, x), None
    with jax.set_mesh(mesh):
        hlo = step.lower(state, x).compile().as_text()
        out = step(state, x)
    return out, collections.Counter((op, "rematted_computation/" in name, stage)
                                    for op, name, stage in (m.groups() for m in _COLLECTIVE.finditer(hlo)))


@pytest.fixture(scope="module")
def one_device():
    (value, grads), _ = _loss_and_grads(_cfg(), "full")
    return value, grads


@pytest.mark.parametrize("case", list(CASES))
def test_recompute_exchanges_nothing_and_results_do_not_change(one_device, case):
    """remat=full without the keeps: the recompute issues collectives of both the dispatch and
    the combine; with both keeps it issues none, and every other exchange collective (the
    forward's, the backward's) is the same. Loss and gradients (the layer's parameters and its
    input) equal one device's to 1e-5 relative, with and without the keeps."""
    shape, per_node, dispatch, tensor = CASES[case]
    mesh = make_mesh(MeshConfig(**{"data": 1, **shape}))
    ep = dict(ep_dispatch=dispatch, ep_devices_per_node=per_node, ep_tensor=tensor)
    (v_plain, g_plain), plain = _loss_and_grads(_cfg(**ep), "full", mesh)
    (v_keep, g_keep), keep = _loss_and_grads(_cfg(**ep, **KEEP), "full", mesh)

    def recompute(c):
        return collections.Counter({k: n for k, n in c.items() if k[1]})

    assert {stage for _, _, stage in recompute(plain)} == {"ep_dispatch", "ep_combine"}
    assert not recompute(keep), recompute(keep)
    if dispatch == "capacity":  # (XLA:CPU emulates the ragged form by all-gathers, some shared between passes)
        assert keep == plain - recompute(plain)
    value, grads = one_device
    for v, g in ((v_plain, g_plain), (v_keep, g_keep)):
        assert rel_err(v, value) < 1e-5
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(grads)):
            assert rel_err(a, b) < 1e-5


def _exchange_ops(jaxpr) -> int:
    """all_to_all / ragged_all_to_all primitives in a jaxpr and every jaxpr nested in it (scan
    bodies, checkpoints, shard_maps, custom VJPs)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name in ("all_to_all", "ragged_all_to_all")
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    n += _exchange_ops(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    n += _exchange_ops(sub)
    return n


def test_model_remat_with_keeps_sends_what_no_remat_sends():
    """The whole model (scanned stages, a checkpoint per unit and per layer, `k3jax.model`), on
    expert 4 x tensor 2 over 2 nodes: the gradient's program (the jaxpr JAX hands XLA) holds as
    many all-to-alls with remat=full and both keeps as with remat=none, and more without them."""
    counts = {}
    for name, extra in (("none", ["model.remat=none"]), ("full", ["model.remat=full"]),
                        ("keep", ["model.remat=full", "model.moe.ep_keep_results=true",
                                  "model.moe.ep_keep_received=true"])):
        cfg = load_config(TINY, ["model.layer_pattern=kda+mla", "model.attn_res_block_size=2", "model.d_model=64",
                                 "model.moe.latent_dim=32", "data.seq_len=32", "train.batch_size=8", "mesh.data=1",
                                 "mesh.expert=4", "mesh.tensor=2", "model.moe.ep_devices_per_node=4"] + extra)
        graphdef, state = nnx.split(create_model(cfg.model, seed=0))
        tokens = jnp.zeros((cfg.train.batch_size, cfg.data.seq_len), jnp.int32)

        def loss(state):
            return jnp.mean(nnx.merge(graphdef, state)(tokens)[0] ** 2)

        with jax.set_mesh(make_mesh(cfg.mesh)):
            counts[name] = _exchange_ops(jax.make_jaxpr(jax.grad(loss))(state).jaxpr)
    assert counts["keep"] == counts["none"] < counts["full"], counts
