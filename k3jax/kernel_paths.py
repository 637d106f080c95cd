"""Which implementation each hot operator takes for a model on this backend, in words.

The training CLI prints these lines at start and the benchmarks record them, so a run's
speed can always be traced to the code that ran: the delta-rule layers' chunked operator
(`model.kda.impl`), the routed experts' grouped matmul (`model.moe.grouped_matmul`), and
the softmax attention of MLA / attention layers (`model.mla.impl`, `model.attention.impl`),
AttnRes's depth mix (`model.attn_res_impl`), node-limited expert routing when a config turns
it on (`model.moe.max_nodes_per_token`), the short convolutions' backward
(`model.kda.conv_impl`), and the opt-in GLU backward kernel (`model.moe.glu_grad`), which
measured no faster in the step than the default, one XLA fusion.
A setting that asks for a kernel that cannot run here is a ConfigError naming the key.
"""

from __future__ import annotations

import jax

from k3jax.config import ConfigError


def expert_matmul_path(model_cfg) -> str | None:
    """"kernel (tokamax grouped GEMM; weight gradient: ...)", "blocked", "ragged" or None
    without MoE layers."""
    from k3jax.ops import grouped_matmul as gm

    if not any(model_cfg.ffn_kind(i) == "moe" for i in range(model_cfg.num_layers)):
        return None
    try:
        impl = gm.resolve_impl(model_cfg.moe.grouped_matmul)
    except ValueError as e:
        raise ConfigError(str(e), "model.moe.grouped_matmul") from None
    if impl == "kernel":
        dw = {"pallas": "k3jax's Pallas kernel", "tokamax": "tokamax's (wrong on an H200 at times: BENCHMARKS.md §4)"}
        return f"kernel (tokamax grouped GEMM; weight gradient: {dw[model_cfg.moe.gmm_weight_grad]})"
    # on a GPU, say why the kernel did not run (the GPU extra missing); elsewhere there is none
    on_gpu_auto = model_cfg.moe.grouped_matmul == "auto" and jax.default_backend() == "gpu"
    why = gm.kernel_unavailable() if on_gpu_auto else None
    return impl + (f" (kernel unavailable: {why})" if why else "")


def attention_path(model_cfg) -> str | None:
    """"kernel (flash, document starts)" or "xla (dense mask)" for the softmax-attention
    layers, None without them."""
    from k3jax.ops import flash_attention as fa

    found = []
    for kind, key in (("mla", "model.mla.impl"), ("attention", "model.attention.impl")):
        if kind not in model_cfg.mixers:
            continue
        impl = getattr(model_cfg, kind).impl
        try:
            found.append(fa.resolve_impl(impl))
        except ValueError as e:
            raise ConfigError(str(e), key) from None
    if not found:
        return None
    return ", ".join(sorted({"kernel (flash, document starts)" if f == "kernel" else "xla (dense mask)"
                             for f in found}))


def expert_routing(model_cfg) -> str | None:
    """Node-limited routing, when a config turns it on (it changes which experts a token gets)."""
    moe = model_cfg.moe
    if not moe.max_nodes_per_token or not any(model_cfg.ffn_kind(i) == "moe" for i in range(model_cfg.num_layers)):
        return None
    return (f"node-limited: each token's experts lie on at most {moe.max_nodes_per_token} of {moe.expert_nodes} "
            f"nodes (moe.max_nodes_per_token; K3's own routing has no such limit)")


def attn_res_path(model_cfg) -> str | None:
    """AttnRes's depth mix (`model.attn_res_impl`): the fused kernels or XLA; None without AttnRes."""
    from k3jax.ops import attnres_mix as am

    if not model_cfg.attn_res_block_size:
        return None
    impl = model_cfg.attn_res_impl
    if impl == "xla":
        return "xla"
    fits = model_cfg.d_model % am.CHUNK == 0
    if impl == "kernel" and not fits:
        raise ConfigError(f"d_model={model_cfg.d_model} is not a multiple of {am.CHUNK}", "model.attn_res_impl")
    if jax.default_backend() == "gpu" and fits:
        return "kernel (fused Pallas depth mix; XLA where a mesh splits the tokens)"
    if impl == "kernel":
        return "kernel (Pallas interpreter: no GPU)"
    return "xla" + ("" if fits else f" (d_model={model_cfg.d_model} is not a multiple of {am.CHUNK})")


def short_conv_path(model_cfg) -> str | None:
    """How the linear-attention layers' short convolutions run (model.kda.conv_impl); None
    without any."""
    from k3jax.ops.decode_kernels.common import resolve_impl

    delta = {"kda", "gated_deltanet", "deltanet", "linear"} & set(model_cfg.mixers)
    if not (delta and model_cfg.kda.conv_size):
        return None
    if resolve_impl(model_cfg.kda.conv_impl, "model.kda.conv_impl") != "pallas":
        return "xla"
    where = "" if jax.default_backend() == "gpu" else ", in the Pallas interpreter (no GPU)"
    norm = "" if "linear" in model_cfg.mixers and len(delta) == 1 else "; q and k's l2 norm inside it"
    return f"backward kernel (Pallas{where}{norm}; XLA where the length is not a multiple of 16), forward xla"


def opt_in_kernels(model_cfg) -> str | None:
    """The kernels a config turned on that are not the defaults (model.moe.glu_grad), as they
    resolve here; None when none runs."""
    from k3jax.ops.decode_kernels.common import resolve_impl

    experts = any(model_cfg.ffn_kind(i) == "moe" for i in range(model_cfg.num_layers))
    if not (experts and (expert_matmul_path(model_cfg) or "").startswith("kernel") and
            resolve_impl(model_cfg.moe.glu_grad, "model.moe.glu_grad") == "pallas"):
        return None
    where = "" if jax.default_backend() == "gpu" else " in the Pallas interpreter (no GPU)"
    return ("experts' GLU backward kernel (model.moe.glu_grad)" + where +
            ": the k3-small step on an H200 no faster than with the default, one XLA fusion")


def kernel_lines(model_cfg) -> list[str]:
    """The start-of-run lines: one per operator family the model has."""
    from k3jax.layers.kda import chunk_path

    out = []
    for name, path in (("linear-attention layers", chunk_path(model_cfg)),
                       ("short convolutions", short_conv_path(model_cfg)),
                       ("softmax attention", attention_path(model_cfg)),
                       ("expert matmuls", expert_matmul_path(model_cfg)),
                       ("expert routing", expert_routing(model_cfg)),
                       ("AttnRes depth mix", attn_res_path(model_cfg)),
                       ("opt-in", opt_in_kernels(model_cfg))):
        if path:
            out.append(f"{name}: {path}")
    return out
