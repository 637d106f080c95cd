"""k3jax-import of the public relatives of K3: an fla KDAForCausalLM checkpoint and a Kimi Linear
checkpoint, each written here with NumPy from a description of its layout (names, [out, in]
shapes, config.json keys), imported into an unscanned model (so layer i is slot i) and
compared tensor by tensor; the fla import's logits also against a float64 NumPy forward of
fla's model computed from the file's tensors."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from interchange_util import micro_config
from reference import delta_rule_loop, rel_err
from safetensors.numpy import load_file, save_file

from k3jax.interchange import InterchangeError
from k3jax.interchange.hf_reader import import_checkpoint
from k3jax.interchange.hf_writer import export_weights

V, D, H, K, F = 64, 64, 2, 32, 96
P = H * K


def write(tmp_path, config: dict, tensors: dict):
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal(s).astype(np.float32) * (0.3 if len(s) > 1 else 1.0) for n, s in tensors.items()}
    half = len(arrays) // 2  # two shards and an index, as save_pretrained writes them
    names = sorted(arrays)
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, ns in files.items():
        save_file({n: arrays[n] for n in ns}, str(tmp_path / f), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": {n: f for f, ns in files.items() for n in ns}}))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return arrays


def kda_tensors(prefix: str, attn: str) -> dict:
    """A KDA layer's tensors; fla and Kimi Linear differ only in the gate projections' names."""
    t = {f"{prefix}.{attn}.{x}_proj.weight": (P, D) for x in "qkv"}
    t.update({f"{prefix}.{attn}.{x}_conv1d.weight": (P, 1, 4) for x in "qkv"})
    t.update({f"{prefix}.{attn}.b_proj.weight": (H, D), f"{prefix}.{attn}.dt_bias": (P,),
              f"{prefix}.{attn}.o_norm.weight": (K,), f"{prefix}.{attn}.o_proj.weight": (D, P)})
    return t


FLA_CONFIG = {"model_type": "kda", "architectures": ["KDAForCausalLM"], "vocab_size": V, "hidden_size": D,
              "num_hidden_layers": 2, "num_heads": H, "head_dim": K, "intermediate_size": F, "norm_eps": 1e-6,
              "conv_size": 4, "use_short_conv": True, "hidden_act": "swish", "expand_v": 1.0, "attn": None,
              "tie_word_embeddings": False}


def fla_tensors():
    t = {"model.embeddings.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(2):
        p = f"model.layers.{i}"
        t.update(kda_tensors(p, "attn"))
        t.update({f"{p}.attn_norm.weight": (D,), f"{p}.mlp_norm.weight": (D,), f"{p}.attn.A_log": (H,),
                  f"{p}.attn.f_proj.0.weight": (K, D), f"{p}.attn.f_proj.1.weight": (P, K),
                  f"{p}.attn.g_proj.0.weight": (K, D), f"{p}.attn.g_proj.1.weight": (P, K),
                  f"{p}.attn.g_proj.1.bias": (P,), f"{p}.mlp.gate_proj.weight": (F, D),
                  f"{p}.mlp.up_proj.weight": (F, D), f"{p}.mlp.down_proj.weight": (D, F)})
    return t


def fla_forward_np(w, tokens):
    """fla KDAForCausalLM in float64: pre-norm residual blocks of KDA (softplus gate, low-rank
    output gate with bias, gated RMSNorm over head_dim) and a SwiGLU MLP; all norms eps 1e-6."""
    f = lambda n: np.asarray(w[n], np.float64)
    sig = lambda x: 1 / (1 + np.exp(-x))
    rms = lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g
    x = f("model.embeddings.weight")[tokens][None]  # [1, T, D]
    T = x.shape[1]
    seg = np.zeros((1, T), np.int32)
    for i in range(2):
        a = f"model.layers.{i}.attn."
        h = rms(x, f(f"model.layers.{i}.attn_norm.weight"))
        feats = []
        for n in "qkv":
            u = h @ f(a + f"{n}_proj.weight").T
            cw = f(a + f"{n}_conv1d.weight")[:, 0, :]  # [P, W]: tap j multiplies x_{t-W+1+j}
            pad = np.concatenate([np.zeros((1, 3, P)), u], axis=1)
            c = sum(pad[:, j:j + T] * cw[:, j] for j in range(4))
            feats.append((c * sig(c)).reshape(1, T, H, K))
        q, k, v = feats
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        z = (h @ f(a + "f_proj.0.weight").T @ f(a + "f_proj.1.weight").T + f(a + "dt_bias")).reshape(1, T, H, K)
        g = -np.exp(f(a + "A_log"))[:, None] * np.log1p(np.exp(z))
        beta = sig(h @ f(a + "b_proj.weight").T)
        o, _ = delta_rule_loop(q, k, v, g, beta, segment_ids=seg, decay="channel", delta=True)
        G = (h @ f(a + "g_proj.0.weight").T @ f(a + "g_proj.1.weight").T + f(a + "g_proj.1.bias")).reshape(1, T, H, K)
        o = rms(o, f(a + "o_norm.weight")) * sig(G)
        x = x + o.reshape(1, T, P) @ f(a + "o_proj.weight").T
        h = rms(x, f(f"model.layers.{i}.mlp_norm.weight"))
        m = f"model.layers.{i}.mlp."
        gt = h @ f(m + "gate_proj.weight").T
        x = x + (gt * sig(gt) * (h @ f(m + "up_proj.weight").T)) @ f(m + "down_proj.weight").T
    return rms(x, f("model.norm.weight")) @ f("lm_head.weight").T


def test_fla_kda_checkpoint_imports_exactly_and_gives_fla_logits(tmp_path):
    w = write(tmp_path, FLA_CONFIG, fla_tensors())
    cfg, arrays = import_checkpoint(tmp_path, micro_config(scan_layers=False))
    m = cfg.model
    assert (m.mixers, m.kda.gate, m.kda.output_gate, m.kda.output_gate_bias, m.moe_every, m.activation,
            m.rms_norm_eps, m.attn_res_block_size, m.ffn_hidden) == (("kda", "kda"), "softplus", "low_rank", True,
                                                                    0, "swiglu", 1e-6, 0, F)
    p = arrays["params"]
    layers = p["stages"][0]["units"]["layers"]
    np.testing.assert_array_equal(p["embed_tokens"], w["model.embeddings.weight"])
    np.testing.assert_array_equal(p["lm_head"]["kernel"], w["lm_head.weight"].T)
    for i in range(2):
        L, a = layers[i], f"model.layers.{i}.attn."
        at = L["self_attn"]
        np.testing.assert_array_equal(at["f_a_proj"]["kernel"][0], w[a + "f_proj.0.weight"].T)
        np.testing.assert_array_equal(at["f_b_proj"]["kernel"][0], w[a + "f_proj.1.weight"].T)
        np.testing.assert_array_equal(at["g_b_proj"]["kernel"][0], w[a + "g_proj.1.weight"].T)
        np.testing.assert_array_equal(at["g_bias"][0], w[a + "g_proj.1.bias"])
        np.testing.assert_array_equal(at["v_conv1d"]["weight"][0], w[a + "v_conv1d.weight"][:, 0, :].T)
        np.testing.assert_array_equal(at["A_log"][0], w[a + "A_log"])
        np.testing.assert_array_equal(at["o_proj"]["kernel"][0], w[a + "o_proj.weight"].T)
        np.testing.assert_array_equal(L["input_layernorm"]["weight"][0], w[f"model.layers.{i}.attn_norm.weight"])
        np.testing.assert_array_equal(L["mlp"]["down_proj"]["kernel"][0], w[f"model.layers.{i}.mlp.down_proj.weight"].T)
    # the imported model's logits against fla's model computed from the file
    from k3jax.model_spec import model_spec

    model = model_spec(cfg.model).model_from(arrays["params"], arrays["rest"])
    tokens = np.array([3, 17, 40, 5, 9, 63, 0, 22])
    logits, _ = model(jnp.asarray(tokens[None]))
    assert rel_err(logits, fla_forward_np(w, tokens)) < 1e-5


def kimi_tensors(E=4, h=32, R=32, n=16, r=8, vd=16, Hm=2):
    t = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(4):
        p = f"model.layers.{i}"
        t.update({f"{p}.input_layernorm.weight": (D,), f"{p}.post_attention_layernorm.weight": (D,)})
        if i == 2:  # the MLA layer: direct q_proj, no output gate
            s = f"{p}.self_attn."
            t.update({s + "q_proj.weight": (Hm * (n + r), D), s + "kv_a_proj_with_mqa.weight": (R + r, D),
                      s + "kv_a_layernorm.weight": (R,), s + "kv_b_proj.weight": (Hm * (n + vd), R),
                      s + "o_proj.weight": (D, Hm * vd)})
        else:
            t.update(kda_tensors(p, "self_attn"))
            s = f"{p}.self_attn."
            t.update({s + "A_log": (1, 1, H, 1), s + "f_a_proj.weight": (K, D), s + "f_b_proj.weight": (P, K),
                      s + "g_a_proj.weight": (K, D), s + "g_b_proj.weight": (P, K)})
        if i == 0:
            t.update({f"{p}.mlp.{x}_proj.weight": (F, D) for x in ("gate", "up")})
            t[f"{p}.mlp.down_proj.weight"] = (D, F)
            continue
        m = f"{p}.block_sparse_moe."
        t.update({m + "gate.weight": (E, D), m + "gate.e_score_correction_bias": (E,),
                  m + "shared_experts.gate_proj.weight": (h, D), m + "shared_experts.up_proj.weight": (h, D),
                  m + "shared_experts.down_proj.weight": (D, h)})
        for e in range(E):
            t.update({m + f"experts.{e}.w1.weight": (h, D), m + f"experts.{e}.w3.weight": (h, D),
                      m + f"experts.{e}.w2.weight": (D, h)})
    return t


KIMI_CONFIG = {"model_type": "kimi_linear", "vocab_size": V, "hidden_size": D, "num_hidden_layers": 4,
               "intermediate_size": F, "hidden_act": "silu", "rms_norm_eps": 1e-5, "num_attention_heads": 2,
               "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
               "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True, "num_experts": 4,
               "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 32,
               "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "moe_layer_freq": 1,
               "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_expert_group": 1,
               "topk_group": 1, "tie_word_embeddings": False,
               "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": H,
                                      "head_dim": K, "short_conv_kernel_size": 4}}


def test_kimi_linear_checkpoint_imports_exactly(tmp_path):
    w = write(tmp_path, KIMI_CONFIG, kimi_tensors())
    cfg, arrays = import_checkpoint(tmp_path, micro_config(scan_layers=False))
    m = cfg.model
    assert m.mixers == ("kda", "kda", "mla", "kda") and [m.ffn_kind(i) for i in range(4)] == ["dense"] + ["moe"] * 3
    assert (m.mla.q_lora_rank, m.mla.output_gate, m.mla.kv_norm_eps, m.moe.latent_dim, m.moe.routed_scaling_factor,
            m.kda.gate, m.kda.output_gate_bias) == (0, False, 1e-6, 0, 2.446, "softplus", False)
    layers = arrays["params"]["stages"][0]["units"]["layers"]
    at = layers[2]["self_attn"]
    s = "model.layers.2.self_attn."
    np.testing.assert_array_equal(at["q_proj"]["kernel"][0].reshape(D, -1), w[s + "q_proj.weight"].T)
    np.testing.assert_array_equal(at["kv_b_proj"]["kernel"][0].reshape(32, -1), w[s + "kv_b_proj.weight"].T)
    np.testing.assert_array_equal(at["o_proj"]["kernel"][0].reshape(-1, D), w[s + "o_proj.weight"].T)
    np.testing.assert_array_equal(layers[3]["self_attn"]["A_log"][0], w["model.layers.3.self_attn.A_log"][0, 0, :, 0])
    np.testing.assert_array_equal(layers[1]["self_attn"]["g_a_proj"]["kernel"][0],
                                  w["model.layers.1.self_attn.g_a_proj.weight"].T)
    moe = layers[3]["block_sparse_moe"]
    b = "model.layers.3.block_sparse_moe."
    for e in range(4):
        np.testing.assert_array_equal(moe["experts"]["w1"][0, e], w[b + f"experts.{e}.w1.weight"].T)
        np.testing.assert_array_equal(moe["experts"]["w2"][0, e], w[b + f"experts.{e}.w2.weight"].T)
    np.testing.assert_array_equal(moe["gate"]["weight"][0], w[b + "gate.weight"].T)
    np.testing.assert_array_equal(moe["shared_experts"]["down_proj"]["kernel"][0],
                                  w[b + "shared_experts.down_proj.weight"].T)
    np.testing.assert_array_equal(arrays["rest"]["router_bias"][2], w[b + "gate.e_score_correction_bias"])


@pytest.mark.parametrize("key,value,match", [
    ("num_expert_group", 4, "num_expert_group=4 is not supported"),
    ("q_lora_rank", 16, "q_lora_rank=16 is not supported"),
    ("model_type", "llama", "model_type 'llama' is not one k3jax reads"),
])
def test_unsupported_configs_are_refused_naming_the_key(tmp_path, key, value, match):
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({**KIMI_CONFIG, key: value}))
    with pytest.raises(InterchangeError, match=match):
        import_checkpoint(tmp_path, micro_config())


@pytest.mark.parametrize("layout,config,tensors", [("fla_kda", FLA_CONFIG, fla_tensors),
                                                    ("kimi_linear", KIMI_CONFIG, kimi_tensors)])
def test_export_in_the_relatives_layout_gives_the_file_back(tmp_path, layout, config, tensors):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    w = write(src, config, tensors())
    cfg, arrays = import_checkpoint(src, micro_config())
    export_weights(cfg, arrays["params"], arrays["rest"], out, dtype="float32", layout=layout)
    back = {}
    for f in out.glob("*.safetensors"):
        back.update(load_file(str(f)))
    assert set(back) == set(w) and all(np.array_equal(back[n], w[n]) for n in w)
    cfg2, _ = import_checkpoint(out, micro_config())
    assert cfg2.model == cfg.model


def test_export_refuses_what_the_layout_cannot_express(tmp_path):
    cfg = micro_config()  # K3's gates, LatentMoE and AttnRes: not expressible as fla's KDA model
    with pytest.raises(InterchangeError, match="fla_kda layout cannot express model.activation"):
        export_weights(cfg, {}, {}, tmp_path, layout="fla_kda")
