"""The public relatives of K3 that `k3jax-import` also reads: Kimi Linear and fla's
`KDAForCausalLM`. Each maps its config.json onto k3jax model settings and renames the K3
release's tensor names to its own.

Kimi Linear (model_type "kimi_linear"): K3's tensor names, with
- KDA: softplus decay gate (no lower bound), low-rank output gate g_a_proj [r, d] /
  g_b_proj [P, r] without bias, A_log stored [1, 1, H, 1];
- MLA: a direct q_proj (q_lora_rank null), no output gate, NoPE; its kv_a_layernorm is built
  with eps 1e-6 whatever rms_norm_eps says (-> mla.kv_norm_eps);
- MoE: DeepSeek-style, no latent projections or latent norm, SiLU experts, sigmoid router
  with e_score_correction_bias and renormalised top-k weights times routed_scaling_factor;
  layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0;
- kda_layers / full_attn_layers count layers from 1.

fla KDAForCausalLM (model_type "kda"): every layer KDA + a SwiGLU MLP, names
model.embeddings, layers.N.attn_norm / attn.* / mlp_norm / mlp.*; the decay gate is
f_proj.0 [K, d] / f_proj.1 [H*K, K], softplus (or the lower-bound form when `lower_bound`
is set); the output gate g_proj.0 [K, d] / g_proj.1 [H*K, K] *with* a bias (->
kda.output_gate_bias); A_log [H]; one norm_eps for every norm.
"""

from __future__ import annotations

import dataclasses

from k3jax.config.schema import replace
from k3jax.interchange.names import Entry
from k3jax.interchange.errors import InterchangeError

LAYOUTS = ("k3", "kimi_linear", "fla_kda")


def detect_layout(cj: dict, where: str) -> str:
    t = cj.get("model_type")
    if t == "kda":
        return "fla_kda"
    if t == "kimi_linear":
        return "kimi_linear"
    if t == "kimi_k3" or "k3jax" in cj:
        return "k3"
    raise InterchangeError(f"{where}: model_type {t!r} is not one k3jax reads "
                           f"(kimi_k3 from k3jax-export, kimi_linear, or fla's kda)")


def _need(cj: dict, key: str, where: str):
    if cj.get(key) is None:
        raise InterchangeError(f"{where}: needs `{key}`")
    return cj[key]


def _refuse(where: str, key: str, value, why: str):
    raise InterchangeError(f"{where}: {key}={value!r} is not supported: {why}")


