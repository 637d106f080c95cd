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
   copy per shard, then to every rank of the shard's tensor group (all-gather, NVLink), since
   the experts' hidden width is split over `tensor`.
4. The receiver expands rows into (row, expert) pairs, runs its experts with grouped matmuls
   (`grouped_glu_mlp`, the hidden width split over `tensor`) and sums each row's pairs with
   their routing weights (fp32, fixed order). The results go back the way the rows came: summed
   over the tensor ranks, over the node's shards, then over the token's nodes, in fp32 at every
   step.

What travels: with model.qat=mxfp4 (wire "auto") the token rows are sent as MXFP8 bytes
(`k3jax.ops.mx.mx_encode`: E4M3 codes plus E8M0 block scales, 1 + 1/32 bytes an element): the
very values the expert GEMM quantizes them to today, so the experts see the same bits and do not
quantize their input again. Otherwise, and for everything coming back (the experts' results and
every gradient), rows travel in the compute dtype: the combine stays bf16 because MXFP8
results would change what the model computes (QAT quantizes the GEMM inputs, not the outputs),
and gradients are not quantized anywhere in the step.

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
`context` inside the region (their transpose, a reduce-scatter, shards the gradients again).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.layers.activations import apply_glu
from k3jax.layers.ep_exchange import (SLOTS_PER_ROW, Arrays, Hop, Peers, TensorGroup, fan_out, linear,
                                      mesh_platform, rows_per_destination)
from k3jax.ops.grouped_matmul import grouped_glu_mlp
from k3jax.ops.mesh_axes import BATCH_AXES, CONTEXT, EXPERT, TENSOR, TOKEN_AXES
from k3jax.ops.mx import ExpertQuant, mx_decode, mx_encode


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


