"""The expert-parallel exchange on a cluster's links: bytes and time per link, what hides it, what stays exposed.

A model of `k3jax.layers.expert_parallel` for k3jax-plan (`exchange_plan`), per MoE layer and
step, and of the exchange before each of its changes (`VARIANTS`, for BENCHMARKS.md's table:
`k3jax-plan --exchange-changes --config configs/k3.yaml --devices 2048 --mesh ...`). Also the
context-parallel all-gathers (`context_gather_bytes`).

Links (per GPU, per direction):
    nvlink   inside a node (H200, NVLink 4: 18 links x 25 GB/s = 450 GB/s)
    network  between nodes (one 400 Gb/s NIC per GPU: 50 GB/s)
    ici      a TPU slice's inter-chip interconnect (--ici-gbs; the whole expert axis is one "node")

Rows per token and MoE layer, one direction of one pass (routing uniform: a token's k experts are
a uniformly random set; `rows_per_destination`), with X = mesh.expert = Xn nodes x G shards per
node (`node_shards`), E_node = E / Xn, E_loc = E / X, W = 4 slots per row, t = mesh.tensor:

    network   (Xn - 1) x r(E_node)          one row per (token, remote node); r(g) = E[ceil(S/W)],
                                            S ~ hypergeometric(E, g, k) the token's experts there
    nvlink    X x r(E_loc) x (G-1)/G        inside the node, one row per (row, other shard)
            + X x r(E_loc) x (t-1)          every row to the t-1 other ranks of its tensor group

With moe.max_nodes_per_token = M the token's experts lie on M nodes (taken uniformly): Xn is
replaced by M in the sums, scaled by (Xn-1)/Xn for the remote share. Before the changes
(`VARIANTS`): every tensor rank sent every token (t x), one row per (token, expert) (k rows),
rows in the compute dtype, and the tensor group summed fp32 [rows, l] buffers of capacity_factor x
n x k rows with an all-reduce.

Bytes of a row: dispatch l x wire (MXFP8: 1 + 1/32 bytes an element under qat=mxfp4 with
moe.ep_wire=auto, else the compute dtype) + 8W (expert ids, fp32 weights); return l x c. The
backward sends the results' gradient out (l x c) and the rows' gradient back (l x c + 4W). Passes:
forward, the backward, and the forward again under remat (the recompute re-runs the exchange;
with moe.ep_keep_results only its dispatch, with moe.ep_keep_received only its return, with
both nothing: remat keeps what they would move, `kept_bytes_per_device`). With moe.ep_tensor=weights (auto picks it when it
moves fewer bytes) a tensor group's ranks gather their shard's experts over NVLink once per
micro-batch and pass (compute dtype; the gradient reduce-scattered in fp32) instead of sending
every row to each other.
The ragged form moves the rows sent; the capacity form whole buffers (capacity_factor x).

Time: a pass's exchange is serial within a chunk (hop 1, hop 2, tensor gather; back the same way)
and XLA keeps one collective in flight, so its time is the sum over links of bytes / bandwidth.
Overlap (moe.ep_chunks = C >= 2): chunk c+1's dispatch and chunk c-1's return run under chunk c's
expert GEMMs, the first dispatch and the last return under the shared experts:
    exposed = D/C + R/C - min(S, D/C + R/C) + max(0, D/C - Q/C) + (C-2) max(0, (D+R)/C - Q/C)
              + max(0, R/C - Q/C)
with D, R the pass's dispatch and return times, Q its routed-expert compute, S its shared-expert
compute (both at the peak FLOP rate: a lower bound on compute, so an upper bound on exposure).
With one chunk: exposed = max(0, D + R - S). Backward passes compute 2x the forward's FLOPs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.chips import CHIPS, DEFAULT_CHIP
from k3jax.layers.ep_exchange import SLOTS_PER_ROW, rows_per_destination
from k3jax.layers.expert_parallel import exchange_sizes, kept_bytes, node_shards, tensor_mode

NVLINK_GBS = 450.0  # H200 NVLink 4, per direction per GPU
NETWORK_GBS = 50.0  # 400 Gb/s per GPU
ICI_GBS = 100.0  # TPU: what one chip's all-to-all gets of its ICI (v5p: 4,800 Gb/s over 6 links); set per pod


@dataclasses.dataclass(frozen=True)
class Exchange:
    """Which of the exchange's changes are on (all: the code as it is)."""

    tensor_split: bool = True  # each tensor rank sends 1/t of the tokens
    mxfp8_wire: bool = True  # MXFP8 token rows when qat=mxfp4 and moe.ep_wire=auto
    node_rows: bool = True  # one row per (token, node), fanned out inside the node
    max_nodes: int | None = None  # None: the config's moe.max_nodes_per_token
    tensor: str | None = None  # None: the config's moe.ep_tensor
    keep_results: bool | None = None  # None: the config's moe.ep_keep_results
    keep_received: bool | None = None  # None: the config's moe.ep_keep_received


