"""remat=save_dots keeps the outputs of the kernels and custom VJPs it cannot see into
(k3jax.ops.remat_names), so the backward pass does not run their forward again."""

import contextlib
import io
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from k3jax.config import load_config
from k3jax.model import REMAT_POLICIES, create_model
from k3jax.ops.remat_names import ATTENTION_OUT, ATTNRES_OUT, EXPERT_HIDDEN, EXPERT_OUT, KDA_OUT, MATMUL_F32_OUT

TINY = Path(__file__).resolve().parents[1] / "configs" / "k3-tiny.yaml"


def _saved(policy, layer, bias):
    """What a checkpoint with `policy` around one decoder layer keeps for its backward pass."""
    graphdef, state = nnx.split(layer)
    B, T, d = 1, 32, 32
    x = jnp.ones((B, T, d), jnp.bfloat16) * jnp.linspace(-1, 1, d, dtype=jnp.bfloat16)
    carry = {"prefix": x, "blocks": jnp.zeros((2, B, T, d), jnp.bfloat16), "num_blocks": jnp.ones((), jnp.int32)}
    seg, pos = jnp.ones((B, T), jnp.int32), jnp.broadcast_to(jnp.arange(T), (B, T))

    def f(state):
        out, _, _ = nnx.merge(graphdef, state)(carry, push=False, bias=bias, segment_ids=seg, positions=pos)
        return jnp.sum(out["prefix"].astype(jnp.float32))

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(jax.checkpoint(f, policy=policy), state)
    return buf.getvalue()


def test_save_dots_keeps_kernel_outputs():
    """A KDA and an MLA decoder layer with MoE, bf16: under the save_dots policy each named
    output is kept (KDA's, attention's, the experts' gate and up products and their fp32 output
    per pair and per token, the fp32-output gate matmuls, both AttnRes sites' outputs); under remat=full's (save nothing) none of them."""
    cfg = load_config(TINY, ["model.layer_pattern=1*(kda,mla)", "model.first_k_dense=0",
                             "model.attn_res_block_size=2", "model.compute_dtype=bfloat16", "model.d_model=32",
                             "model.kda.num_heads=2", "model.kda.head_dim=16", "model.moe.num_experts=4",
                             "model.moe.top_k=2", "model.moe.latent_dim=16", "model.moe.expert_hidden=16"]).model
    model = create_model(cfg, seed=0)
    units = model.stages[0].units
    layers = nnx.state(units)["layers"]
    bias = jnp.zeros((cfg.moe.num_experts,), jnp.float32)
    for j, mixer_out in ((0, KDA_OUT), (1, ATTENTION_OUT)):
        names = (mixer_out, EXPERT_HIDDEN, EXPERT_OUT, MATMUL_F32_OUT, ATTNRES_OUT)
        layer = nnx.merge(nnx.graphdef(units.layers[j]), jax.tree.map(lambda a: a[0], layers[j]))
        dots, full = _saved(REMAT_POLICIES["save_dots"], layer, bias), _saved(None, layer, bias)
        for name in names:
            assert f"named '{name}'" in dots, (j, name)
            assert f"named '{name}'" not in full, (j, name)
        assert dots.count(f"named '{EXPERT_HIDDEN}'") == 2  # the gate and the up product
        assert dots.count(f"named '{EXPERT_OUT}'") == 2  # the experts' output per pair, and its weighted sum
        assert dots.count(f"named '{ATTNRES_OUT}'") == 2  # the attention and the MLP site
