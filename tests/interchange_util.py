"""Shared pieces of the interchange tests: a micro K3 config and random weights for it."""

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config.schema import Config, KDAConfig, MLAConfig, ModelConfig, MoEConfig
from k3jax.interchange.names import abstract_state

BF16 = np.dtype(jnp.bfloat16)  # ml_dtypes' bfloat16, which safetensors' NumPy API reads and writes


def micro_config(**model) -> Config:
    """6 layers, KDA/MLA alternating, a dense first layer then LatentMoE, AttnRes blocks of 2:
    stages [kda+dense, mla+moe] x1 and [kda+moe, mla+moe] x2 when scanned."""
    base = {"vocab_size": 64, "d_model": 64, "layer_pattern": "3*(kda,mla)", "ffn_hidden": 64,
            "attn_res_block_size": 2, "kda": KDAConfig(num_heads=2, head_dim=32, chunk_size=16),
            "mla": MLAConfig(num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, v_head_dim=16),
            "moe": MoEConfig(num_experts=4, top_k=2, expert_hidden=32, latent_dim=32)}
    base.update(model)
    return Config(model=ModelConfig(**base))


def random_weights(model_cfg, seed=0):
    """(params, rest) as nested dicts of NumPy arrays, every leaf random in its own dtype
    (norm weights and gate vectors too, so any mix-up between tensors shows)."""
    rng = np.random.default_rng(seed)
    params, rest = abstract_state(model_cfg)

    def fill(x):
        dt = BF16 if x.dtype == jax.numpy.bfloat16 else np.dtype(x.dtype)
        return rng.standard_normal(x.shape).astype(np.float32).astype(dt)

    return jax.tree.map(fill, params), jax.tree.map(fill, rest)


def flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
