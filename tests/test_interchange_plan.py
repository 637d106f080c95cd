"""The export plan of configs/k3.yaml (names and shapes from jax.eval_shape, nothing allocated)
against the K3 release's tensor list, written here from the architecture reference's tables:
per-layer names, HF [out, in] shapes, the 1-based MLA schedule, A_log's 128-entry padding,
and the 2.78 T parameter total."""

import math
from pathlib import Path

from k3jax.config import load_config
from k3jax.interchange.names import release_plan

ROOT = Path(__file__).resolve().parents[1]


def release_tensors() -> dict[str, tuple[int, ...]]:
    d, V, L = 7168, 163840, 93
    H, K = 96, 128
    P = H * K
    mla_layers = set(range(3, 92, 4)) | {92}  # 0-based: 4, 8, ..., 92 and 93 counted from 1
    E, h, lat, shared = 896, 3072, 3584, 2 * 3072
    t = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,), "lm_head.weight": (V, d),
         "model.output_attn_res_norm.weight": (d,), "model.output_attn_res_proj.weight": (1, d)}
    for i in range(L):
        p = f"model.layers.{i}."
        for site in ("self_attention_res", "mlp_res"):
            t[p + site + "_norm.weight"], t[p + site + "_proj.weight"] = (d,), (1, d)
        t[p + "input_layernorm.weight"] = t[p + "post_attention_layernorm.weight"] = (d,)
        a = p + "self_attn."
        if i in mla_layers:
            t.update({a + "q_a_proj.weight": (1536, d), a + "q_a_layernorm.weight": (1536,),
                      a + "q_b_proj.weight": (H * 192, 1536), a + "kv_a_proj_with_mqa.weight": (576, d),
                      a + "kv_a_layernorm.weight": (512,), a + "kv_b_proj.weight": (H * 256, 512),
                      a + "g_proj.weight": (H * 128, d), a + "o_proj.weight": (d, H * 128)})
        else:
            for x in "qkv":
                t[a + f"{x}_proj.weight"], t[a + f"{x}_conv1d.weight"] = (P, d), (P, 1, 4)
            t.update({a + "f_a_proj.weight": (K, d), a + "f_b_proj.weight": (P, K), a + "A_log": (128,),
                      a + "dt_bias": (P,), a + "b_proj.weight": (H, d), a + "g_proj.weight": (P, d),
                      a + "o_norm.weight": (K,), a + "o_proj.weight": (d, P)})
        if i == 0:
            t.update({p + "mlp.gate_proj.weight": (33792, d), p + "mlp.up_proj.weight": (33792, d),
                      p + "mlp.down_proj.weight": (d, 33792)})
            continue
        m = p + "block_sparse_moe."
        t.update({m + "gate.weight": (E, d), m + "gate.e_score_correction_bias": (E,),
                  m + "routed_expert_down_proj.weight": (lat, d), m + "routed_expert_norm.weight": (lat,),
                  m + "routed_expert_up_proj.weight": (d, lat), m + "shared_experts.gate_proj.weight": (shared, d),
                  m + "shared_experts.up_proj.weight": (shared, d), m + "shared_experts.down_proj.weight": (d, shared)})
        for e in range(E):
            t[m + f"experts.{e}.w1.weight"] = t[m + f"experts.{e}.w3.weight"] = (h, lat)
            t[m + f"experts.{e}.w2.weight"] = (lat, h)
    return t


def test_k3_export_plan_is_the_release_tensor_list():
    cfg = load_config(ROOT / "configs" / "k3.yaml")
    plan = release_plan(cfg.model)
    got = {e.name: tuple(e.shape) for e in plan}
    assert len(got) == len(plan)  # no name twice
    want = release_tensors()
    assert got.keys() == want.keys(), (sorted(got.keys() - want.keys())[:3], sorted(want.keys() - got.keys())[:3])
    wrong = [(n, got[n], want[n]) for n in want if got[n] != want[n]]
    assert not wrong, wrong[:3]
    # the published size, 2.7795 T parameters in all (A_log counted unpadded: 69 layers x 96)
    total = sum(math.prod(s) for s in got.values()) - 69 * 32
    assert round(total / 1e12, 4) == 2.7795
    experts = [e for e in plan if e.expert]
    assert len(experts) == 92 * 896 * 3 and all(e.name.split(".")[-2] in ("w1", "w2", "w3") for e in experts)