def routed_experts_sharded(z, topk_idx, topk_weight, w1, w3, w2, glu, compute_dtype, *, mesh,
                           capacity_factor: float = 2.0, dispatch: str = "auto", gmm: str = "auto",
                           gmm_block: int = 512, qat: ExpertQuant | None = None, wire: str = "auto",
                           devices_per_node: int = 8, chunks: int = 2, expert_nodes: int = 0):
    """Same contract as `routed_experts_dropless` (-> u [N, l] fp32) plus the global fraction
    of (token, expert) pairs dropped for lack of capacity (0 when nothing overflowed).

    wire: "auto" sends the token rows as MXFP8 when qat is set, "compute" in the compute dtype.
    devices_per_node: devices sharing NVLink (`node_shards`). chunks: independent parts of each
    device's tokens (overlap). expert_nodes: with node-limited routing, the nodes the router
    assumed (must be the mesh's, Xn). qat: each device fake-quantizes its experts' weights once
    (after the FSDP all-gather, before the grouped matmuls); w2's reduction axis (the expert
    hidden width) is split over `tensor`, so H / tensor must be a multiple of the block size."""
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
    if qat is not None and (H % t or (H // t) % qat.block):
        raise ValueError(f"QAT blocks of {qat.block} along the expert hidden width need expert_hidden / mesh.tensor "
                         f"to be a multiple of {qat.block}: {H} / {t}")
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
    sizes = exchange_sizes(n // chunks, k, E, X, G, t, capacity_factor)
    plan = _Plan(X=X, G=G, t=t, k=k, E=E, sizes=sizes, ragged=dispatch == "ragged",
                 emulate=dispatch == "ragged" and platform == "cpu",
                 wire=qat if (wire == "auto" and qat is not None) else None, compute_dtype=compute_dtype)
    mlp = functools.partial(grouped_glu_mlp, impl=gmm, block=gmm_block, qat=qat,
                            input_quantized=plan.wire is not None)

    # the latent side of the weights is FSDP-sharded over fsdp and context (sharding/rules.py),
    # over the leading ones of those axes that divide it
    gather = [a for a in ("fsdp", CONTEXT) if mesh.shape.get(a, 1) > 1]
    while gather and w1.shape[1] % math.prod(mesh.shape[a] for a in gather):
        gather.pop()
    gather = tuple(gather) or None
    glu_fn = functools.partial(apply_glu, glu)

    def local(z, idx, wts, w1, w3, w2):
        if gather:
            w1 = jax.lax.all_gather(w1, gather, axis=1, tiled=True)
            w3 = jax.lax.all_gather(w3, gather, axis=1, tiled=True)
            w2 = jax.lax.all_gather(w2, gather, axis=2, tiled=True)
        m = n // chunks
        parts = [_exchange(plan, z[c * m:(c + 1) * m], idx[c * m:(c + 1) * m], wts[c * m:(c + 1) * m],
                           w1, w3, w2, glu_fn, mlp) for c in range(chunks)]
        u = jnp.concatenate([p[0] for p in parts]) if chunks > 1 else parts[0][0]
        kept = sum(p[1] for p in parts)
        # every rank of a tensor group ran the same pairs: count them once per group
        total = jax.lax.psum(jnp.sum(idx >= 0).astype(jnp.float32), axes + (TENSOR,))
        kept = jax.lax.psum(kept.astype(jnp.float32), axes)
        return u, jnp.where(total > 0, (total - kept) / jnp.maximum(total, 1.0), 0.0)

    tokens = P(axes + (TENSOR,), None)
    fn = jax.shard_map(
        local, mesh=mesh,
        in_specs=(tokens, tokens, tokens,
                  P(EXPERT, gather, TENSOR), P(EXPERT, gather, TENSOR), P(EXPERT, TENSOR, gather)),
        out_specs=(tokens, P()), check_vma=False)
    u, dropped = fn(z, topk_idx, topk_weight, w1, w3, w2)
    return (u[:n_global] if pad else u), dropped


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


def _exchange(plan: _Plan, z, idx, wts, w1, w3, w2, glu_fn, mlp):
    """One chunk: z [m, l], idx [m, k] (-1: none), wts [m, k] -> (u [m, l] fp32, pairs computed here)."""
    cd = plan.compute_dtype
    X, G, E = plan.X, plan.G, plan.E
    Xn, E_loc = X // G, E // X
    W = min(SLOTS_PER_ROW, plan.k)
    sz = plan.sizes
    hops = []  # (hop, fan): the parent rows of each hop's candidates
    experts, weights = idx, wts.astype(jnp.float32)

    def move(experts, weights, peers, dest_of, cap):
        dest, ce, cw = fan_out(experts, weights, dest_of, peers.size, W)
        hop = Hop(peers, dest, cap, plan.ragged)
        hops.append((hop, experts.shape[1]))
        return hop.send(ce, fill=-1), linear(lambda x, h: h.send(x), lambda ct, h: h.back(ct), hop)(cw)

    if Xn > 1:  # over the network, once per destination node
        experts, weights = move(experts, weights, plan.node_peers(), lambda e: e // (E_loc * G), sz.node_cap)
    if G > 1:  # inside the node, once per destination shard
        experts, weights = move(experts, weights, plan.shard_peers(), lambda e: (e // E_loc) % G, sz.shard_cap)
    valid = hops[-1][0].received if plan.ragged and hops else None
    tg = TensorGroup(plan.t, experts.shape[0], valid, plan.emulate)
    experts = tg.gather(experts, fill=-1)  # [R, K]
    weights = linear(lambda x, g: g.gather(x), lambda ct, g: g.sum(ct), tg)(weights)
    R, K = experts.shape

    # (row, expert) pairs, sorted by local expert for the grouped matmuls; the first sz.pairs run
    local_e = experts - jax.lax.axis_index(EXPERT) * E_loc
    key = jnp.where(experts >= 0, local_e, E_loc).reshape(-1)
    order = jnp.argsort(key, stable=True)
    pairs = order[:sz.pairs]
    pair_row, pair_ok = pairs // K, key[pairs] < E_loc
    ends = jnp.minimum(jnp.cumsum(jnp.bincount(key, length=E_loc + 1)[:E_loc]), sz.pairs)
    group_sizes = (ends - jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])).astype(jnp.int32)
    inv = jnp.zeros_like(key).at[order].set(jnp.arange(key.size, dtype=key.dtype))
    slot_pair = jnp.where((key < E_loc) & (inv < sz.pairs), inv, sz.pairs).reshape(R, K)  # sz.pairs: none

    rows = _carry_rows(z, plan, tuple(hops), tg, pair_row, pair_ok, slot_pair)
    out = mlp(rows, w1, w3, w2, group_sizes, glu_fn, compute_dtype=cd)  # [pairs, l] fp32
    # each row's pairs, weighted, summed in slot order (fp32)
    per_slot = jnp.take(out, slot_pair.reshape(-1), axis=0, mode="fill", fill_value=0).reshape(R, K, -1)
    partial = jnp.sum(weights[..., None] * per_slot, axis=1)

    # back the way the rows came, every wire in the compute dtype, every sum in fp32
    u = linear(lambda y, g: g.sum(y, jnp.float32), lambda ct, g: g.gather(ct.astype(cd)), tg)(partial.astype(cd))
    for hop, fan in reversed(hops):
        u = linear(lambda y, h, fan=fan: h.back(y, fan, jnp.float32),
                   lambda ct, h, fan=fan: h.send(ct.astype(cd), fan), hop)(u.astype(cd))
    return u, jnp.sum(slot_pair < sz.pairs)


def _carry_rows(z, plan: _Plan, hops, tg: TensorGroup, pair_row, pair_ok, slot_pair):
    """z [m, l] -> the rows of the experts' pairs [pairs, l] in the compute dtype, sent as MXFP8
    bytes when plan.wire is set (then already quantized as the GEMM would). One custom VJP over
    the whole way: the gradient returns in the compute dtype (straight through the quantizer)."""
    cd = plan.compute_dtype
    fans = [fan for _, fan in hops]
    pairs = Arrays(row=pair_row, ok=pair_ok, slot=slot_pair)

    def forward(z, tg, pairs, *hops):
        x = z.astype(cd)
        x = mx_encode(x, plan.wire.inputs, rule=plan.wire.rule, block=plan.wire.block) if plan.wire else x
        for hop, fan in zip(hops, fans):
            x = hop.send(x, fan)
        x = tg.gather(x)
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

    return linear(forward, transpose, tg, pairs, *(h for h, _ in hops))(z)
