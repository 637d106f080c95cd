"""Analytic model FLOPs per token (for MFU): matmuls + KDA chunk + attention.

Forward FLOPs per token, times 3 for forward + backward (no remat recompute: MFU counts
model FLOPs, not hardware FLOPs):
- matmuls: 2 x active matmul parameters (routed experts at top_k / num_experts, lm_head
  included, the embedding lookup excluded);
- KDA / delta rule, per head, chunk C: the C x C score and UT blocks and the state
  products, (4CK + 2C(K+V) + 2CV + 6KV + C^2/3) per token (delta rule) or (2CK + 2CV + 4KV)
  for linear attention;
- softmax / MLA attention, causal over seq_len: 2 x (qk_dim + v_dim) x seq_len / 2 per head.

MFU (`mfu`) is these model FLOPs against the chip's dense bf16 spec (k3jax/chips.py, by the
device kind JAX reports): the one figure the CLI, the benchmarks and BENCHMARKS.md quote.

Packed documents: MFU's attention term is dense causal attention over seq_len, as if each row
were one document (the model-FLOPs convention, comparable across data and with peers). The
flash kernel does less when a row packs several documents: it skips the key blocks left of
each query block's earliest document start (k3jax/ops/flash_attention.py). So on packed data
MFU counts attention work not done, by at most the attention share of the FLOPs
(`attention_flops_share`) times the blocks skipped (1 - `attention_block_fraction`); k3-small
at 4,096 tokens is ~10 % attention. Where a figure should count only the work done (an
attention benchmark's TFLOP/s), scale the attention FLOPs by `attention_block_fraction` (the
blocks a block-skipping kernel computes) and keep the dense figure beside it, labelled
dense-equivalent (benchmarks/ops/attention.py does).
`matmul_flops_per_token` is the "6N" shortcut (6 x active matmul parameters, no mixer term),
for comparing with peers that quote it (fla); for an MoE it counts the active experts, never
the total.
"""

from __future__ import annotations

import numpy as np

from k3jax.model_sizes import abstract_model, param_counts

_NON_MATMUL = ("embedding", "norms", "attn_res")


def active_matmul_params(model_cfg, counts: dict[str, int] | None = None) -> float:
    counts = counts if counts is not None else param_counts(abstract_model(model_cfg))
    total = 0.0
    for k, v in counts.items():
        if k in _NON_MATMUL:
            continue
        if k == "routed_experts":
            v = v * model_cfg.moe.top_k / model_cfg.moe.num_experts
        total += v
    return total


def delta_rule_flops_per_token(chunk: int, k_dim: int, v_dim: int) -> float:
    """Forward FLOPs per token and head of the chunked delta rule (KDA, gated DeltaNet, DeltaNet):
    the C x C score and UT blocks and the state products, 4CK + 2C(K+V) + 2CV + 6KV + C^2/3."""
    C, K, V = chunk, k_dim, v_dim
    return 4 * C * K + 2 * C * (K + V) + 2 * C * V + 6 * K * V + C * C / 3


def mixer_flops_per_token(model_cfg, seq_len: int) -> float:
    """Forward FLOPs per token of the sequence mixing itself (outside the projections)."""
    total = 0.0
    C = model_cfg.kda.chunk_size
    for kind in model_cfg.mixers:
        if kind in ("kda", "gated_deltanet", "deltanet"):
            H, K = model_cfg.kda.num_heads, model_cfg.head_dim("kda")
            total += H * delta_rule_flops_per_token(C, K, K)
        elif kind == "linear":
            H, K = model_cfg.kda.num_heads, model_cfg.head_dim("kda")
            total += H * (2 * C * K + 2 * C * K + 4 * K * K)
        elif kind == "mla":
            m = model_cfg.mla
            total += m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * seq_len
        elif kind == "softmax":
            a = model_cfg.attention
            total += a.num_heads * 2 * model_cfg.head_dim("attention") * seq_len
    return total


def train_flops_per_token(model_cfg, seq_len: int, counts: dict[str, int] | None = None) -> float:
    """Model FLOPs per trained token (forward + backward)."""
    return 3 * (2 * active_matmul_params(model_cfg, counts) + mixer_flops_per_token(model_cfg, seq_len))


def matmul_flops_per_token(model_cfg, counts: dict[str, int] | None = None) -> float:
    """6 x active matmul parameters per trained token (routed experts at top_k / num_experts)."""
    return 6 * active_matmul_params(model_cfg, counts)


def mfu(model_cfg, seq_len: int, tokens_per_s: float, peak_tflops_per_device: float, devices: int = 1,
        counts: dict[str, int] | None = None) -> float:
    """Model FLOPs utilisation: train_flops_per_token x tokens/s over devices x the per-device peak.
    Without `counts` this builds the abstract model to count its parameters (about a second for
    k3-small unrolled): a caller that asks repeatedly computes `train_flops_per_token` once and
    uses `mfu_from_flops`."""
    return mfu_from_flops(train_flops_per_token(model_cfg, seq_len, counts), tokens_per_s, peak_tflops_per_device,
                          devices)


def mfu_from_flops(flops_per_token: float, tokens_per_s: float, peak_tflops_per_device: float,
                   devices: int = 1) -> float:
    """`mfu` given the model's `train_flops_per_token`."""
    return flops_per_token * tokens_per_s / (peak_tflops_per_device * 1e12 * devices)


def attention_flops_per_token(model_cfg, seq_len: int) -> float:
    """The softmax/MLA attention part of `mixer_flops_per_token` (forward, dense causal)."""
    total = 0.0
    for kind in model_cfg.mixers:
        if kind == "mla":
            m = model_cfg.mla
            total += m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * seq_len
        elif kind == "softmax":
            total += model_cfg.attention.num_heads * 2 * model_cfg.head_dim("attention") * seq_len
    return total


def attention_flops_share(model_cfg, seq_len: int, counts: dict[str, int] | None = None) -> float:
    """The fraction of `train_flops_per_token` that is softmax/MLA attention: what MFU can
    overstate by on packed documents (module docstring)."""
    return 3 * attention_flops_per_token(model_cfg, seq_len) / train_flops_per_token(model_cfg, seq_len, counts)


def attention_pair_fraction(doc_start) -> float:
    """Of the causal (query, key) pairs of rows [B,T] whose tokens start their documents at
    doc_start (`k3jax.segments.document_start`), the fraction within one document: the work
    attention needs, against dense causal attention (T (T + 1) / 2 pairs a row)."""
    doc_start = np.asarray(doc_start, np.int64)
    T = doc_start.shape[-1]
    t = np.arange(T)
    return float((t + 1 - doc_start).sum() / (doc_start.shape[0] * T * (T + 1) / 2))


def attention_block_fraction(doc_start, block_q: int, block_k: int) -> float:
    """Of the causal blocks (block_q queries x block_k keys) of rows [B,T], the fraction a
    kernel computes that skips the key blocks left of each query block's earliest document
    start and right of its last query (the flash kernel's rule): the work done, counted in
    whole blocks (a computed block's masked pairs are computed too)."""
    doc_start = np.asarray(doc_start, np.int64)
    B, T = doc_start.shape
    nq = -(-T // block_q)
    done = dense = 0
    for i in range(nq):
        lo, hi = i * block_q, min(T, (i + 1) * block_q)
        last = (hi - 1) // block_k  # the block of the last query's own key
        first = doc_start[:, lo:hi].min(axis=1) // block_k
        done += int((last - first + 1).sum())
        dense += B * (last + 1)
    return done / dense
