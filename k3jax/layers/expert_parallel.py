"""Expert parallelism: routed experts under `jax.shard_map`, tokens exchanged node-aware.

Called by the MoE layer on the *latent* activations z [N, l] (the down-projection already
happened, so only the latent width crosses the network: the point of LatentMoE) and the
router's choices. The expert axis X is factored into Xn nodes x G expert shards per node
(G = moe.ep_devices_per_node / (context * tensor), the devices of a node that are not tensor or
context ranks; `node_shards`). Inside the shard_map:

1. **Each tensor rank takes 1/t of the tokens** (the tokens are split over data x fsdp x expert
   x context x tensor), so no byte crosses the network twice for one tensor group.
2. **One row per (token, destination node)** (`ep_exchange.fan_out`): a token's experts on one
   node share a row carrying the token's latent and a table of at most W = 4 of its experts
   there with their routing weights. Hop 1 sends it over the network to the device with the
   same place in the destination node (peers: the devices of the `expert` axis with the same
   shard index inside their node).
3. Inside the node the row fans out (hop 2, NVLink) to the shards holding its experts, one
   copy per shard. The experts' hidden width is stored split over `tensor`; a tensor group
   either sends every row it received to all its ranks, each running its slice of the hidden
   width ("rows", Megatron's tensor-parallel experts: an all-gather of rows, NVLink), or each
   rank gathers its shard's experts whole and runs only its own rows ("weights"; `tensor_mode`
   picks the one moving fewer bytes, moe.ep_tensor).
4. The receiver expands rows into (row, expert) pairs, runs its experts with grouped matmuls
   (`grouped_glu_mlp`) and sums each row's pairs with their routing weights (fp32, fixed order).
   The results go back the way the rows came: summed over the tensor ranks ("rows"), over the
   node's shards, then over the token's nodes, in fp32 at every step.

What travels: with model.qat=mxfp4 (wire "auto") the token rows are sent as MXFP8 bytes
(`k3jax.ops.mx.mx_encode`: E4M3 codes plus E8M0 block scales, 1 + 1/32 bytes an element): the
very values the expert GEMM quantizes them to today, so the experts see the same bits and do not
quantize their input again. Otherwise, and for everything coming back (the experts' results and
every gradient), rows travel in the compute dtype: the combine stays bf16 because MXFP8
results would change what the model computes (QAT quantizes the GEMM inputs, not the outputs),
and gradients are not quantized anywhere in the step.

Remat (moe.ep_keep_received): under `model.remat` the backward pass runs the layer's forward
again, and with it the dispatch's collectives. With keep_received every collective output of
the dispatch (the rows at the experts, in their wire format, with their expert ids and routing
weights, and the ragged form's counts) is named `MOE_EXCHANGE_RECEIVED`, which the remat
policies save (k3jax/model.py): the recompute then rebuilds everything else from them locally
and sends nothing out. With moe.ep_keep_results too (the combined output kept) it sends nothing
back either: 4 passes of traffic a step instead of 6. The memory: per MoE layer and micro-batch
the receive buffers, capacity_factor x the expected rows (`kept_bytes`).

Overlap: the device's tokens are cut into `chunks` (moe.ep_chunks, default 2) that run the
whole exchange independently, so XLA's latency-hiding scheduler can run one chunk's transfers
under the other's expert GEMMs, and both under the shared experts (computed by the layer from
the same input; BENCHMARKS.md shows the compiled schedule).

Two forms of every hop (`ep_exchange.Hop`): "capacity" (`all_to_all` of fixed buffers; any
backend, the CPU default) and "ragged" (`ragged_all_to_all` of exactly the rows sent; GPU/TPU).
Buffers hold capacity_factor x the rows expected under uniform routing (`exchange_sizes`);
rows beyond them and pairs beyond the experts' buffer are dropped and counted (the returned
fraction of (token, expert) pairs).

Expert weights arrive FSDP-sharded on their latent axis and are all-gathered over `fsdp` and
`context` inside the region (and over `tensor` with "weights"), in the compute dtype: the values
the GEMMs use, quantized on the shard first under QAT when its blocks lie whole in it (else
gathered in fp32 and quantized after). Their gradients are reduce-scattered back in fp32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.layers.activations import apply_glu
from k3jax.layers.ep_exchange import (SLOTS_PER_ROW, Arrays, Hop, Peers, TensorGroup, fan_out, kept, linear,
                                      mesh_platform, rows_per_destination)
from k3jax.ops.grouped_matmul import grouped_glu_mlp
from k3jax.ops.mesh_axes import BATCH_AXES, CONTEXT, EXPERT, TENSOR, TOKEN_AXES
from k3jax.ops.mx import ExpertQuant, mx_decode, mx_encode

MOE_EXCHANGE_RECEIVED = "moe_exchange_received"  # what the dispatch received (moe.ep_keep_received)


def node_shards(expert: int, context: int, tensor: int, devices_per_node: int) -> int:
    """G: expert shards per node. The mesh's inner axes (context, tensor) fill a node first, so a
    node of `devices_per_node` devices holds devices_per_node / (context * tensor) consecutive
    expert shards (a divisor of `expert`; 1 when the inner axes fill the node or more)."""
    inner = context * tensor
    per = devices_per_node // inner if devices_per_node % inner == 0 else 1
    return math.gcd(expert, max(per, 1))


@dataclasses.dataclass(frozen=True)
class ExchangeSizes:
    """Static buffer sizes of one chunk's exchange (rows, per device)."""

    node_cap: int  # hop 1: rows a device may send to one node (0: one node, no hop)
    shard_cap: int  # hop 2: rows per shard of the node (0: one shard per node, no hop)
    rows: int  # rows at the experts after the tensor all-gather
    pairs: int  # (row, expert) pairs the grouped matmuls run


