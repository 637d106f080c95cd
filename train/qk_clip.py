"""QK-Clip (MuonClip, Kimi K2) for gated MLA: after the optimizer update, rescale the query and
key weights of every head whose largest pre-softmax logit of the step exceeded tau.

For an MLA head h with S_max^h > tau (the step's max over the batch of its scaled, masked
logits, `K3Model(..., mla_max_logits=True)`), gamma_h = tau / S_max^h and

    q_b_proj[..., h, :n]   *= sqrt(gamma_h)   (the head's q nope part; q_proj without q LoRA)
    kv_b_proj[..., h, :n]  *= sqrt(gamma_h)   (its k nope part, W_UK)
    q_b_proj[..., h, n:]   *= gamma_h         (its q rope part: the rope key is shared by all heads)

so both terms of the head's logit q^n.k^n + q^p.k^p shrink by gamma_h. The shared rope key
(kv_a_proj_with_mqa), q_a_proj, the value part of kv_b_proj and the optimizer state are left
alone; heads at or below tau are not touched. The weights are scanned-stage parameters
([repeat, in, H, head_dim]), so one factor per (repeat, head) broadcasts over the rest.
"""

from __future__ import annotations

import jax.numpy as jnp

from k3jax.layout import plan_stages


def mla_layer_slots(model_cfg) -> list[tuple[int, int, int]]:
    """(stage, slot in the stage's unit, repeat) per MLA layer, in the order of the model's
    aux["mla_max_logits"] rows (stage by stage, repeat-major, then unit order)."""
    out = []
    for s, stage in enumerate(plan_stages(model_cfg)):
        slots = [j for j, (mixer, _) in enumerate(stage.unit) if mixer == "mla"]
        out += [(s, j, r) for r in range(stage.repeat) for j in slots]
    return out


def clip_factors(max_logits, tau: float):
    """[..., H] max logits -> gamma = tau / S where S > tau, else 1 (fp32)."""
    s = jnp.asarray(max_logits, jnp.float32)
    return jnp.where(s > tau, tau / jnp.where(s > tau, s, 1.0), 1.0)


def qk_clip(params: dict, max_logits, model_cfg, tau: float):
    """params: the pure parameter dict of a K3Model; max_logits [L_mla, H] (aux["mla_max_logits"]).

    Returns (params with every MLA layer's q/k weights clipped, clipped heads per MLA layer [L_mla])."""
    m = model_cfg.mla
    n = m.qk_nope_head_dim
    q_name = "q_b_proj" if m.q_lora_rank > 0 else "q_proj"
    gamma = clip_factors(max_logits, tau)  # [L_mla, H]
    slots = mla_layer_slots(model_cfg)
    if gamma.shape[0] != len(slots):
        raise ValueError(f"qk_clip: {gamma.shape[0]} rows of max logits for {len(slots)} MLA layers")
    stages = dict(params["stages"])
    for s, stage in enumerate(plan_stages(model_cfg)):
        mine = [i for i, slot in enumerate(slots) if slot[0] == s]
        if not mine:
            continue
        layers = dict(stages[s]["units"]["layers"])
        for j in sorted({slots[i][1] for i in mine}):
            rows = [i for i in mine if slots[i][1] == j]  # this slot's layers, repeat 0, 1, ...
            g = gamma[jnp.asarray(rows)][:, None, :, None]  # [repeat, 1, H, 1]
            attn = dict(layers[j]["self_attn"])
            wq, wkv = attn[q_name]["kernel"], attn["kv_b_proj"]["kernel"]  # [repeat, in, H, n+r], [.., n+v]
            root = jnp.broadcast_to(jnp.sqrt(g), g.shape[:3] + (n,))
            q_scale = jnp.concatenate([root, jnp.broadcast_to(g, g.shape[:3] + (wq.shape[-1] - n,))], axis=-1)
            kv_scale = jnp.concatenate([root, jnp.ones(g.shape[:3] + (wkv.shape[-1] - n,), jnp.float32)], axis=-1)
            attn[q_name] = {**attn[q_name], "kernel": (wq * q_scale).astype(wq.dtype)}
            attn["kv_b_proj"] = {**attn["kv_b_proj"], "kernel": (wkv * kv_scale).astype(wkv.dtype)}
            layers[j] = {**layers[j], "self_attn": attn}
        stages[s] = {**stages[s], "units": {**stages[s]["units"], "layers": layers}}
    clipped = jnp.sum(gamma < 1.0, axis=-1).astype(jnp.float32)
    return {**params, "stages": stages}, clipped
