"""Expert parallelism: routed experts under `jax.shard_map` with all-to-all token exchange.

Called by the MoE layer on the *latent* activations z [N, l] (the down-projection already
happened, so only the latent width crosses the network: the point of LatentMoE) and the
router's choices, all sharded over the batch axes and context. Inside the shard_map each device
holds n = N / (data * fsdp * expert * context) tokens and E / expert experts:

1. the n*k (token, expert) pairs are sorted by expert; pairs for the experts of expert-shard s
   go to device s of the `expert` axis (all-to-all);
2. the receiver runs its local experts with grouped matmuls (`grouped_matmul`), tensor-parallel
   over the expert hidden width (a psum over `tensor` completes W2);
3. results return (in the compute dtype, like the rows that went out) by the inverse
   all-to-all and are combined with the routing weights in fp32.

Two exchanges:
- "capacity": `all_to_all` of fixed [expert, C, l] buffers, C = capacity_factor * n * k /
  expert; pairs beyond C are dropped and counted (the drop fraction is returned and logged).
  Works on every backend (XLA:CPU has no ragged all-to-all).
- "ragged": `ragged_all_to_all` of exactly the rows each device sends, into a receive buffer
  of capacity_factor * n * k rows (overflow is dropped and counted the same way). GPU/TPU.

Expert weights arrive FSDP-sharded on their latent axis and are all-gathered over `fsdp` and
`context` inside the region (their transpose, a reduce-scatter, shards the gradients again).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.layers.activations import apply_glu
from k3jax.layers.expert_pairs import combine_pairs, sort_pairs, unsort
from k3jax.ops.grouped_matmul import grouped_glu_mlp
from k3jax.ops.mx import ExpertQuant
from k3jax.sharding.mesh import BATCH_AXES, TOKEN_AXES


def _default_dispatch() -> str:
    from k3jax.ops.planning import target_backend

    return "ragged" if target_backend() in ("gpu", "cuda", "rocm", "tpu") else "capacity"


def routed_experts_sharded(z, topk_idx, topk_weight, w1, w3, w2, glu, compute_dtype, *, mesh,
                           capacity_factor: float = 2.0, dispatch: str = "auto", gmm: str = "auto",
                           gmm_block: int = 512, qat: ExpertQuant | None = None):
    """Same contract as `routed_experts_dropless` (-> u [N, l] fp32) plus the global fraction
    of (token, expert) pairs dropped for lack of capacity (0 when nothing overflowed).

    qat: each device fake-quantizes its experts' weights once (after the FSDP all-gather, before
    the grouped matmuls) and the rows it receives, as `grouped_glu_mlp` does. w2's reduction
    axis (the expert hidden width) is split over `tensor`, so its blocks must not straddle
    tensor shards: H / tensor must be a multiple of the block size."""
    dispatch = _default_dispatch() if dispatch == "auto" else dispatch
    X = mesh.shape["expert"]
    E = w1.shape[0]
    if E % X:
        raise ValueError(f"{E} experts do not split over mesh.expert={X}")
    n_global, k = topk_idx.shape
    # tokens [B*T] are split over the rows' axes and, inside a row, over context: each token
    # is routed by exactly one device. A call whose rows do not split over context (a decode
    # step, T = 1) keeps its tokens whole on every context shard (they compute the same).
    axes = TOKEN_AXES
    if n_global % math.prod(mesh.shape[a] for a in axes):
        axes = BATCH_AXES
    shards = math.prod(mesh.shape[a] for a in axes)
    if n_global % shards:
        raise ValueError(f"{n_global} tokens do not split over the {shards} data x fsdp x expert x context devices")
    n = n_global // shards
    T, H = mesh.shape["tensor"], w1.shape[-1]
    if qat is not None and (H % T or (H // T) % qat.block):
        raise ValueError(f"QAT blocks of {qat.block} along the expert hidden width need expert_hidden / mesh.tensor "
                         f"to be a multiple of {qat.block}: {H} / {T}")
    cap = max(1, math.ceil(capacity_factor * n * k / X))

    # the latent side of the weights is FSDP-sharded over fsdp and context (sharding/rules.py),
    # over the leading ones of those axes that divide it
    gather = [a for a in ("fsdp", "context") if mesh.shape.get(a, 1) > 1]
    while gather and w1.shape[1] % math.prod(mesh.shape[a] for a in gather):
        gather.pop()
    gather = tuple(gather) or None

    def local(z, idx, wts, w1, w3, w2):
        if gather:
            w1 = jax.lax.all_gather(w1, gather, axis=1, tiled=True)
            w3 = jax.lax.all_gather(w3, gather, axis=1, tiled=True)
            w2 = jax.lax.all_gather(w2, gather, axis=2, tiled=True)
        exchange = _exchange_ragged if dispatch == "ragged" else _exchange_capacity
        u, dropped = exchange(z, idx, wts, w1, w3, w2, glu, compute_dtype, X=X, cap=cap,
                              mlp=functools.partial(grouped_glu_mlp, impl=gmm, block=gmm_block, qat=qat))
        total = jax.lax.psum(jnp.asarray(idx.size, jnp.float32), axes)
        return u, jax.lax.psum(dropped, axes) / total

    fn = jax.shard_map(
        local, mesh=mesh,
        in_specs=(P(axes, None), P(axes, None), P(axes, None),
                  P("expert", gather, "tensor"), P("expert", gather, "tensor"), P("expert", "tensor", gather)),
        out_specs=(P(axes, None), P()), check_vma=False)
    return fn(z, topk_idx, topk_weight, w1, w3, w2)


def _experts(rows, local_expert, w1, w3, w2, glu, cd, mlp):
    """rows [R, l] with local expert ids [R] (>= E_loc marks an empty row) -> [R, l] fp32,
    summed over the tensor axis."""
    E_loc = w1.shape[0]
    order = jnp.argsort(local_expert, stable=True)
    sizes = jnp.bincount(local_expert, length=E_loc + 1)[:E_loc].astype(jnp.int32)  # empty rows: no group
    out = mlp(rows.astype(cd)[order], w1, w3, w2, sizes, functools.partial(apply_glu, glu), compute_dtype=cd)
    out = jax.lax.psum(out, "tensor")
    return unsort(out, order)


def _shard_slots(experts, X: int, E_loc: int):
    """experts [n*k] of the pairs sorted by expert (`sort_pairs`) -> (dest [n*k] each pair's
    expert shard, rank [n*k] its place among the pairs going to that shard, counts [X] pairs
    per shard, starts [X] each shard's first sorted pair)."""
    dest = experts // E_loc
    counts = jnp.bincount(dest, length=X)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(experts.size) - starts[dest]
    return dest, rank, counts, starts


def _exchange_capacity(z, idx, wts, w1, w3, w2, glu, cd, *, X: int, cap: int, mlp):
    l = z.shape[-1]
    E_loc = w1.shape[0]
    order, e_sorted, tokens = sort_pairs(idx)
    dest, rank, _, _ = _shard_slots(e_sorted, X, E_loc)
    keep = rank < cap
    slot = jnp.where(keep, rank, cap)  # cap = out of bounds: dropped by mode="drop"
    src_rows = z[tokens]
    send = jnp.zeros((X, cap, l), z.dtype).at[dest, slot].set(src_rows, mode="drop")
    send_e = jnp.full((X, cap), E_loc, jnp.int32).at[dest, slot].set(e_sorted % E_loc, mode="drop")
    recv = jax.lax.all_to_all(send, "expert", 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e, "expert", 0, 0, tiled=True)
    out = _experts(recv.reshape(X * cap, l), recv_e.reshape(-1), w1, w3, w2, glu, cd, mlp).astype(z.dtype)
    back = jax.lax.all_to_all(out.reshape(X, cap, l), "expert", 0, 0, tiled=True)
    per_pair = jnp.where(keep[:, None], back[dest, jnp.minimum(slot, cap - 1)], 0.0)
    return combine_pairs(per_pair, order, wts), jnp.sum(~keep).astype(jnp.float32)


def _exchange_ragged(z, idx, wts, w1, w3, w2, glu, cd, *, X: int, cap: int, mlp):
    """ragged_all_to_all: each device sends exactly its rows per destination; the receive
    buffer holds `cap * X` rows, and a source trims what a receiver cannot take."""
    n, k = idx.shape
    l = z.shape[-1]
    E_loc = w1.shape[0]
    R = cap * X  # receive rows: capacity_factor x the expected n*k
    order, e_sorted, tokens = sort_pairs(idx)
    dest, rank, counts, starts = _shard_slots(e_sorted, X, E_loc)
    # every receiver learns how many rows each source wants to send it, and grants a prefix
    want = jax.lax.all_to_all(counts.astype(jnp.int32), "expert", 0, 0, tiled=True)  # [X] from each source
    granted_in = jnp.minimum(want, jnp.maximum(R - (jnp.cumsum(want) - want), 0))
    recv_offsets = jnp.cumsum(granted_in) - granted_in
    # sources learn what was granted and where to write it
    granted_out = jax.lax.all_to_all(granted_in, "expert", 0, 0, tiled=True)
    out_offsets = jax.lax.all_to_all(recv_offsets.astype(jnp.int32), "expert", 0, 0, tiled=True)
    keep = rank < granted_out[dest]
    send = z[tokens]
    send_e = (e_sorted % E_loc).astype(jnp.int32)
    recv = ragged_all_to_all(send, jnp.zeros((R, l), z.dtype), starts.astype(jnp.int32),
                             granted_out.astype(jnp.int32), out_offsets, granted_in.astype(jnp.int32),
                             axis_name="expert")
    recv_e = ragged_all_to_all(send_e, jnp.full((R,), E_loc, jnp.int32), starts.astype(jnp.int32),
                               granted_out.astype(jnp.int32), out_offsets, granted_in.astype(jnp.int32),
                               axis_name="expert")
    out = _experts(recv, recv_e, w1, w3, w2, glu, cd, mlp).astype(z.dtype)
    # the reverse exchange: results go back to where the rows came from (source j wrote its
    # rows for us at its own offset starts_j[me], which it tells us)
    back_offsets = jax.lax.all_to_all(starts.astype(jnp.int32), "expert", 0, 0, tiled=True)
    back = ragged_all_to_all(out, jnp.zeros((n * k, l), out.dtype), recv_offsets.astype(jnp.int32),
                             granted_in.astype(jnp.int32), back_offsets, granted_out.astype(jnp.int32),
                             axis_name="expert")
    per_pair = jnp.where(keep[:, None], back, 0.0)
    return combine_pairs(per_pair, order, wts), jnp.sum(~keep).astype(jnp.float32)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all`, or on XLA:CPU (which lacks it) an all-gather emulation of
    its documented semantics, so the ragged dispatch logic is testable on CPU."""
    from k3jax.ops.planning import target_backend

    if target_backend() != "cpu":
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axis_name)
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)           # [X, M, ...]
    in_off = jax.lax.all_gather(input_offsets, axis_name)   # [X(src), X(dst)]
    sizes = jax.lax.all_gather(send_sizes, axis_name)
    out_off = jax.lax.all_gather(output_offsets, axis_name)
    rows = jnp.arange(operand.shape[0])
    for src in range(ops.shape[0]):
        count, start, dst = sizes[src, me], in_off[src, me], out_off[src, me]
        take = ops[src, jnp.clip(start + rows, 0, operand.shape[0] - 1)]
        where = jnp.where(rows < count, dst + rows, output.shape[0])  # out of bounds: dropped
        output = output.at[where].set(take, mode="drop")
    return output
