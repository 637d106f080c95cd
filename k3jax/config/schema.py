"""Typed, frozen configuration. These dataclasses are the only source of defaults.

YAML files and `key.sub=value` overrides only *change* fields declared here
(`k3jax.config.load`). Cross-field rules live in each class's `check()`; they
return (dotted key, problem) pairs so the loader can name the file that set it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from k3jax.config.pattern import MIXERS, parse_layer_pattern

Problem = tuple[str, str]  # (dotted key relative to the class, message)


def knob(default):
    """A field that changes how a result is computed, not what it is (chunk sizes, kernels,
    remat, dispatch): a resumed run may change it. Every other model field is part of what a
    checkpoint was written for (`execution_keys`)."""
    return field(default=default, metadata={"execution": True})


def execution_keys(cls, prefix: str = "") -> frozenset[str]:
    """Dotted names of every `knob` field under a config dataclass."""
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        if f.metadata.get("execution"):
            out.add(prefix + f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out |= execution_keys(type(default), prefix + f.name + ".")
    return frozenset(out)


@dataclass(frozen=True)
class KDAConfig:
    """The linear-attention family's layer (KDA and its lineage ablations).

    Every linear mixer (`kda`, `gated_deltanet`, `deltanet`, `linear`) uses these
    projection widths, so the lineage is compared on equal terms; the mixer name
    only selects the recurrence and its gate.
    """

    num_heads: int = 4
    head_dim: int = 32  # 0 = d_model / num_heads
    conv_size: int = 4  # causal depthwise short conv; 0 disables it
    # K3: g = lb * sigmoid(exp(A_log) * z); Kimi Linear: g = -exp(A_log) * softplus(z)
    gate: Literal["lower_bound", "softplus"] = "lower_bound"
    gate_lower_bound: float = -5.0
    gate_rank: int = 0  # rank of the f_a/f_b decay-gate projection; 0 = head_dim
    # K3 uses a full-rank sigmoid output gate (g_proj d -> H*dk); Kimi Linear a low-rank one
    output_gate: Literal["full", "low_rank"] = "full"
    output_gate_rank: int = 0  # 0 = head_dim
    # fla's KDAForCausalLM gives the low-rank gate's second projection a bias (g_proj.1.bias,
    # [H*head_dim]); K3 and Kimi Linear have none. Only with output_gate=low_rank.
    output_gate_bias: bool = False
    a_init_min: float = 1.0  # A_log = log(U(a_init_min, a_init_max)), fla's init
    a_init_max: float = 16.0
    # K3's training init of dt_bias is not published; fla initialises it to zeros.
    dt_bias_init: float = 0.0
    chunk_size: int = knob(64)
    # the chunked operator: auto = fused Pallas kernels on GPU when they support the layer
    # (static gate bound, power-of-two head_dim, chunk 16/32/64), plain XLA otherwise (and on
    # CPU/TPU); pallas = the kernels or an error saying why not; xla = always XLA
    impl: Literal["auto", "pallas", "xla"] = knob("auto")
    # the short convolutions' backward, with q and k's l2 norm per head (k3jax.layers.conv): auto =
    # one Pallas kernel on GPU (k3jax.ops.short_conv_grad; where T and q/k/v's width are multiples
    # of its tile), XLA elsewhere; pallas = the kernel everywhere (the Pallas interpreter off a GPU:
    # tests); xla = always XLA. The forward is XLA's. On an H200 k3-small's step took 525.0 ms with
    # the kernel and 552.3 with XLA's, in one lease (BENCHMARKS.md §4)
    conv_impl: Literal["auto", "pallas", "xla"] = knob("auto")
    # what the fused kernels' forward keeps for their backward (k3jax.ops.kda_kernels.op):
    # intermediates = kernel 1's outputs with the UT inverse, the chunk states and v_new (about
    # 2 (3K + 2C + V) + 2 K V / C bytes per token and head in bf16: 0.7 GB per k3-small layer at
    # 8 x 4096), so the backward does not run the two forward kernels again; inputs = only the
    # inputs, as fla keeps, and the backward recomputes the rest. The same numbers either way
    kernel_residuals: Literal["intermediates", "inputs"] = knob("intermediates")

    def check(self) -> list[Problem]:
        out: list[Problem] = []
        for name in ("num_heads", "chunk_size"):
            if getattr(self, name) <= 0:
                out.append((name, f"must be positive, got {getattr(self, name)}"))
        if self.head_dim < 0:
            out.append(("head_dim", f"must be >= 0, got {self.head_dim}"))
        if self.conv_size < 0:
            out.append(("conv_size", f"must be >= 0, got {self.conv_size}"))
        if self.conv_impl == "pallas" and self.head_dim and (self.num_heads * self.head_dim) % 16:
            out.append(("conv_impl", f"pallas needs num_heads * head_dim a multiple of 16 (the kernel's "
                                     f"tile), got {self.num_heads * self.head_dim}"))
        elif (self.conv_impl == "pallas" and self.head_dim and self.conv_size
              and (self.head_dim < 16 or self.head_dim > 256 or self.head_dim & (self.head_dim - 1))):
            out.append(("conv_impl", f"pallas takes q and k's l2 norm per head inside the kernel: head_dim must "
                                     f"be a power of two in [16, 256], got {self.head_dim}"))
        if self.gate_lower_bound >= 0:
            out.append(("gate_lower_bound", f"must be negative, got {self.gate_lower_bound}"))
        if not 0 < self.a_init_min <= self.a_init_max:
            out.append(("a_init_min", "need 0 < a_init_min <= a_init_max"))
        if self.chunk_size % 16 and self.chunk_size > 16:
            out.append(("chunk_size", f"must be <= 16 or a multiple of 16, got {self.chunk_size}"))
        if self.output_gate_bias and self.output_gate != "low_rank":
            out.append(("output_gate_bias", "only the low-rank output gate (output_gate=low_rank) has a bias"))
        return out


@dataclass(frozen=True)
class MLAConfig:
    """Gated multi-head latent attention: DeepSeek-V3's MLA with an optional sigmoid output gate."""

    num_heads: int = 4
    q_lora_rank: int = 64  # 0 = a direct q projection (Kimi Linear)
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16  # the shared key slot; rotated only when use_rope
    v_head_dim: int = 32
    use_rope: bool = False  # K3 is NoPE; RoPE is an ablation
    rope_theta: float = 10000.0
    output_gate: bool = True
    # training attention: auto = the fused flash kernel on GPU with the [gpu] extra (document
    # starts per query, no [T,T] mask), xla elsewhere; kernel = it or an error; xla = dense mask
    impl: Literal["auto", "kernel", "xla"] = knob("auto")
    # eps of kv_a_layernorm; 0 = model.rms_norm_eps. Kimi Linear builds that one norm with
    # its class default 1e-6 while every other norm uses rms_norm_eps (1e-5).
    kv_norm_eps: float = 0.0

    def check(self) -> list[Problem]:
        out: list[Problem] = []
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                out.append((name, f"must be positive, got {getattr(self, name)}"))
        for name in ("q_lora_rank", "qk_rope_head_dim"):
            if getattr(self, name) < 0:
                out.append((name, f"must be >= 0, got {getattr(self, name)}"))
        if self.use_rope and self.qk_rope_head_dim % 2:
            out.append(("qk_rope_head_dim", "must be even when use_rope is on"))
        if not self.kv_norm_eps >= 0:
            out.append(("kv_norm_eps", f"must be >= 0 (0 = model.rms_norm_eps), got {self.kv_norm_eps}"))
        return out


