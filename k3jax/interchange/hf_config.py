"""config.json for an exported checkpoint, in the field names of the K3 release's text config
(hidden_size, linear_attn_config, full_attn_layers, ...), plus a `k3jax` section holding the
exact k3jax model config (added by the exporter) so `k3jax-import` can check it."""

from __future__ import annotations


def _layers(model_cfg, kinds) -> list[int]:
    """1-based indices of the layers whose mixer is in `kinds` (the release counts from 1)."""
    return [i + 1 for i, m in enumerate(model_cfg.mixers) if m in kinds]


def k3_config_json(model_cfg, dtype: str = "bfloat16") -> dict:
    m, k, moe = model_cfg.mla, model_cfg.kda, model_cfg.moe
    has_moe = any(model_cfg.ffn_kind(i) == "moe" for i in range(model_cfg.num_layers))
    kda_layers = _layers(model_cfg, ("kda",))
    return {
        "architectures": ["KimiK3ForCausalLM"],
        "model_type": "kimi_k3",
        "torch_dtype": "float32" if dtype == "float32" else "bfloat16",
        "vocab_size": model_cfg.vocab_size,
        "hidden_size": model_cfg.d_model,
        "num_hidden_layers": model_cfg.num_layers,
        "intermediate_size": model_cfg.ffn_hidden,
        "hidden_act": "situ" if model_cfg.activation == "situ" else "silu",
        "activation_situ_beta": model_cfg.situ_beta,
        "activation_situ_linear_beta": model_cfg.situ_linear_beta,
        "rms_norm_eps": model_cfg.rms_norm_eps,
        "tie_word_embeddings": False,
        "attn_res_block_size": model_cfg.attn_res_block_size or None,
        "linear_attn_config": {
            "kda_layers": kda_layers,
            "full_attn_layers": _layers(model_cfg, ("mla",)),
            "num_heads": k.num_heads,
            "head_dim": model_cfg.head_dim("kda"),
            "short_conv_kernel_size": k.conv_size,
            "gate_lower_bound": k.gate_lower_bound if k.gate == "lower_bound" else None,
            "use_full_rank_gate": k.output_gate == "full",
        } if kda_layers else None,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.q_lora_rank or None,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "mla_use_nope": not m.use_rope,
        "mla_use_output_gate": m.output_gate,
        "rope_theta": m.rope_theta,
        "first_k_dense_replace": model_cfg.first_k_dense,
        "moe_layer_freq": model_cfg.moe_every,
        "num_experts": moe.num_experts if has_moe else None,
        "num_experts_per_token": moe.top_k,
        "num_shared_experts": moe.num_shared_experts,
        "moe_intermediate_size": moe.expert_hidden,
        "routed_expert_hidden_size": moe.latent_dim or None,
        "latent_moe_use_norm": bool(moe.latent_dim and moe.latent_norm),
        "routed_scaling_factor": moe.routed_scaling_factor,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "topk_method": "noaux_tc",
        "num_expert_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 0,
    }