_RECOMPUTE_SENDS = dict(keep_results=False, keep_received=False)
VARIANTS = {  # BENCHMARKS.md's table, each change on top of the previous
    "before": Exchange(False, False, False, 0, **_RECOMPUTE_SENDS),
    "1. no tensor redundancy (tensor group: rows)": Exchange(True, False, False, 0, "rows", **_RECOMPUTE_SENDS),
    "1. no tensor redundancy (tensor group: auto)": Exchange(True, False, False, 0, **_RECOMPUTE_SENDS),
    "2. + MXFP8 token rows (qat=mxfp4)": Exchange(True, True, False, 0, **_RECOMPUTE_SENDS),
    "3. + one row per (token, node)": Exchange(True, True, True, 0, **_RECOMPUTE_SENDS),
    "4. + remat keeps the results (ep_keep_results)": Exchange(True, True, True, 0, keep_results=True,
                                                               keep_received=False),
    "5. + and the rows received (ep_keep_received)": Exchange(True, True, True, 0, keep_results=True,
                                                              keep_received=True),
    "optional: + moe.max_nodes_per_token=4": Exchange(True, True, True, 4, keep_results=True, keep_received=True),
}


def link_names(target: str) -> tuple[str, str]:
    return ("ici", "ici") if target == "tpu" else ("network", "nvlink")


def rows_per_token(moe, sizes: dict, exchange: Exchange, target: str = "gpu") -> dict[str, dict[str, float]]:
    """Row transfers per token per direction of one pass, by link and by hop:
    {"network"/"nvlink"/"ici": {hop: rows}}."""
    E, k = moe.num_experts, moe.top_k
    X, t, C = sizes["expert"], sizes["tensor"], sizes.get("context", 1)
    W = min(SLOTS_PER_ROW, k)
    far, near = link_names(target)
    G = X if target == "tpu" else node_shards(X, C, t, moe.ep_devices_per_node)
    Xn, E_loc = X // G, E // X
    senders = 1 if exchange.tensor_split else t  # each rank of a tensor group sends every token
    M = moe.max_nodes_per_token if exchange.max_nodes is None else exchange.max_nodes
    out: dict[str, dict[str, float]] = {far: {}, near: {}}
    if X <= 1:
        arriving = 1  # no expert parallelism: the tokens themselves (a row with all k slots)
    elif not exchange.node_rows:  # one row per (token, expert)
        out[far]["hop: pairs to other nodes"] = senders * k * (X - G) / X
        out[near]["hop: pairs to this node's other shards"] = senders * k * (G - 1) / X
        arriving = k
    else:
        if M and Xn > 1:  # M of the Xn nodes, uniformly: slots hypergeometric over their experts
            nodes, pool = M, M * E_loc * G
        else:
            nodes, pool = Xn, E
        per_node = rows_per_destination(pool, E_loc * G, k, W)
        per_shard = rows_per_destination(pool, E_loc, k, W)
        if Xn > 1:
            out[far]["hop 1: a row per (token, remote node)"] = senders * nodes * per_node * (Xn - 1) / Xn
        if G > 1:
            out[near]["hop 2: a row per (row, other shard of the node)"] = senders * nodes * G * per_shard * (G - 1) / G
        arriving = nodes * G * per_shard if G > 1 else nodes * per_node
    if t > 1 and exchange.tensor_split:  # rows at the experts go to every rank of the tensor group
        out[near]["tensor group: rows to the other ranks"] = arriving * (t - 1)
    return out