def exchange_sizes(tokens: int, top_k: int, num_experts: int, expert: int, shards_per_node: int, tensor: int,
                   capacity_factor: float, W: int = SLOTS_PER_ROW) -> ExchangeSizes:
    """Buffers for `tokens` tokens per device: capacity_factor x the expected rows (uniform
    routing: `rows_per_destination`), never more than can occur."""
    k, E, X, G = top_k, num_experts, expert, shards_per_node
    W = min(W, k)
    Xn, E_loc = X // G, E // X
    parents, K = tokens, k
    node_cap = shard_cap = 0
    if Xn > 1:
        most = tokens * math.ceil(min(k, E_loc * G) / W)
        node_cap = max(1, min(most, math.ceil(capacity_factor * tokens * rows_per_destination(E, E_loc * G, k, W))))
        parents, K = Xn * node_cap, W
    if G > 1:
        most = parents * math.ceil(min(K, E_loc) / W)
        expected = tokens * Xn * rows_per_destination(E, E_loc, k, W)
        shard_cap = max(1, min(most, math.ceil(capacity_factor * expected)))
        parents, K = G * shard_cap, W
    rows = tensor * parents
    pairs = max(1, min(rows * K, math.ceil(capacity_factor * tensor * tokens * k)))
    return ExchangeSizes(node_cap, shard_cap, rows, pairs)


def kept_bytes(sizes: ExchangeSizes, chunks: int, top_k: int, latent: int, wire_bytes: float) -> float:
    """Bytes one device keeps per call (one micro-batch) under moe.ep_keep_received: each chunk's
    receive buffer of sizes.rows rows (latent x wire_bytes each, the MXFP8 scales included) with
    its expert ids (int32) and routing weights (fp32), K = min(W, top_k) slots a row (the
    ragged form's counts are a few integers per peer: left out)."""
    K = min(SLOTS_PER_ROW, top_k)
    return chunks * sizes.rows * (latent * wire_bytes + 8 * K)