@dataclass(frozen=True)
class AttentionConfig:
    """Plain causal softmax attention (the lineage's first stage), with RoPE."""

    num_heads: int = 4
    num_kv_heads: int = 0  # 0 = num_heads (MHA); fewer gives GQA
    head_dim: int = 32  # 0 = d_model / num_heads
    rope_theta: float = 10000.0
    impl: Literal["auto", "kernel", "xla"] = knob("auto")  # as model.mla.impl
    # a causal depthwise short convolution + SiLU on q, k and v before RoPE: the linear rungs'
    # ShortConv (model.kda.conv_size), as Zoology puts a short conv in front of every mixer,
    # attention included. 0 = none: plain attention, K3's (K3 has no softmax layer; the ladder's
    # softmax_conv rung sets it)
    conv_size: int = 0
    # the convs' backward, as model.kda.conv_impl: auto = the Pallas kernel on a GPU where it
    # takes the shape, XLA elsewhere; xla = always XLA
    conv_impl: Literal["auto", "xla"] = knob("auto")

    def check(self) -> list[Problem]:
        out: list[Problem] = []
        if self.num_heads <= 0 or self.head_dim < 0:
            out.append(("num_heads", "num_heads must be positive and head_dim >= 0"))
        if self.conv_size < 0:
            out.append(("conv_size", f"must be >= 0 (0 = no short conv), got {self.conv_size}"))
        kv = self.num_kv_heads or self.num_heads
        if kv <= 0 or self.num_heads % kv:
            out.append(("num_kv_heads", f"num_heads={self.num_heads} is not a multiple of {kv}"))
        if self.head_dim % 2:
            out.append(("head_dim", "must be even for RoPE"))
        return out


