"""Shrink a model config to smoke-test size while keeping its structure.

Every mixer kind, the dense/MoE placement, the activation, AttnRes on/off, the gate
forms and the latent/shared-expert choices survive; widths, vocabulary and repeat counts
shrink. Useful for a CPU check of any config before renting hardware:

    tiny = shrink_model(load_config("configs/k3.yaml").model)
"""

from __future__ import annotations

import dataclasses
import re

from k3jax.config.schema import ModelConfig


def _cap_repeats(pattern: str, cap: int) -> str:
    terms = []
    for raw in pattern.split("+"):
        term = raw.strip()
        m = re.match(r"^(\d+)\s*\*\s*(.*)$", term)
        terms.append(f"{min(int(m.group(1)), cap)}*{m.group(2)}" if m else term)
    return " + ".join(terms)


def shrink_model(cfg: ModelConfig, *, d_model: int = 32, max_repeat: int = 1) -> ModelConfig:
    rep = dataclasses.replace
    moe = cfg.moe
    experts = min(moe.num_experts, 8)
    width = 32 if cfg.qat == "mxfp4" else 16  # MXFP4 quantizes the experts' reductions in blocks of 32
    moe = rep(moe, num_experts=experts, top_k=max(1, min(moe.top_k, experts // 4)), expert_hidden=width,
              latent_dim=width if moe.latent_dim else 0, shared_hidden=0, qb_bins=min(moe.qb_bins, 64))
    kda = rep(cfg.kda, num_heads=2, head_dim=8, gate_rank=0, output_gate_rank=0, chunk_size=16)
    mla = cfg.mla
    mla = rep(mla, num_heads=2, q_lora_rank=16 if mla.q_lora_rank else 0, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=4 if mla.qk_rope_head_dim else 0, v_head_dim=8)
    attention = rep(cfg.attention, num_heads=2, num_kv_heads=1 if cfg.attention.num_kv_heads else 0, head_dim=8)
    pattern = _cap_repeats(cfg.layer_pattern, max_repeat)
    layers = len(ModelConfig(layer_pattern=pattern).mixers)
    block = min(cfg.attn_res_block_size, 4, layers) if cfg.attn_res_block_size else 0
    return rep(cfg, vocab_size=64, d_model=d_model, ffn_hidden=2 * d_model, layer_pattern=pattern,
               first_k_dense=min(cfg.first_k_dense, layers), attn_res_block_size=block,
               compute_dtype="float32", kda=kda, mla=mla, attention=attention, moe=moe)