def routed_experts_sharded(z, topk_idx, topk_weight, w1, w3, w2, glu, compute_dtype, *, mesh,
                           capacity_factor: float = 2.0, dispatch: str = "auto", gmm: str = "auto",
                           gmm_block: int = 512, qat: ExpertQuant | None = None, wire: str = "auto",
                           devices_per_node: int = 8, chunks: int = 1, expert_nodes: int = 0, tensor: str = "auto",
                           keep_received: bool = False, weight_grad: str = "pallas", glu_grad: str = "xla"):
    """Same contract as `routed_experts_dropless` (-> u [N, l] fp32) plus the global fraction
    of (token, expert) pairs dropped for lack of capacity (0 when nothing overflowed).

    wire: "auto" sends the token rows as MXFP8 when qat is set, "compute" in the compute dtype.
    devices_per_node: devices sharing NVLink (`node_shards`). chunks: independent parts of each
    device's tokens (overlap). expert_nodes: with node-limited routing, the nodes the router
    assumed (must be the mesh's, Xn). tensor: how a tensor group shares its experts (`tensor_mode`;
    "auto" picks the one moving fewer bytes). keep_received: name what the dispatch's collectives
    deliver `MOE_EXCHANGE_RECEIVED` (module docstring: remat then keeps it). qat: each device
    fake-quantizes its experts' weights once (on its shard when the blocks lie whole in it, else
    after the gather); with tensor="rows" w2's reduction axis (the expert hidden width) is split
    over `tensor`, so H / tensor must be a multiple of the block size."""
    platform = mesh_platform(mesh)
    dispatch = ("ragged" if platform in ("gpu", "tpu") else "capacity") if dispatch == "auto" else dispatch
    if dispatch not in ("ragged", "capacity"):
        raise ValueError(f"moe.ep_dispatch must be auto, ragged or capacity, got {dispatch!r}")
    if wire not in ("auto", "compute"):
        raise ValueError(f"moe.ep_wire must be auto or compute, got {wire!r}")
    X, t, C = mesh.shape[EXPERT], mesh.shape[TENSOR], mesh.shape.get(CONTEXT, 1)
    E = w1.shape[0]
    if E % X:
        raise ValueError(f"{E} experts do not split over mesh.expert={X}")
    H = w1.shape[-1]
    G = node_shards(X, C, t, devices_per_node)
    if expert_nodes and expert_nodes != X // G:
        raise ValueError(f"node-limited routing assumes moe.expert_nodes={expert_nodes} nodes, but this mesh spreads "
                         f"the experts over {X // G} (mesh.expert={X}, {G} expert shard(s) per node of "
                         f"moe.ep_devices_per_node={devices_per_node})")
    n_global, k = topk_idx.shape
    # tokens [B*T] are split over the rows' axes and, inside a row, over context: each token is
    # routed by exactly one device. A call whose rows do not split over context (a decode step,
    # T = 1) keeps its tokens whole on every context shard (they compute the same).
    axes = TOKEN_AXES if n_global % math.prod(mesh.shape[a] for a in TOKEN_AXES) == 0 else BATCH_AXES
    shards = math.prod(mesh.shape[a] for a in axes)
    if n_global % shards:
        raise ValueError(f"{n_global} tokens do not split over the {shards} data x fsdp x expert x context devices")
    # each tensor rank takes 1/t of them; padding tokens (no expert) where t does not divide
    pad = (-n_global) % (shards * t)
    if pad:
        z = jnp.pad(z, ((0, pad), (0, 0)))
        topk_idx = jnp.pad(topk_idx, ((0, pad), (0, 0)), constant_values=-1)
        topk_weight = jnp.pad(topk_weight, ((0, pad), (0, 0)))
    n = (n_global + pad) // (shards * t)
    chunks = chunks if chunks > 1 and n % chunks == 0 else 1
    wire_quant = qat if (wire == "auto" and qat is not None) else None
    cd_bytes = jnp.dtype(compute_dtype).itemsize
    if tensor == "auto" and qat is not None and (H % t or (H // t) % qat.block):
        tensor = "weights"  # QAT's blocks along the hidden width would straddle the tensor shards
    if tensor == "auto":
        tensor = tensor_mode(n, k, E, X, G, t, z.shape[-1], H, cd_bytes, (1 + 1 / 32) if wire_quant else cd_bytes)
    if tensor not in ("rows", "weights"):
        raise ValueError(f"moe.ep_tensor must be auto, rows or weights, got {tensor!r}")
    rows_t = t if tensor == "rows" else 1  # the ranks that share each row (rows: the hidden width is split)
    if qat is not None and rows_t > 1 and (H % t or (H // t) % qat.block):
        raise ValueError(f"QAT blocks of {qat.block} along the expert hidden width need expert_hidden / mesh.tensor "
                         f"to be a multiple of {qat.block}: {H} / {t} (or moe.ep_tensor=weights)")
    sizes = exchange_sizes(n // chunks, k, E, X, G, rows_t, capacity_factor)
    plan = _Plan(X=X, G=G, t=rows_t, k=k, E=E, sizes=sizes, ragged=dispatch == "ragged",
                 emulate=dispatch == "ragged" and platform == "cpu", wire=wire_quant, compute_dtype=compute_dtype,
                 keep=MOE_EXCHANGE_RECEIVED if keep_received else None)

    # the latent side of the weights is FSDP-sharded over fsdp and context (k3jax/sharding/rules.py),
    # over the leading ones of those axes that divide it; with tensor="weights" the hidden side is
    # gathered over tensor too
    gather = [a for a in ("fsdp", CONTEXT) if mesh.shape.get(a, 1) > 1]
    while gather and w1.shape[1] % math.prod(mesh.shape[a] for a in gather):
        gather.pop()
    gather = tuple(gather) or None
    hidden_gather = TENSOR if rows_t == 1 and t > 1 else None
    shard_l = w1.shape[1] // math.prod(mesh.shape[a] for a in gather or ())
    # QAT on the shard (then the gather carries compute-dtype values) when its blocks lie whole in it
    quantize_first = qat is not None and shard_l % qat.block == 0 and H % t == 0 and (H // t) % qat.block == 0
    send = compute_dtype if qat is None or quantize_first else None  # None: fp32, quantized after
    mlp = functools.partial(grouped_glu_mlp, impl=gmm, block=gmm_block, qat=qat,
                            input_quantized=wire_quant is not None, weights_quantized=quantize_first,
                            weight_grad=weight_grad, glu_spec=glu, glu_grad=glu_grad)
    glu_fn = functools.partial(apply_glu, glu)
    wq = qat if quantize_first else None

    def local(z, idx, wts, w1, w3, w2):
        w1, w3 = (_gather_weight(w, gather, 1, hidden_gather, 2, wq, send) for w in (w1, w3))
        w2 = _gather_weight(w2, gather, 2, hidden_gather, 1, wq, send)
        u, kept = _pipeline(plan, z, idx, wts, w1, w3, w2, glu_fn, mlp, chunks)
        total = jax.lax.psum(jnp.sum(idx >= 0).astype(jnp.float32), axes + (TENSOR,))
        # tensor="rows": every rank of a tensor group ran the same pairs, count them once per group
        kept = jax.lax.psum(kept.astype(jnp.float32), axes + (() if rows_t > 1 else (TENSOR,)))
        return u, jnp.where(total > 0, (total - kept) / jnp.maximum(total, 1.0), 0.0)

    tokens = P(axes + (TENSOR,), None)
    fn = jax.shard_map(
        local, mesh=mesh,
        in_specs=(tokens, tokens, tokens,
                  P(EXPERT, gather, TENSOR), P(EXPERT, gather, TENSOR), P(EXPERT, TENSOR, gather)),
        out_specs=(tokens, P()), check_vma=False)
    u, dropped = fn(z, topk_idx, topk_weight, w1, w3, w2)
    return (u[:n_global] if pad else u), dropped


def tensor_mode(tokens: int, top_k: int, num_experts: int, expert: int, shards_per_node: int, tensor: int,
                latent: int, hidden: int, compute_bytes: int, wire_bytes: float) -> str:
    """How the `tensor` ranks of an expert shard share its experts, whichever moves fewer bytes
    over NVLink in one forward pass of `tokens` tokens per device (each rank's 1/t share):
    "rows": the experts' hidden width stays split over tensor, every row received goes to the
    t-1 other ranks and its results come back from them (Megatron's tensor-parallel experts);
    "weights": each rank gathers its shard's experts whole (as FSDP does over fsdp) and runs
    its own rows. The rows' cost grows with the tokens, the weights' with the calls (micro-batches)."""
    if tensor <= 1:
        return "rows"
    s = exchange_sizes(tokens, top_k, num_experts, expert, shards_per_node, 1, 1.0)
    rows = s.rows * (tensor - 1) * latent * (wire_bytes + compute_bytes)
    weights = (tensor - 1) / tensor * (num_experts // expert) * 3 * latent * hidden * compute_bytes
    return "weights" if weights <= rows else "rows"


def _gather_weight(w, latent_axes, latent_dim, hidden_axis, hidden_dim, qat, dtype):
    """An expert weight shard -> the whole of it on this device (gathered over latent_axes along
    latent_dim and hidden_axis along hidden_dim), quantized first on the shard when qat is given,
    sent in `dtype` (None: its own). The gradient is reduce-scattered back in fp32."""
    if qat is not None:
        w = qat.weight(w)  # fp32 values exact in the compute dtype; straight-through gradient
    send = w.dtype if dtype is None else dtype

    def gather(x):
        x = x.astype(send)
        if latent_axes:
            x = jax.lax.all_gather(x, latent_axes, axis=latent_dim, tiled=True)
        return jax.lax.all_gather(x, hidden_axis, axis=hidden_dim, tiled=True) if hidden_axis else x

    def scatter(ct):
        ct = ct.astype(jnp.float32)
        if hidden_axis:
            ct = jax.lax.psum_scatter(ct, hidden_axis, scatter_dimension=hidden_dim, tiled=True)
        return jax.lax.psum_scatter(ct, latent_axes, scatter_dimension=latent_dim, tiled=True) if latent_axes else ct

    return linear(gather, scatter)(w)


@dataclasses.dataclass(frozen=True)
class _Plan:
    X: int
    G: int
    t: int
    k: int
    E: int
    sizes: ExchangeSizes
    ragged: bool
    emulate: bool
    wire: ExpertQuant | None  # MXFP8 token rows
    compute_dtype: object
    keep: str | None = None  # the checkpoint name of what the dispatch receives (None: unnamed)

    def node_peers(self) -> Peers:
        """Hop 1: the devices of the expert axis with my place inside their node, one per node."""
        Xn, G = self.X // self.G, self.G
        groups = None if G == 1 else tuple(tuple(b * G + g for b in range(Xn)) for g in range(G))
        return Peers(EXPERT, Xn, groups, self.emulate)

    def shard_peers(self) -> Peers:
        """Hop 2: the expert shards of my node."""
        Xn, G = self.X // self.G, self.G
        groups = None if Xn == 1 else tuple(tuple(b * G + g for g in range(G)) for b in range(Xn))
        return Peers(EXPERT, G, groups, self.emulate)


def _pipeline(plan: _Plan, z, idx, wts, w1, w3, w2, glu_fn, mlp, chunks: int):
    """The chunks' exchanges as a software pipeline: chunk c+1's rows travel while chunk c's
    experts run, and chunk c's results travel back while chunk c+1's experts run. Each pair of
    stages meets at an optimization barrier, which keeps XLA from fusing the chunks' stages into
    one (that would wait for every chunk) and leaves the scheduler a collective and independent
    GEMMs to overlap. Returns (u [n, l] fp32, pairs computed here)."""
    m = z.shape[0] // chunks
    parts = [_Chunk(plan, z[c * m:(c + 1) * m], idx[c * m:(c + 1) * m], wts[c * m:(c + 1) * m]) for c in range(chunks)]
    def stage(name, c, fn, *args):  # named for profiles and the schedule (benchmarks/tools/a2a_schedule.py)
        with jax.named_scope(f"ep_{name}{c}"):
            return fn(*args)

    rows = stage("dispatch", 0, parts[0].dispatch)
    out = []
    for c, part in enumerate(parts):
        partial = stage("experts", c, part.experts, rows, w1, w3, w2, glu_fn, mlp)
        if c + 1 < chunks:  # the next chunk's rows arrive under these experts
            partial, rows = jax.lax.optimization_barrier((partial, stage("dispatch", c + 1, parts[c + 1].dispatch)))
        if out:  # the previous chunk's results return under these experts
            out[-1], partial = jax.lax.optimization_barrier((out[-1], partial))
        out.append(stage("combine", c, part.combine, partial))
    return jnp.concatenate(out) if chunks > 1 else out[0], sum(p.kept for p in parts)


class _Chunk:
    """One chunk's exchange in three stages: `dispatch` (the moves out, up to the experts'
    input rows), `experts` (grouped matmuls and each row's weighted sum), `combine` (the moves
    back). z [m, l], idx [m, k] (-1: none), wts [m, k]."""

    def __init__(self, plan: _Plan, z, idx, wts):
        self.plan, self.z, self.idx, self.wts = plan, z, idx, wts

    def dispatch(self):
        """-> (the pairs' rows [pairs, l] in the compute dtype, the rows' weights [R, K] fp32)."""
        plan, sz = self.plan, self.plan.sizes
        X, G, E = plan.X, plan.G, plan.E
        Xn, E_loc = X // G, E // X
        W = min(SLOTS_PER_ROW, plan.k)
        hops = []  # (hop, fan): the parent rows of each hop's candidates
        experts, weights = self.idx, self.wts.astype(jnp.float32)

        def move(experts, weights, peers, dest_of, cap):
            dest, ce, cw = fan_out(experts, weights, dest_of, peers.size, W)
            hop = Hop(peers, dest, cap, plan.ragged, plan.keep)
            hops.append((hop, experts.shape[1]))
            return (kept(hop.send(ce, fill=-1), plan.keep),
                    kept(linear(lambda x, h: h.send(x), lambda ct, h: h.back(ct), hop)(cw), plan.keep))

        if Xn > 1:  # over the network, once per destination node
            experts, weights = move(experts, weights, plan.node_peers(), lambda e: e // (E_loc * G), sz.node_cap)
        if G > 1:  # inside the node, once per destination shard
            experts, weights = move(experts, weights, plan.shard_peers(), lambda e: (e // E_loc) % G, sz.shard_cap)
        valid = hops[-1][0].received if plan.ragged and hops else None
        tg = TensorGroup(plan.t, experts.shape[0], valid, plan.emulate, plan.keep)
        experts = kept(tg.gather(experts, fill=-1), plan.keep)  # [R, K]
        weights = kept(linear(lambda x, g: g.gather(x), lambda ct, g: g.sum(ct), tg)(weights), plan.keep)
        R, K = experts.shape

        # (row, expert) pairs, sorted by local expert for the grouped matmuls; the first sz.pairs run
        local_e = experts - jax.lax.axis_index(EXPERT) * E_loc
        key = jnp.where(experts >= 0, local_e, E_loc).reshape(-1)
        order = jnp.argsort(key, stable=True)
        pairs = order[:sz.pairs]
        ends = jnp.minimum(jnp.cumsum(jnp.bincount(key, length=E_loc + 1)[:E_loc]), sz.pairs)
        self.group_sizes = (ends - jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])).astype(jnp.int32)
        inv = jnp.zeros_like(key).at[order].set(jnp.arange(key.size, dtype=key.dtype))
        self.slot_pair = jnp.where((key < E_loc) & (inv < sz.pairs), inv, sz.pairs).reshape(R, K)  # sz.pairs: none
        self.kept = jnp.sum(self.slot_pair < sz.pairs)
        self.hops, self.tg = tuple(hops), tg
        rows = _carry_rows(self.z, plan, self.hops, tg, pairs // K, key[pairs] < E_loc, self.slot_pair)
        return rows, weights

    def experts(self, rows_weights, w1, w3, w2, glu_fn, mlp):
        """-> each row's pairs' results, routing-weighted and summed in slot order [R, l] fp32."""
        rows, weights = rows_weights
        out = mlp(rows, w1, w3, w2, self.group_sizes, glu_fn, compute_dtype=self.plan.compute_dtype)  # [pairs, l]
        R, K = self.slot_pair.shape
        per_slot = jnp.take(out, self.slot_pair.reshape(-1), axis=0, mode="fill", fill_value=0).reshape(R, K, -1)
        return jnp.sum(weights[..., None] * per_slot, axis=1)

    def combine(self, partial):
        """[R, l] -> u [m, l] fp32: back the way the rows came, every wire in the compute dtype,
        every sum in fp32."""
        cd = self.plan.compute_dtype
        u = linear(lambda y, g: g.sum(y, jnp.float32), lambda ct, g: g.gather(ct.astype(cd)),
                   self.tg)(partial.astype(cd))
        for hop, fan in reversed(self.hops):
            u = linear(lambda y, h, fan=fan: h.back(y, fan, jnp.float32),
                       lambda ct, h, fan=fan: h.send(ct.astype(cd), fan), hop)(u.astype(cd))
        return u


def _carry_rows(z, plan: _Plan, hops, tg: TensorGroup, pair_row, pair_ok, slot_pair):
    """z [m, l] -> the rows of the experts' pairs [pairs, l] in the compute dtype, sent as MXFP8
    bytes when plan.wire is set (then already quantized as the GEMM would). One custom VJP over
    the whole way: the gradient returns in the compute dtype (straight through the quantizer).
    With plan.keep the rows travel outside it, off the gradient's path, and what arrives (the
    receive buffer, in the wire format) is named plan.keep; the custom VJP expands that buffer
    into pairs and sends the gradient back the same way."""
    cd = plan.compute_dtype
    fans = [fan for _, fan in hops]
    pairs = Arrays(row=pair_row, ok=pair_ok, slot=slot_pair)

    def send(z, tg, *hops):  # [m, l] -> the rows at the experts [R, l] (MXFP8 bytes: [R, l + l / 32])
        x = z.astype(cd)
        x = mx_encode(x, plan.wire.inputs, rule=plan.wire.rule, block=plan.wire.block) if plan.wire else x
        for hop, fan in zip(hops, fans):
            x = hop.send(x, fan)
        return tg.gather(x)

    def expand(x, pairs):  # [R, ...] -> [pairs, l] in the compute dtype
        x = jnp.where(pairs.a["ok"][:, None], x[pairs.a["row"]], jnp.zeros((), x.dtype))
        return mx_decode(x, cd, block=plan.wire.block) if plan.wire else x

    def transpose(ct, tg, pairs, *hops):  # [pairs, l] -> [m, l]; a row's pairs summed in slot order
        slot = pairs.a["slot"]
        R, K = slot.shape
        per_slot = jnp.take(ct, slot.reshape(-1), axis=0, mode="fill", fill_value=0).reshape(R, K, -1)
        g = jnp.sum(per_slot.astype(jnp.float32), axis=1).astype(cd)
        g = tg.sum(g, cd)
        for hop, fan in reversed(list(zip(hops, fans))):
            g = hop.back(g, fan, cd)
        return g

    if plan.keep is None:
        return linear(lambda z, tg, pairs, *hops: expand(send(z, tg, *hops), pairs), transpose,
                      tg, pairs, *(h for h, _ in hops))(z)
    received = kept(send(jax.lax.stop_gradient(z), tg, *(h for h, _ in hops)), plan.keep)
    pairs = Arrays(row=pair_row, ok=pair_ok, slot=slot_pair, received=received)
    return linear(lambda z, tg, pairs, *hops: expand(pairs.a["received"], pairs), transpose,
                  tg, pairs, *(h for h, _ in hops))(z)
