"""What a config's model holds, counted on the abstract model (nothing is allocated):
parameters by component, the routed experts' weight bytes, the decode state per sequence.

Read by k3jax-info (train/info.py), the FLOPs count (k3jax/flops.py), the planner and the
lineage ladder. Active parameters per token exclude the input embedding and all but top_k of
the routed experts (lm_head included).
"""

from __future__ import annotations

from collections import defaultdict

import jax
import numpy as np
from flax import nnx

from k3jax.model import K3Model
from k3jax.ops.mx import BLOCK as MX_BLOCK

COMPONENTS = ("embedding", "lm_head", "kda", "gated_deltanet", "deltanet", "linear", "softmax", "mla",
              "dense_ffn", "routed_experts", "shared_experts", "latent_proj", "router", "attn_res", "norms")


def abstract_model(model_cfg):
    return nnx.eval_shape(lambda: K3Model(model_cfg, rngs=nnx.Rngs(0)))


def param_component(path: tuple, model) -> str:
    """The component (one of COMPONENTS) a parameter at `path` of `model` belongs to."""
    keys = [str(k) for k in path]
    if keys[0] == "embed_tokens":
        return "embedding"
    if keys[0] == "lm_head":
        return "lm_head"
    if keys[0] == "norm" or "layernorm" in " ".join(keys):
        return "norms"
    if any(k.endswith("_res") for k in keys):
        return "attn_res"
    if "block_sparse_moe" in keys:
        i = keys.index("block_sparse_moe")
        part = keys[i + 1]
        return {"experts": "routed_experts", "gate": "router", "shared_experts": "shared_experts"}.get(
            part, "latent_proj")
    if "mlp" in keys:
        return "dense_ffn"
    if "self_attn" in keys:  # ('stages', s, 'units', 'layers', j, 'self_attn', ...)
        stage, j = int(keys[1]), int(keys[keys.index("layers") + 1])
        return model.plan[stage].unit[j][0]
    raise ValueError(f"unclassified parameter {'/'.join(keys)}")


def param_counts(model) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        counts[param_component(path, model)] += int(np.prod(var.get_value().shape))
    return {k: counts[k] for k in COMPONENTS if counts.get(k)}


def routed_expert_bytes(model, qat: str) -> dict[str, int]:
    """Bytes of the routed experts' weights: {"bf16": ...} and, for qat="mxfp4", "mxfp4": 4-bit
    elements plus one E8M0 byte per block of 32 along each matrix's reduction axis (axis -2 of
    w1/w3 [E, l, H] and w2 [E, H, l])."""
    elements = scales = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if param_component(path, model) == "routed_experts":
            shape = var.get_value().shape
            n = int(np.prod(shape))
            elements += n
            scales += n // shape[-2] * -(-shape[-2] // MX_BLOCK)
    out = {"bf16": 2 * elements}
    if qat == "mxfp4":
        out["mxfp4"] = -(-elements // 2) + scales
    return out


def active_params(model_cfg, counts: dict[str, int]) -> int:
    total = sum(counts.values())
    routed = counts.get("routed_experts", 0)
    inactive = routed * (1 - model_cfg.moe.top_k / model_cfg.moe.num_experts) if routed else 0
    return int(round(total - counts.get("embedding", 0) - inactive))


def decode_state_bytes(model, context: int) -> dict[str, int]:
    """Bytes per sequence of the decode cache at `context` tokens, by kind."""
    cache = jax.eval_shape(lambda: model.init_cache(1, context))
    out: dict[str, int] = defaultdict(int)
    for path, leaf in jax.tree_util.tree_flatten_with_path(cache["layers"])[0]:
        name = str(path[-1].key)
        kind = {"state": "kda_state", "latent": "mla_latent", "k_rope": "mla_latent",
                "k": "softmax_kv", "v": "softmax_kv"}.get(name, "kda_conv" if name.startswith("conv") else name)
        out[kind] += leaf.size * leaf.dtype.itemsize
    out["positions"] = cache["segment_ids"].size * cache["segment_ids"].dtype.itemsize
    return dict(out)


def full_attention_bytes(model_cfg, context: int, dtype_bytes: int = 2) -> dict[str, int]:
    """What the same depth would cache with full attention in every layer."""
    L, m = model_cfg.num_layers, model_cfg.mla
    expanded = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    return {"all_layers_mla_latent": L * (m.kv_lora_rank + m.qk_rope_head_dim) * dtype_bytes * context,
            "all_layers_expanded_kv": L * expanded * dtype_bytes * context}