@dataclass(frozen=True)
class MoEConfig:
    """Stable LatentMoE with a sigmoid router balanced by Quantile Balancing."""

    num_experts: int = 16
    top_k: int = 4
    expert_hidden: int = 64  # moe_intermediate_size, per expert
    num_shared_experts: int = 1  # fused into one full-width MLP of width n * expert_hidden
    shared_hidden: int = 0  # 0 = num_shared_experts * expert_hidden
    latent_dim: int = 0  # routed experts' width; 0 = d_model (no latent projections)
    latent_norm: bool = True  # the "Stable" RMSNorm on the combined routed output
    routed_scaling_factor: float = 1.0
    balance: Literal["quantile", "none"] = "quantile"
    qb_estimator: Literal["exact", "histogram"] = "exact"
    qb_bins: int = 1024
    qb_range: float = 4.0  # the histogram spans biased margins in [-qb_range, qb_range], in asinh bins (layers/qb.py)
    # the share of Su's QB step taken at each update: b <- b + rate * (b~ - b). 1 = Su's exact rule
    # (the bias that balances the batch just seen). Below 1 the bias averages the last ~1/rate
    # batches (an exponential moving average, not in Su's formulation): for batches too small to
    # stand for the next one, where the exact rule chases each batch's own mix (layers/qb.py)
    qb_update_rate: float = 1.0
    # expert parallelism (a mesh with expert > 1): how tokens cross devices
    ep_dispatch: Literal["auto", "ragged", "capacity"] = knob("auto")  # auto: ragged on GPU/TPU
    ep_capacity_factor: float = knob(2.0)  # buffer rows per device = factor x expected; overflow dropped
    # the exchange (k3jax/layers/expert_parallel.py): the token rows cross as MXFP8 under qat=mxfp4
    # ("auto": the values the expert GEMM quantizes them to anyway) or in the compute dtype
    ep_wire: Literal["auto", "compute"] = knob("auto")
    # parts of each device's tokens exchanged independently, so transfers run under GEMMs
    # (XLA:CPU runs collectives synchronously: a CPU mesh takes 1)
    ep_chunks: int = knob(2)
    ep_devices_per_node: int = knob(8)  # devices sharing NVLink: a token crosses to a node once
    # a tensor group's experts: "rows" (hidden split over tensor, rows go to every rank),
    # "weights" (each rank gathers its shard's experts whole), auto: fewer NVLink bytes
    ep_tensor: Literal["auto", "rows", "weights"] = knob("auto")
    # under remat: keep each MoE layer's combined routed output (fp32, a tensor rank's tokens x
    # latent) so the recompute skips the exchange's return (memory for network bytes)
    ep_keep_results: bool = knob(False)
    # under remat: keep what each MoE layer's dispatch received (the rows at the experts in their
    # wire format, their expert ids and weights: capacity_factor x the expected rows) so the
    # recompute sends no rows; with ep_keep_results the recompute sends nothing
    ep_keep_received: bool = knob(False)
    # node-limited routing (DeepSeek-V3's M; K3 has none): each token's experts lie on at most
    # max_nodes_per_token of expert_nodes contiguous groups of experts (one group per node of the
    # mesh's expert axis). 0 = off
    max_nodes_per_token: int = 0
    expert_nodes: int = 0
    # expert matmuls (k3jax.ops.grouped_matmul): auto = tokamax's grouped-GEMM kernel on GPU
    # (the [gpu] extra), ragged_dot on TPU (native grouped GEMM), blocked elsewhere (XLA:GPU/CPU
    # expand ragged_dot to a dense dot over all experts)
    grouped_matmul: Literal["auto", "kernel", "ragged", "blocked"] = knob("auto")
    gmm_block: int = knob(512)  # rows per block of the blocked form (512: fastest on H200, BENCHMARKS.md)
    # the kernel form's weight gradient: k3jax's Pallas kernel reading the rows as they lie
    # (k3jax.ops.grouped_dw; 2x tokamax's with its transpose on an H200, and exact where tokamax's
    # ragged-contracting kernel was not: BENCHMARKS.md section 3), or tokamax's kernel
    gmm_weight_grad: Literal["tokamax", "pallas"] = knob("pallas")
    # the experts' GLU backward on the kernel path (k3jax.ops.glu_grad): xla = one XLA fusion reading
    # gate|up and dh once and writing d(gate|up) once (the default); pallas = one Pallas kernel doing
    # the same (the interpreter off a GPU); auto = that on GPU where it takes the shape. On an H200
    # k3-small's step took 523.9 ms with the kernel and 525.0 with the fusion, in one lease; the
    # fusion needs no copy of the saved gate|up out of the layer scan's stack (BENCHMARKS.md §4)
    glu_grad: Literal["auto", "pallas", "xla"] = knob("xla")

    def check(self) -> list[Problem]:
        out: list[Problem] = []
        if self.num_experts <= 0:
            out.append(("num_experts", f"must be positive, got {self.num_experts}"))
        if not 0 < self.top_k <= self.num_experts:
            out.append(("top_k", f"must be in 1..num_experts={self.num_experts}, got {self.top_k}"))
        elif self.balance == "quantile" and self.top_k >= self.num_experts:
            out.append(("top_k", "quantile balancing needs top_k < num_experts (it uses the (k+1)-th score)"))
        if self.expert_hidden <= 0:
            out.append(("expert_hidden", f"must be positive, got {self.expert_hidden}"))
        elif self.glu_grad == "pallas" and self.expert_hidden % 16:
            out.append(("glu_grad", f"pallas needs expert_hidden a multiple of 16 (the kernel's tile), "
                                    f"got {self.expert_hidden}"))
        if self.num_shared_experts < 0 or self.shared_hidden < 0 or self.latent_dim < 0:
            out.append(("num_shared_experts", "shared/latent sizes must be >= 0"))
        if self.qb_bins < 8:
            out.append(("qb_bins", f"must be >= 8, got {self.qb_bins}"))
        if self.qb_range <= 0:
            out.append(("qb_range", f"must be positive, got {self.qb_range}"))
        if not 0 < self.qb_update_rate <= 1:
            out.append(("qb_update_rate", f"must be in (0, 1], got {self.qb_update_rate}"))
        if self.gmm_block <= 0:
            out.append(("gmm_block", f"must be > 0, got {self.gmm_block}"))
        if self.ep_capacity_factor <= 0:
            out.append(("ep_capacity_factor", f"must be positive, got {self.ep_capacity_factor}"))
        if self.ep_chunks < 1:
            out.append(("ep_chunks", f"must be >= 1, got {self.ep_chunks}"))
        if self.ep_devices_per_node < 1:
            out.append(("ep_devices_per_node", f"must be >= 1, got {self.ep_devices_per_node}"))
        M, nodes = self.max_nodes_per_token, self.expert_nodes
        if M < 0 or nodes < 0:
            out.append(("max_nodes_per_token", "max_nodes_per_token and expert_nodes must be >= 0"))
        elif M > 0:
            if nodes <= 0 or self.num_experts % nodes:
                out.append(("expert_nodes", f"node-limited routing needs the {self.num_experts} experts split into "
                                            f"expert_nodes equal groups, got expert_nodes={nodes}"))
            elif M > nodes:
                out.append(("max_nodes_per_token", f"must be <= expert_nodes={nodes}, got {M}"))
            elif self.top_k > M * (self.num_experts // nodes):
                out.append(("max_nodes_per_token", f"{M} nodes of {self.num_experts // nodes} experts hold fewer "
                                                   f"than top_k={self.top_k}"))
        return out


@dataclass(frozen=True)
class ModelConfig:
    """The decoder: a layer pattern of mixers, FFN placement, widths and numerics."""

    vocab_size: int = 256
    d_model: int = 128
    # e.g. K3: "23*(kda,kda,kda,mla) + mla"; mixers: softmax, linear, deltanet,
    # gated_deltanet, kda, mla
    layer_pattern: str = "2*(kda,kda,kda,mla)"
    ffn_hidden: int = 256  # dense FFN width
    first_k_dense: int = 1  # layers [0, k) use the dense FFN
    moe_every: int = 1  # later layers use MoE when (layer - k) % moe_every == 0; 0 = never
    activation: Literal["situ", "swiglu"] = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: Optional[float] = 25.0  # null = identity up-branch
    attn_res_block_size: int = 4  # Block AttnRes; 0 = plain pre-norm residuals
    # AttnRes's depth mix (k3jax.ops.attnres_mix): auto = the fused Pallas kernels on a GPU, XLA
    # elsewhere; kernel = the kernels everywhere (off a GPU in the Pallas interpreter: tests)
    attn_res_impl: Literal["auto", "kernel", "xla"] = knob("auto")
    rms_norm_eps: float = 1e-5
    init_std: float = 0.02
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    # scan repeated layer units (compile time flat in depth); false: every layer unrolled. A knob:
    # the same parameters in another place, so a resume may change it (train/relayout.py moves
    # the checkpoint's state into the requested layout)
    scan_layers: bool = knob(True)
    # decoding and cached prefill (k3jax.ops.decode_kernels): auto = the Pallas kernels on a GPU
    # (MLA's latent attention, KDA's fused recurrent step), XLA elsewhere; pallas = the kernels
    # everywhere (off a GPU in the Pallas interpreter: tests); xla = the plain forms
    decode_impl: Literal["auto", "pallas", "xla"] = knob("auto")
    # with the decode kernels on, a decode step (one token per row) also runs the rest of each
    # layer as kernels: the projections (gemv), each AttnRes site with its norm, KDA's step from
    # its projections to the gated output, MLA's query and cache write and its merge and output,
    # the MoE's routing and experts, the residual adds (k3jax.layers.decode_gemv); false: only the
    # two kernels above, XLA for the rest (the path measured on 2026-12-01)
    decode_fused: bool = knob(True)
    # the fused step above for decode batches of at most this many rows; larger batches take the
    # plain step. One H200, k3-small, 1M tokens (BENCHMARKS.md §7, decode-batches-2026-12-06): fused
    # 10 % faster than plain at batch 24 and 17 % at 48 (the hybrid's largest), but 7 % slower at
    # batch 32 (not explained); 1.12-1.18x at batch 1. 64 covers every batch that fits at 1M
    decode_fused_max_batch: int = knob(64)
    remat: Literal["none", "full", "save_dots"] = knob("none")
    # quantization-aware training of the routed experts: mxfp4 fake-quantizes w1/w3/w2 to MXFP4
    # (E2M1 elements) and the inputs of their GEMMs to MXFP8 (E4M3), in blocks of 32 along each
    # GEMM's reduction axis with one power-of-two (E8M0) scale per block; gradients pass straight
    # through. Master weights stay in param_dtype. Everything else is unquantized.
    qat: Literal["none", "mxfp4"] = "none"
    # the block scale 2^s: ocp = OCP Microscaling v1.0, s = floor(log2 amax) - emax_elem (the
    # largest elements may saturate); ceil = s = ceil(log2(amax / max_elem)) (jax.nn.scaled_matmul,
    # qwix; nothing saturates). The released scale bytes depend on it.
    qat_scale_rule: Literal["ocp", "ceil"] = "ocp"
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def mixers(self) -> tuple[str, ...]:
        return parse_layer_pattern(self.layer_pattern)

    @property
    def num_layers(self) -> int:
        return len(self.mixers)

    def ffn_kind(self, layer: int) -> str:
        """'dense' or 'moe' for a 0-based layer index."""
        if layer < self.first_k_dense or self.moe_every == 0:
            return "dense"
        return "moe" if (layer - self.first_k_dense) % self.moe_every == 0 else "dense"

    def check(self) -> list[Problem]:
        out: list[Problem] = []
        try:
            mixers = self.mixers
        except ValueError as e:
            return [("layer_pattern", str(e))]
        for name in ("vocab_size", "d_model", "ffn_hidden"):
            if getattr(self, name) <= 0:
                out.append((name, f"must be positive, got {getattr(self, name)}"))
        if self.first_k_dense < 0 or self.moe_every < 0 or self.attn_res_block_size < 0:
            out.append(("first_k_dense", "first_k_dense, moe_every and attn_res_block_size must be >= 0"))
        if self.situ_beta <= 0 or (self.situ_linear_beta is not None and self.situ_linear_beta <= 0):
            out.append(("situ_beta", "SiTU betas must be positive"))
        if self.decode_fused_max_batch < 0:
            out.append(("decode_fused_max_batch", f"must be >= 0 (0: never fused), got {self.decode_fused_max_batch}"))
        used = set(mixers)
        linear = used & {"kda", "gated_deltanet", "deltanet", "linear"}
        sections = [("kda", self.kda, bool(linear)), ("mla", self.mla, "mla" in used),
                    ("attention", self.attention, "softmax" in used),
                    ("moe", self.moe, any(self.ffn_kind(i) == "moe" for i in range(len(mixers))))]
        for prefix, sub, active in sections:
            if active:
                out += [(f"{prefix}.{k}", m) for k, m in sub.check()]
        if "mla" in used and self.mla.qk_rope_head_dim == 0 and self.mla.use_rope:
            out.append(("mla.use_rope", "RoPE needs qk_rope_head_dim > 0"))
        for prefix, sub, active in (("kda", self.kda, bool(linear)), ("attention", self.attention, "softmax" in used)):
            if active and sub.head_dim == 0 and sub.num_heads > 0 and self.d_model % sub.num_heads:
                out.append((f"{prefix}.num_heads", f"num_heads={sub.num_heads} does not divide d_model={self.d_model} "
                            f"(head_dim is 0, i.e. derived as d_model / num_heads)"))
        if self.attn_res_block_size > len(mixers):
            out.append(("attn_res_block_size",
                        f"{self.attn_res_block_size} is larger than the model's {len(mixers)} layers"))
        if "moe" in {self.ffn_kind(i) for i in range(len(mixers))} and self.moe.latent_dim > self.d_model:
            out.append(("moe.latent_dim", f"latent_dim={self.moe.latent_dim} exceeds d_model={self.d_model}"))
        if not math.isfinite(self.init_std) or self.init_std <= 0:
            out.append(("init_std", "must be a positive finite number"))
        if self.qat == "mxfp4":
            if not any(self.ffn_kind(i) == "moe" for i in range(len(mixers))):
                out.append(("qat", "mxfp4 quantizes the routed experts, and this model has no MoE layer"))
            else:
                width = self.moe.latent_dim or self.d_model
                for key, n in (("moe.latent_dim" if self.moe.latent_dim else "d_model", width),
                               ("moe.expert_hidden", self.moe.expert_hidden)):
                    if n % 32:
                        out.append((key, f"qat=mxfp4 quantizes in blocks of 32 along the experts' reduction "
                                         f"axes (routed width and expert_hidden): {n} is not a multiple of 32"))
        return out

    def head_dim(self, section: str) -> int:
        """head_dim of the 'kda' or 'attention' section, with 0 meaning d_model / num_heads."""
        sub = getattr(self, section)
        return sub.head_dim or self.d_model // sub.num_heads


@dataclass(frozen=True)
class DataSourceConfig:
    """One source of a weighted mixture."""

    type: Literal["mqar", "text", "arrayrecord", "stdlib"] = "mqar"
    weight: float = 1.0
    paths: tuple[str, ...] = ()  # files or globs (text/jsonl/parquet, or .array_record shards)
    text_key: str = "text"  # field holding the text in JSONL/Parquet rows
    # MQAR: num_pairs key-value pairs, then queries; keys/values drawn from the vocab
    mqar_pairs: int = 8
    mqar_queries: int = 8
    # MQAR overwrite: this many of the pairs' keys are written again with a new value, and the
    # queries ask only those (the answer is the latest value); 0 = plain MQAR
    mqar_overwrites: int = 0
    # MQAR example length in tokens: the queries spread over a gap of filler tokens after the
    # writes (Zoology's layout); 0 = compact, 2 * (pairs + overwrites + queries)
    mqar_length: int = 0

    def check(self) -> list[Problem]:
        out: list[Problem] = []
        if self.weight <= 0:
            out.append(("weight", f"must be positive, got {self.weight}"))
        if self.type in ("text", "arrayrecord") and not self.paths:
            out.append(("paths", f"a '{self.type}' source needs at least one path"))
        if self.mqar_pairs <= 0 or self.mqar_queries <= 0:
            out.append(("mqar_pairs", "mqar_pairs and mqar_queries must be positive"))
        if not 0 <= self.mqar_overwrites <= self.mqar_pairs:
            out.append(("mqar_overwrites", f"must be in [0, mqar_pairs={self.mqar_pairs}], got {self.mqar_overwrites}"))
        if self.mqar_length < 0:
            out.append(("mqar_length", f"must be >= 0 (0 = compact), got {self.mqar_length}"))
        return out


@dataclass(frozen=True)
class DataConfig:
    sources: tuple[DataSourceConfig, ...] = (DataSourceConfig(),)
    tokenizer: str = "bytes"  # "bytes", a tokenizer.json, or a sentencepiece .model
    seq_len: int = 128
    eval_fraction: float = 0.02  # held-out share of documents
    seed: int = 0
    num_workers: int = 0  # grain worker processes; 0 = in-process
    # first-fit packing fills this many rows (at least the rows per batch) before emitting them:
    # more bins leave less padding but hold documents back longer
    packing_bins: int = 32
    # pieces (rows' worth of a document) are shuffled in windows of about this many tokens
    # (8 bytes each, per reader shard; at most ~one pass over the finite sources), so a batch
    # mixes documents instead of holding consecutive pieces of one; 0 = document order
    shuffle_window: int = 1 << 20
    # the global batch is assembled from this many independent reader shards, each host reading
    # num_shards / hosts of them: fixed, the data order does not depend on the host count
    # (resume on another topology sees the same batches); 0 = one shard per host
    num_shards: int = 0

    def check(self) -> list[Problem]:
        out: list[Problem] = []
        if not self.sources:
            out.append(("sources", "needs at least one source"))
        for i, s in enumerate(self.sources):
            out += [(f"sources.{i}.{k}", m) for k, m in s.check()]
        if self.seq_len <= 1:
            out.append(("seq_len", f"must be > 1, got {self.seq_len}"))
        if not 0 <= self.eval_fraction < 1:
            out.append(("eval_fraction", f"must be in [0, 1), got {self.eval_fraction}"))
        if self.num_workers < 0:
            out.append(("num_workers", f"must be >= 0, got {self.num_workers}"))
        if self.shuffle_window < 0:
            out.append(("shuffle_window", f"must be >= 0 (0 = off), got {self.shuffle_window}"))
        if self.packing_bins <= 0:
            out.append(("packing_bins", f"must be positive, got {self.packing_bins}"))
        if self.num_shards < 0:
            out.append(("num_shards", f"must be >= 0, got {self.num_shards}"))
        return out


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 20
    decay_fraction: float = 0.2  # WSD: share of the schedule spent decaying
    # the schedule's length in steps, warmup included; 0 = train.steps of the run's first launch.
    # A resumed run keeps the length its checkpoint was trained with, so raising train.steps
    # never moves the learning rate; to extend a run, set this (with WSD, while still in the
    # stable phase, the learning rate does not move and the decay starts later)
    decay_steps: int = 0
    # a resume that would change the learning rate of its next step is refused unless this is true
    allow_lr_change: bool = False
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global-norm clip; 0 disables it
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    # Per-Head Muon (name=muon): attention projections (MLA q_b/kv_b/g/o, KDA q/k/v/g/o) are
    # orthogonalised one head's slice at a time instead of as whole matrices
    muon_per_head: bool = False
    # Newton-Schulz in bf16 (matmuls accumulating in fp32), as Moonlight and Kimi K2 run it, or
    # float32 (optax.contrib.muon's numerics); see train/muon.py
    muon_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    # QK-Clip (MuonClip, Kimi K2): after each update, an MLA head whose largest scaled pre-softmax
    # logit in the step exceeded tau gets its q/k weights scaled so that logit would be tau
    # (train/qk_clip.py); 0 = off. K2 used 100; whether K3 keeps it is unconfirmed
    qk_clip_tau: float = 0.0

    def check(self) -> list[Problem]:
        out: list[Problem] = []
        if self.lr <= 0:
            out.append(("lr", f"must be positive, got {self.lr}"))
        if self.warmup_steps < 0:
            out.append(("warmup_steps", "must be >= 0"))
        if not 0 <= self.min_lr_ratio <= 1:
            out.append(("min_lr_ratio", "must be in [0, 1]"))
        if not 0 < self.decay_fraction <= 1:
            out.append(("decay_fraction", "must be in (0, 1]"))
        if self.decay_steps < 0:
            out.append(("decay_steps", f"must be >= 0 (0 = train.steps), got {self.decay_steps}"))
        if self.muon_per_head and self.name != "muon":
            out.append(("muon_per_head", f"applies to optimizer.name=muon, not {self.name!r}"))
        if self.grad_clip < 0 or self.weight_decay < 0:
            out.append(("grad_clip", "grad_clip and weight_decay must be >= 0"))
        if not self.qk_clip_tau >= 0 or math.isinf(self.qk_clip_tau):
            out.append(("qk_clip_tau", f"must be a finite number >= 0 (0 = off), got {self.qk_clip_tau}"))
        return out


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes; one may be -1 for 'the rest of the devices'."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    # context parallelism: every row's tokens split into `context` contiguous shards (long
    # sequences); data.seq_len / context must be a multiple of model.kda.chunk_size
    context: int = 1
    num_devices: int = 0  # use only the first N devices of a single-process run (0 = all)

    def check(self) -> list[Problem]:
        sizes = [self.data, self.fsdp, self.expert, self.context, self.tensor]
        out: list[Problem] = []
        if sum(s == -1 for s in sizes) > 1:
            out.append(("data", "at most one mesh axis may be -1"))
        if any(s == 0 or s < -1 for s in sizes):
            out.append(("data", f"mesh sizes must be positive or -1, got {sizes}"))
        if self.num_devices < 0:
            out.append(("num_devices", f"must be >= 0, got {self.num_devices}"))
        return out


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs (jax.distributed). Left empty, SLURM, Open MPI, Kubernetes and TPU pods
    are detected from the environment; set all three to launch processes by hand."""

    coordinator: str = ""  # host:port of process 0
    num_processes: int = 0
    process_id: int = -1
    initialize: Literal["auto", "always", "never"] = "auto"

    def check(self) -> list[Problem]:
        explicit = [bool(self.coordinator), self.num_processes > 0, self.process_id >= 0]
        if any(explicit) and not all(explicit):
            return [("coordinator", "set distributed.coordinator, num_processes and process_id together")]
        if all(explicit) and not self.process_id < self.num_processes:
            return [("process_id", f"must be < num_processes={self.num_processes}")]
        return []


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 50  # save every N steps
    keep_last: int = 3
    keep_every: int = 0  # also keep every K-th step forever; 0 = none
    async_save: bool = True

    def check(self) -> list[Problem]:
        if self.every <= 0 or self.keep_last <= 0 or self.keep_every < 0:
            return [("every", "every and keep_last must be positive, keep_every >= 0")]
        return []


@dataclass(frozen=True)
class LoggingConfig:
    # every=1 cost k3-small ~15 % of its tokens/s on an H100 (benchmarks/results/qb-steps-2026-12-06/)
    # when each line waited for its step with the device idle and counted the model's parameters
    # (~1 s) for MFU; since 2026-12-07 the count is made once and a window's last line is written
    # while the next step runs (train/cli.py). Not re-measured since.
    every: int = 10
    eval_every: int = 100
    eval_batches: int = 4  # the eval set: this many batches of held-out rows, drawn once, the same every eval
    tensorboard: bool = True
    progress: bool = True  # a redrawn bar on a terminal (plain lines elsewhere); false: plain lines always
    peak_tflops: float = 0.0  # per device, for MFU; 0 = guess from the backend
    # a MoE layer in which one expert takes more than half of the tokens at every step for this
    # many steps gets one warning line (train/balance_watch.py); 0 = no warning
    collapse_steps: int = 20

    def check(self) -> list[Problem]:
        if self.every <= 0 or self.eval_every < 0 or self.eval_batches <= 0:
            return [("every", "every and eval_batches must be positive, eval_every >= 0")]
        if self.collapse_steps < 0:
            return [("collapse_steps", f"must be >= 0 (0 = no warning), got {self.collapse_steps}")]
        return []


SCAN_OUTPUT_INITS = ("uninitialized", "zeros")  # train.scan_output_init (train/scan_outputs.py)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 8  # global rows per optimizer step
    micro_batches: int = 1  # gradient accumulation
    seed: int = 0
    z_loss: float = 0.0
    # the LM head and loss run in chunks of this many positions per row, so the [B,T,V] fp32
    # logits and their gradient never exist whole (k3jax.ops.chunked_loss); 0 = one piece
    loss_chunk: int = knob(1024)
    # JAX's persistent compilation cache, tokamax's tuned kernel configs in its tokamax/ folder
    # (train/compile_cache.py): "auto" = $JAX_COMPILATION_CACHE_DIR if set, else
    # ~/.cache/k3jax/jax (per user: every run of a program reuses it); "off"; or a directory
    compile_cache_dir: str = "auto"
    # on a GPU with tokamax: about how many seconds a launch may spend tuning tokamax's kernels
    # that have no config for this chip before it trains (train/kernel_tuning.py; a minute or two
    # per kernel on an H200, and one kernel's tuning cannot be interrupted), keeping the results
    # with the compilation cache for every later launch; the kernels left are tuned by the next
    # launches that set it. 0 = tune nothing: tokamax's heuristic configs (and any tuned earlier)
    autotune_budget_s: float = 0.0
    # how every scan in the step starts its stacked outputs (train/scan_outputs.py): "uninitialized"
    # (on one GPU or TPU an allocation with no fill kernel, the loop writing every slot; on more
    # than one device jax's zeros regardless, since XLA would allocate the unsharded stack on each)
    # or "zeros" (jax's own broadcast of zero, ~25 GB of fills a k3-small step on an H200).
    # Process-wide: set when the step is prepared, like the XLA flags
    scan_output_init: str = "uninitialized"  # one of SCAN_OUTPUT_INITS

    def check(self) -> list[Problem]:
        out: list[Problem] = []
        if self.scan_output_init not in SCAN_OUTPUT_INITS:
            out.append(("scan_output_init", f"must be one of {SCAN_OUTPUT_INITS}, got {self.scan_output_init!r}"))
        if self.loss_chunk < 0:
            out.append(("loss_chunk", f"must be >= 0 (0 = unchunked), got {self.loss_chunk}"))
        if self.autotune_budget_s < 0:
            out.append(("autotune_budget_s", f"must be >= 0 seconds (0 = tune nothing), got {self.autotune_budget_s}"))
        if self.steps <= 0 or self.batch_size <= 0 or self.micro_batches <= 0:
            out.append(("steps", "steps, batch_size and micro_batches must be positive"))
        elif self.batch_size % self.micro_batches:
            out.append(("micro_batches", f"batch_size={self.batch_size} is not divisible by {self.micro_batches}"))
        return out


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run_dir: str = "runs/default"

    def check(self) -> list[Problem]:
        out: list[Problem] = []
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if hasattr(sub, "check"):
                out += [(f"{f.name}.{k}", m) for k, m in sub.check()]
        return out + self._check_context()

    def _check_context(self) -> list[Problem]:
        """Context parallelism splits data.seq_len into mesh.context contiguous shards; the
        delta-rule layers run whole chunks per shard and the short convs take their halo from
        the upstream shard only."""
        C = self.mesh.context
        if C <= 1:
            return []
        T = self.data.seq_len
        if T % C:
            return [("mesh.context", f"mesh.context={C} does not divide data.seq_len={T}")]
        delta = any(m in ("kda", "gated_deltanet", "deltanet", "linear") for m in self.model.mixers)
        chunk = self.model.kda.chunk_size
        if delta and (T // C) % chunk:
            return [("mesh.context", (f"each context shard holds data.seq_len / mesh.context = {T // C} tokens, "
                                      f"not a multiple of model.kda.chunk_size={chunk}"))]
        if delta and T // C < self.model.kda.conv_size - 1:
            return [("mesh.context", (f"a context shard of {T // C} tokens is shorter than the short conv's "
                                      f"halo (model.kda.conv_size - 1 = {self.model.kda.conv_size - 1})"))]
        return []


def replace(cfg, **changes):
    """dataclasses.replace that also accepts dotted keys: replace(cfg, **{'model.d_model': 64})."""
    nested: dict[str, dict] = {}
    flat = {}
    for key, value in changes.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            flat[head] = value
    for head, sub in nested.items():
        flat[head] = replace(getattr(cfg, head), **sub)
    return dataclasses.replace(cfg, **flat)


__all__ = [
    "AttentionConfig", "CheckpointConfig", "Config", "DataConfig", "DistributedConfig", "DataSourceConfig", "KDAConfig",
    "LoggingConfig", "MeshConfig", "MLAConfig", "MIXERS", "ModelConfig", "MoEConfig", "OptimizerConfig",
    "TrainConfig", "replace",
]