def exchange_plan(cfg, sizes: dict, tokens_per_device: int, *, target: str = "gpu", peak_tflops: float | None = None,
                  network_gbs: float = NETWORK_GBS, nvlink_gbs: float = NVLINK_GBS, ici_gbs: float = ICI_GBS,
                  step_compute_s: float = 0.0, moe_layers: int = 1, exchange: Exchange = Exchange()) -> dict:
    """Per MoE layer and step: bytes per token and per device on each link, seconds on each,
    the hidden and exposed time (module docstring). tokens_per_device: B_local * T / C, the
    tokens a (data, fsdp, expert, context) coordinate routes per step (its tensor ranks share them).
    step_compute_s: the step's compute per device (with the remat recompute); what is not the
    MoE layers' experts, spread over the moe_layers, is the compute the expert weights' gather
    over tensor (independent of the tokens) can run under. peak_tflops: the target's default
    chip's (k3jax.chips) unless given."""
    peak_tflops = peak_tflops or CHIPS[DEFAULT_CHIP[target if target in DEFAULT_CHIP else "gpu"]].peak_bf16_tflops
    mc = cfg.model
    moe = mc.moe
    l = moe.latent_dim or mc.d_model
    c = np.dtype(mc.compute_dtype).itemsize
    t, X = sizes["tensor"], sizes["expert"]
    k, E, H = moe.top_k, moe.num_experts, moe.expert_hidden
    W = min(SLOTS_PER_ROW, k)
    far, near = link_names(target)
    bw = {"network": network_gbs, "nvlink": nvlink_gbs, "ici": ici_gbs}
    mxfp8 = exchange.mxfp8_wire and mc.qat == "mxfp4" and moe.ep_wire == "auto"
    wire = l * (1 + 1 / 32) if mxfp8 else l * c
    meta = 8 * W if exchange.node_rows else 4  # expert ids + fp32 weights (before: the expert id)
    ragged = moe.ep_dispatch != "capacity" and target != "cpu"
    pad = moe.ep_capacity_factor if (not ragged and X > 1) else 1.0  # the capacity form moves whole buffers
    micro = cfg.train.micro_batches
    tokens = tokens_per_device / t  # each device's share of the bytes per token
    G = X if target == "tpu" else node_shards(X, sizes.get("context", 1), t, moe.ep_devices_per_node)
    mode = moe.ep_tensor if exchange.tensor is None else exchange.tensor
    keep = moe.ep_keep_results if exchange.keep_results is None else exchange.keep_results
    keep_in = moe.ep_keep_received if exchange.keep_received is None else exchange.keep_received
    remat = mc.remat != "none"
    if not exchange.tensor_split:
        mode = "rows"
    elif mode == "auto":  # as the layer decides it, per call (one micro-batch)
        n = max(1, tokens_per_device // micro // t)
        mode = tensor_mode(n, k, E, X, G, t, l, H, c, wire / l)
    rows = rows_per_token(moe, sizes, exchange, target)
    if mode == "weights":
        rows[near].pop("tensor group: rows to the other ranks", None)
    passes = {"forward": 1, "recompute (remat)": int(remat), "backward": 1}
    # bytes of one row on the wire, per pass: (dispatch direction, return direction); remat keeps
    # the combined output with moe.ep_keep_results (the recompute does not return) and what the
    # dispatch received with moe.ep_keep_received (the recompute does not dispatch)
    row_bytes = {"forward": (wire + meta, l * c),
                 "recompute (remat)": (0 if keep_in else wire + meta, 0 if keep else l * c),
                 "backward": (l * c + 4 * W, l * c)}  # (rows' gradient back, results' gradient out)
    # tensor="weights": the shard's experts gathered over tensor per call (compute dtype, or fp32
    # when QAT cannot quantize on the shard), their gradient reduce-scattered in fp32
    w_elems = (t - 1) / t * (E // max(X, 1)) * 3 * l * H if (mode == "weights" and t > 1) else 0.0
    w_bytes = {"forward": w_elems * c, "recompute (remat)": w_elems * c, "backward": w_elems * 4}
    per_device = {far: 0.0, near: 0.0}
    weights_device = 0.0
    pass_time = {}
    for name, n_pass in passes.items():
        if not n_pass:
            continue
        out_b, back_b = row_bytes[name]
        d = r = 0.0  # seconds of this pass's dispatch and return directions
        for link, hops in rows.items():
            for count in hops.values():
                b_out, b_back = tokens * count * out_b * pad, tokens * count * back_b * pad
                per_device[link] += b_out + b_back
                d += b_out / (bw[link] * 1e9)
                r += b_back / (bw[link] * 1e9)
        weights_device += micro * w_bytes[name]
        pass_time[name] = (d, r) if name != "backward" else (r, d)  # backward: results' gradient goes out first
    if not exchange.tensor_split and t > 1 and X > 1:  # before: fp32 all-reduce of the capacity buffers
        allreduce = 2 * (t - 1) * moe.ep_capacity_factor * k * l * 4  # per token, over the group's t ranks
        for name, (d, r) in pass_time.items():
            per_device[near] += tokens * allreduce
            pass_time[name] = (d, r + tokens * allreduce / (bw[near] * 1e9))

    # compute to hide under, per device and pass (peak FLOP rate)
    shared_hidden = moe.shared_hidden or moe.num_shared_experts * moe.expert_hidden
    peak = peak_tflops * 1e12
    routed_fwd = tokens_per_device * k * 6 * l * H / t / peak
    shared_fwd = tokens_per_device * 6 * mc.d_model * shared_hidden / t / peak
    chunks = moe.ep_chunks
    hidden = {"routed experts of the other chunk": 0.0, "shared experts": 0.0}
    exposed = 0.0
    per_pass = {}
    share = sum((2.0 if name == "backward" else 1.0) for name in pass_time)
    other_compute_s = max(0.0, step_compute_s / moe_layers - share * (routed_fwd + shared_fwd))
    if mode == "weights" and t > 1:
        hidden["the layer's other compute (mixer)"] = 0.0
    for name, (d, r) in pass_time.items():
        f = 2.0 if name == "backward" else 1.0
        q, s = routed_fwd * f, shared_fwd * f
        e = pipeline_exposed(d, r, q, s, chunks)
        under_shared = min(s, (d + r) / chunks if chunks > 1 else d + r)
        hidden["shared experts"] += under_shared
        hidden["routed experts of the other chunk"] += d + r - e - under_shared
        w = micro * w_bytes[name] / (bw[near] * 1e9)
        if w:  # the weights do not wait for the tokens: prefetched under the layer's other compute
            under_mixer = min(w, other_compute_s * f / share)
            hidden["the layer's other compute (mixer)"] += under_mixer
            e += w - under_mixer
        exposed += e
        per_pass[name] = {"dispatch_s": d, "return_s": r, "expert_weights_s": w, "routed_compute_s": q,
                          "shared_compute_s": s, "exposed_s": e}
    # what remat keeps instead (one micro-batch's, every MoE layer's at once): the combined
    # output (fp32, a tensor rank's tokens) and the dispatch's receive buffers (the layer's sizes)
    n_call = max(1, tokens_per_device // micro // t)
    call_chunks = chunks if (chunks > 1 and n_call % chunks == 0 and target != "cpu" and X > 1) else 1
    kept = {"results": n_call * l * 4 if (remat and keep) else 0.0, "received": 0.0}
    if remat and keep_in and X > 1 and exchange.node_rows:
        rows_t = t if mode == "rows" else 1
        sizes_call = exchange_sizes(n_call // call_chunks, k, E, X, G, rows_t, moe.ep_capacity_factor)
        kept["received"] = kept_bytes(sizes_call, call_chunks, k, l, wire / l)
    seconds = {link: b / (bw[link] * 1e9) for link, b in per_device.items()}
    return {
        "links_gbs": {far: bw[far], near: bw[near]},
        "shards_per_node": G,
        "tensor": mode if t > 1 else "-",
        "wire": "mxfp8" if mxfp8 else str(np.dtype(mc.compute_dtype)),
        "rows_per_token": rows,
        "bytes_per_token": {link: b / tokens for link, b in per_device.items()},
        "bytes_per_device": per_device,
        "seconds": seconds,
        "seconds_total": sum(seconds.values()),
        "expert_weights_bytes_per_device": {near: weights_device},
        "expert_weights_seconds": weights_device / (bw[near] * 1e9),
        "passes": per_pass,
        "hidden_seconds": hidden,
        "exposed_seconds": exposed,
        "kept_bytes_per_device": kept,  # per MoE layer: remat holds every layer's for one micro-batch
    }


def pipeline_exposed(d: float, r: float, q: float, s: float, chunks: int) -> float:
    """A pass's exchange left exposed (module docstring): dispatch d and return r seconds, routed
    expert compute q, shared expert compute s."""
    if chunks <= 1:
        return max(0.0, d + r - s)
    C = chunks
    ends = d / C + r / C
    return (ends - min(s, ends) + max(0.0, d / C - q / C) + (C - 2) * max(0.0, (d + r) / C - q / C)
            + max(0.0, r / C - q / C))


def changes_table(cfg, sizes: dict, tokens_per_device: int, moe_layers: int, **kw) -> list[dict]:
    """Each of VARIANTS: bytes per token per MoE layer on each link, and the step's seconds."""
    out = []
    for name, ex in VARIANTS.items():
        r = exchange_plan(cfg, sizes, tokens_per_device, exchange=ex, moe_layers=moe_layers, **kw)
        tokens = tokens_per_device / sizes["tensor"]
        out.append({"change": name, "tensor": r["tensor"], "bytes_per_token": r["bytes_per_token"],
                    "expert_weights_bytes_per_token": sum(r["expert_weights_bytes_per_device"].values()) / tokens,
                    "seconds_per_step": {k: v * moe_layers for k, v in r["seconds"].items()},
                    "expert_weights_seconds_per_step": r["expert_weights_seconds"] * moe_layers,
                    "exposed_seconds_per_step": r["exposed_seconds"] * moe_layers,
                    "kept_bytes_per_device": sum(r["kept_bytes_per_device"].values()) * moe_layers})
    return out


def context_gather_bytes(mc, sizes: dict[str, int], B_local: int, T: int) -> dict[str, float]:
    """Bytes one device receives over `context` per layer per step (k3jax/layers/context_parallel.py),
    by mixer kind present in the model; rounds = 2 (forward gather, backward reduce-scatter of
    its gradient), 3 with remat (the forward again):
      delta-rule layers: the other C-1 shards' state summaries (M [K,K], h [K,V]) in fp32,
          B_local * H/t * K * (K+V) * 4 * (C-1), plus the short convs' halos (3 * (W-1) inputs);
      mla: the latent and rope key of the row's other tokens, B_local * T * (R_kv+r) * c * (C-1)/C;
      softmax: its keys and values, B_local * T * 2 * Hkv/t * D * c * (C-1)/C."""
    C, t = sizes.get("context", 1), sizes["tensor"]
    if C <= 1:
        return {}
    c = np.dtype(mc.compute_dtype).itemsize
    rounds = 2 + (mc.remat != "none")
    def split(x):
        return x // t if x % t == 0 else x

    out = {}
    kinds = set(mc.mixers)
    if kinds & {"kda", "gated_deltanet", "deltanet", "linear"}:
        K = mc.head_dim("kda")
        H = split(mc.kda.num_heads)
        halo = 3 * max(mc.kda.conv_size - 1, 0) * H * K * c
        out["delta_rule_layer"] = rounds * B_local * (H * K * 2 * K * 4 * (C - 1) + halo)
    if "mla" in kinds:
        m = mc.mla
        out["mla_layer"] = rounds * B_local * T * (m.kv_lora_rank + m.qk_rope_head_dim) * c * (C - 1) / C
    if "softmax" in kinds:
        a = mc.attention
        out["softmax_layer"] = rounds * B_local * T * 2 * split(a.num_kv_heads or a.num_heads) * \
            mc.head_dim("attention") * c * (C - 1) / C
    return out