def fla_model_changes(cj: dict, where: str) -> dict:
    """Dotted ModelConfig changes (relative to `model.`) for an fla KDAForCausalLM config."""
    h = _need(cj, "hidden_size", where)
    L = _need(cj, "num_hidden_layers", where)
    if cj.get("attn") is not None:
        _refuse(where, "attn", cj["attn"], "hybrid softmax-attention layers are not mapped")
    if cj.get("attnres_block_size") is not None:
        _refuse(where, "attnres_block_size", cj["attnres_block_size"],
                "fla's AttnRes closes blocks per sub-layer, k3jax's per layer")
    if cj.get("num_v_heads") not in (None, cj.get("num_heads")):
        _refuse(where, "num_v_heads", cj["num_v_heads"], "k3jax has no GVA")
    if cj.get("expand_v", 1.0) != 1.0:
        _refuse(where, "expand_v", cj["expand_v"], "k3jax needs head_v_dim == head_dim")
    if cj.get("allow_neg_eigval", False):
        _refuse(where, "allow_neg_eigval", True, "k3jax's beta is sigmoid in (0, 1)")
    if not cj.get("use_short_conv", True):
        _refuse(where, "use_short_conv", False, "k3jax's conv_size=0 leaves q/k/v without fla's SiLU")
    if cj.get("hidden_act", "swish") not in ("swish", "silu"):
        _refuse(where, "hidden_act", cj["hidden_act"], "only SwiGLU MLPs map onto k3jax")
    if cj.get("tie_word_embeddings"):
        pass  # lm_head reads model.embeddings.weight (foreign_plan)
    ffn = cj.get("intermediate_size")
    if ffn is None:  # fla's rule: 2/3 * hidden_ratio * hidden, rounded up to a multiple of 256
        ffn = int(h * (cj.get("hidden_ratio") or 4) * 2 / 3)
        ffn = 256 * ((ffn + 255) // 256)
    K = cj.get("head_dim", 128)
    lb = cj.get("lower_bound")
    return {
        "vocab_size": _need(cj, "vocab_size", where), "d_model": h,
        "layer_pattern": f"{L}*(kda)", "ffn_hidden": ffn, "first_k_dense": L, "moe_every": 0,
        "activation": "swiglu", "attn_res_block_size": 0, "rms_norm_eps": cj.get("norm_eps", 1e-6),
        "kda.num_heads": _need(cj, "num_heads", where), "kda.head_dim": K, "kda.conv_size": cj.get("conv_size", 4),
        "kda.gate": "softplus" if lb is None else "lower_bound",
        **({} if lb is None else {"kda.gate_lower_bound": float(lb)}),
        "kda.gate_rank": K, "kda.output_gate": "low_rank", "kda.output_gate_rank": K,
        "kda.output_gate_bias": True,
    }


def kimi_model_changes(cj: dict, where: str) -> dict:
    """Dotted ModelConfig changes for a Kimi Linear config."""
    L = _need(cj, "num_hidden_layers", where)
    la = cj.get("linear_attn_config") or {}
    kda_layers = set(la.get("kda_layers") or [])
    mixers = ["kda" if i + 1 in kda_layers else "mla" for i in range(L)]
    if cj.get("q_lora_rank") is not None:
        _refuse(where, "q_lora_rank", cj["q_lora_rank"], "Kimi Linear's MLA projects q directly")
    if not cj.get("mla_use_nope", False) and "mla" in mixers:
        _refuse(where, "mla_use_nope", cj.get("mla_use_nope"), "Kimi Linear's MLA is NoPE")
    if cj.get("num_key_value_heads", cj.get("num_attention_heads")) != cj.get("num_attention_heads"):
        _refuse(where, "num_key_value_heads", cj["num_key_value_heads"], "MLA has as many kv heads as q heads")
    if cj.get("hidden_act", "silu") not in ("silu", "swish"):
        _refuse(where, "hidden_act", cj["hidden_act"], "only SwiGLU MLPs map onto k3jax")
    if cj.get("tie_word_embeddings"):
        _refuse(where, "tie_word_embeddings", True, "Kimi Linear's lm_head is untied")
    changes = {
        "vocab_size": _need(cj, "vocab_size", where), "d_model": _need(cj, "hidden_size", where),
        "layer_pattern": "+".join(mixers), "ffn_hidden": _need(cj, "intermediate_size", where),
        "activation": "swiglu", "attn_res_block_size": 0, "rms_norm_eps": cj.get("rms_norm_eps", 1e-6),
    }
    if kda_layers:
        K = la.get("head_dim", 128)
        changes.update({"kda.num_heads": la["num_heads"], "kda.head_dim": K,
                        "kda.conv_size": la.get("short_conv_kernel_size", 4), "kda.gate": "softplus",
                        "kda.gate_rank": K, "kda.output_gate": "low_rank", "kda.output_gate_rank": K,
                        "kda.output_gate_bias": False})
    if "mla" in mixers:
        changes.update({"mla.num_heads": cj["num_attention_heads"], "mla.q_lora_rank": 0,
                        "mla.kv_lora_rank": cj["kv_lora_rank"], "mla.qk_nope_head_dim": cj["qk_nope_head_dim"],
                        "mla.qk_rope_head_dim": cj["qk_rope_head_dim"], "mla.v_head_dim": cj["v_head_dim"],
                        "mla.use_rope": False, "mla.output_gate": False,
                        "mla.kv_norm_eps": 1e-6})  # Kimi's kv_a_layernorm keeps its class default
    E = cj.get("num_experts")
    k = cj.get("first_k_dense_replace", 0)
    if E is None:
        changes.update({"moe_every": 0, "first_k_dense": L})
        return changes
    freq = cj.get("moe_layer_freq", 1)
    theirs = [i >= k and i % freq == 0 for i in range(L)]
    ours = [i >= k and (i - k) % freq == 0 for i in range(L)]
    if theirs != ours:
        _refuse(where, "moe_layer_freq", freq, f"its MoE layers (i % {freq} == 0 from layer {k}) are not "
                f"k3jax's ((i - first_k_dense) % moe_every == 0)")
    if cj.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        _refuse(where, "moe_router_activation_func", cj["moe_router_activation_func"], "k3jax routes by sigmoid")
    top_k = cj["num_experts_per_token"]
    if not cj.get("moe_renormalize", True) or top_k == 1:
        _refuse(where, "moe_renormalize", cj.get("moe_renormalize"), "k3jax always renormalises top-k weights")
    if cj.get("num_expert_group", 1) != cj.get("topk_group", 1):
        _refuse(where, "num_expert_group", cj.get("num_expert_group"), "group-limited routing is not in k3jax")
    changes.update({"first_k_dense": k, "moe_every": freq, "moe.num_experts": E, "moe.top_k": top_k,
                    "moe.expert_hidden": cj["moe_intermediate_size"],
                    "moe.num_shared_experts": cj.get("num_shared_experts") or 0, "moe.shared_hidden": 0,
                    "moe.latent_dim": 0, "moe.latent_norm": False,
                    "moe.routed_scaling_factor": float(cj.get("routed_scaling_factor", 1.0))})
    return changes


def apply_changes(model_cfg, changes: dict, where: str):
    """model_cfg with `changes` (dotted keys) applied and checked."""
    try:
        out = replace(model_cfg, **changes)
    except (TypeError, ValueError) as e:
        raise InterchangeError(f"{where}: {e}") from None
    problems = out.check()
    if problems:
        key, msg = problems[0]
        raise InterchangeError(f"{where}: maps to model.{key}, which {msg}")
    return out


_FLA_RENAMES = (("self_attn.", "attn."), ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm"),
                ("f_a_proj", "f_proj.0"), ("f_b_proj", "f_proj.1"), ("g_a_proj", "g_proj.0"),
                ("g_b_proj", "g_proj.1"))


def foreign_plan(layout: str, plan: list[Entry], cj: dict) -> list[Entry]:
    """The K3-named plan renamed (and re-shaped where the layout stores a tensor differently)."""
    if layout == "k3":
        return plan
    out = []
    for e in plan:
        if layout == "kimi_linear":
            if e.name.endswith(".self_attn.A_log"):
                e = dataclasses.replace(e, kind="reshape", shape=(1, 1, e.inner[0], 1))
        else:
            name = e.name
            if name == "model.embed_tokens.weight":
                name = "model.embeddings.weight"
            elif name == "lm_head.weight" and cj.get("tie_word_embeddings"):
                name = "model.embeddings.weight"  # tied: lm_head is the embedding, [V, d]
            for a, b in _FLA_RENAMES:
                name = name.replace(a, b)
            kind, shape = e.kind, e.shape
            if name.endswith(".attn.A_log"):
                kind, shape = "same", e.inner
            e = dataclasses.replace(e, name=name, kind=kind, shape=shape)
        out.append(e)
    return out


def foreign_config_json(layout: str, model_cfg) -> dict:
    """config.json for exporting `model_cfg` in a foreign layout; an error naming the first
    model setting that layout cannot express (found by mapping the written config back)."""
    m, k, moe = model_cfg, model_cfg.kda, model_cfg.moe
    if layout == "fla_kda":
        cj = {"model_type": "kda", "architectures": ["KDAForCausalLM"], "vocab_size": m.vocab_size,
              "hidden_size": m.d_model, "num_hidden_layers": m.num_layers, "num_heads": k.num_heads,
              "head_dim": m.head_dim("kda"), "intermediate_size": m.ffn_hidden, "norm_eps": m.rms_norm_eps,
              "conv_size": k.conv_size, "use_short_conv": True, "hidden_act": "swish", "expand_v": 1.0,
              "allow_neg_eigval": False, "attn": None, "tie_word_embeddings": False, "attn_mode": "chunk",
              "safe_gate": k.gate == "lower_bound",
              "lower_bound": k.gate_lower_bound if k.gate == "lower_bound" else None}
        changes = fla_model_changes(cj, "fla config.json")
    elif layout == "kimi_linear":
        mla = m.mla
        has_moe = any(m.ffn_kind(i) == "moe" for i in range(m.num_layers))
        cj = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": m.vocab_size,
              "hidden_size": m.d_model, "num_hidden_layers": m.num_layers, "intermediate_size": m.ffn_hidden,
              "hidden_act": "silu", "rms_norm_eps": m.rms_norm_eps, "tie_word_embeddings": False,
              "num_attention_heads": mla.num_heads, "num_key_value_heads": mla.num_heads, "q_lora_rank": None,
              "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
              "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "mla_use_nope": True,
              "num_experts": moe.num_experts if has_moe else None, "num_experts_per_token": moe.top_k,
              "num_shared_experts": moe.num_shared_experts, "moe_intermediate_size": moe.expert_hidden,
              "routed_scaling_factor": moe.routed_scaling_factor, "first_k_dense_replace": m.first_k_dense,
              "moe_layer_freq": m.moe_every, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
              "num_expert_group": 1, "topk_group": 1,
              "linear_attn_config": {"kda_layers": [i + 1 for i, x in enumerate(m.mixers) if x == "kda"],
                                     "full_attn_layers": [i + 1 for i, x in enumerate(m.mixers) if x == "mla"],
                                     "num_heads": k.num_heads, "head_dim": m.head_dim("kda"),
                                     "short_conv_kernel_size": k.conv_size}}
        changes = kimi_model_changes(cj, "kimi_linear config.json")
    else:
        raise InterchangeError(f"no foreign layout {layout!r}; choose from {LAYOUTS[1:]}")
    back = apply_changes(model_cfg, changes, f"{layout} config.json")
    from k3jax.config.load import config_to_dict
    from k3jax.config.schema import Config

    a, b = config_to_dict(Config(model=model_cfg))["model"], config_to_dict(Config(model=back))["model"]
    for key in sorted(set(_flat(a)) | set(_flat(b))):
        if _flat(a).get(key) != _flat(b).get(key) and not _irrelevant(model_cfg, key):
            raise InterchangeError(f"the {layout} layout cannot express model.{key}={_flat(a).get(key)!r}")
    return cj


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _irrelevant(model_cfg, key: str) -> bool:
    """Settings of sections the model does not use (e.g. mla.* in an all-KDA model)."""
    used = set(model_cfg.mixers)
    has_moe = any(model_cfg.ffn_kind(i) == "moe" for i in range(model_cfg.num_layers))
    section = key.split(".")[0]
    return ((section == "mla" and "mla" not in used) or (section == "kda" and "kda" not in used)
            or section == "attention" or (section == "moe" and not has_moe)
            or (key == "first_k_dense" and not has_moe))
