"""Muon's Newton-Schulz on a device mesh: every matrix orthogonalised once, by one device.

Newton-Schulz needs whole matrices; FSDP and tensor parallelism split the parameters (and so
the momenta) along their matrix dimensions, and some parameters are replicated over mesh axes
(`tensor` for the LoRA-side kernels, `data` for all). Left to itself, XLA gathers each matrix
whole on every device that holds a piece of it (K3's expert w1 on 2,048 H200s: 217 GB per
device), and every replica repeats the work. Here (ZeRO-1 style, as Moonlight's distributed
Muon), per device inside one `jax.shard_map`:

1. **Buckets.** Each leaf's local pieces are brought to [b, *piece] (its matrices' batch axes
   flattened, then the row dims, then the column dims; a tall matrix is turned wide, since
   Newton-Schulz of X^T is the transpose of Newton-Schulz of X), and the leaves whose pieces
   have the same shape and are split over the same mesh axes in the same way are concatenated
   (K3's w1, w2, w3 of all 92 MoE layers are one bucket; the per-head q, k, v, g of all KDA
   layers another): fewer, fuller exchanges, and one padding per bucket instead of per leaf.
2. **Replicas.** Mesh axes the leaf is not split over hold identical copies: each replica
   takes 1/R of the bucket's matrices (R = the product of those axes), and an all-gather over
   them at the end gives every replica every result. No matrix is orthogonalised twice.
3. **Exchange.** All-to-alls over the mesh axes that split the matrix dimensions (G devices
   in all) split the batch and concatenate each matrix dimension (an axis's minor mesh axis
   first, so the concatenation is in global order), so each device then holds whole matrices:
   ceil(b / (R G)) of them. The batch is padded with zero matrices (Newton-Schulz maps zero to
   zero) only to what the next all-to-all needs, stage by stage, so a bucket with fewer
   matrices than devices sends few zeros; the stages over the outer mesh axes (the network)
   run first, while the arrays are smallest.
4. **Chunks.** A bucket's matrices go in up to `NS_CHUNKS` chunks, each its own exchange,
   Newton-Schulz and return: XLA's latency-hiding scheduler can send one chunk while another
   is being orthogonalised.
5. **Return.** The inverse all-to-alls put every piece back where it came from.

The exchange carries the Newton-Schulz dtype (bf16 by default): the chain casts the momentum to
it first and its result is in it, so casting before the exchange and back to the leaf's dtype
after the return changes no value and halves the bytes of an fp32 momentum.

`mesh_buckets` is pure (shapes and axis sizes), so the planner (`train/plan/optimizer.py`)
counts the very buckets, paddings and all-to-alls this code runs (`exchange_schedule`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

NS_CHUNKS = 4  # per bucket: one chunk's exchange under another's Newton-Schulz


class Placement(NamedTuple):
    """One leaf on the mesh, as its bucket sees it."""

    order: tuple[int, ...]   # x's dims: the matrices' batch dims, then their row dims, then column dims (wide)
    nbatch: int              # how many of `order` are batch dims
    nrow: int                # how many of the piece's dims form a matrix's rows
    piece: tuple[int, ...]   # per-device extent of the row dims, then the column dims
    batch: int               # matrices (whole or in pieces) on each device
    exchanges: tuple[tuple[int, str], ...]  # (dim of [b, *piece], mesh axis), in the order they run
    replicas: tuple[str, ...]  # mesh axes (size > 1) the leaf is not split over, in mesh order
    spec: object             # the leaf's PartitionSpec on the mesh (entries per dim)


class Bucket(NamedTuple):
    """Leaves orthogonalised together: the same piece, split over the same axes the same way."""

    leaves: tuple[int, ...]  # indices into the leaves
    piece: tuple[int, ...]
    nrow: int
    exchanges: tuple[tuple[int, str], ...]
    replicas: tuple[str, ...]
    batch: int               # matrices on each device, all leaves together
    rows: int                # the whole matrix, wide: rows <= cols
    cols: int


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def placement(shape, lay, spec, sizes: dict[str, int], axis_names: tuple[str, ...]) -> Placement:
    """Where leaf `shape` (its `train.muon.layout` `lay`, its mesh `spec`) puts its matrices' pieces.
    sizes: the mesh's axis sizes; axis_names: its axes, outermost first."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    nbatch = len(lay.flat) - 2
    batch_dims = lay.perm[:nbatch]
    red, out = lay.perm[nbatch:nbatch + lay.nred], lay.perm[nbatch + lay.nred:]
    rows_cols = (out + red) if lay.transposed else (red + out)  # wide: the short side first
    nrow = len(out) if lay.transposed else len(red)

    def local(d):
        return shape[d] // math.prod(sizes[a] for a in _axes(entries[d]))

    # one group of all-to-alls per split matrix dim (minor mesh axis first: global order), the
    # groups over outer mesh axes (the network on a GPU cluster) first
    groups = [[(1 + k, a) for a in reversed(_axes(entries[d])) if sizes[a] > 1] for k, d in enumerate(rows_cols)]
    groups = sorted((g for g in groups if g), key=lambda g: min(axis_names.index(a) for _, a in g))
    used = {a for e in entries for a in _axes(e)}
    replicas = tuple(a for a in axis_names if sizes[a] > 1 and a not in used)
    return Placement(batch_dims + rows_cols, nbatch, nrow, tuple(local(d) for d in rows_cols),
                     math.prod(local(d) for d in batch_dims), tuple(x for g in groups for x in g), replicas,
                     entries)


def mesh_buckets(placements: list[Placement], sizes: dict[str, int]) -> list[Bucket]:
    """The leaves grouped into buckets (module docstring), in the order of their first leaf."""
    by_key: dict[tuple, list[int]] = {}
    for i, pl in enumerate(placements):
        by_key.setdefault((pl.piece, pl.nrow, pl.exchanges, pl.replicas), []).append(i)
    out = []
    for (piece, nrow, exchanges, replicas), idx in by_key.items():
        whole = list(piece)
        for pos, axis in exchanges:
            whole[pos - 1] *= sizes[axis]
        out.append(Bucket(tuple(idx), piece, nrow, exchanges, replicas, sum(placements[i].batch for i in idx),
                          math.prod(whole[:nrow]), math.prod(whole[nrow:])))
    return out


class Chunk(NamedTuple):
    start: int                     # first matrix of the replica's share
    count: int                     # matrices (pieces) in the chunk
    padded: tuple[int, ...]        # the batch before each all-to-all, padded to a multiple of its axis
    matrices: int                  # whole matrices each device orthogonalises for this chunk


def exchange_schedule(batch: int, replicas: int, group: tuple[int, ...], chunks: int = NS_CHUNKS):
    """(share, [Chunk]): how a bucket of `batch` matrices per device is worked through. Each of
    `replicas` copies takes `share` = ceil(batch / replicas) of them (the last ones padded with
    zeros), in chunks of whole exchanges: up to `chunks` (not more than the whole matrices each
    device ends up with), each a multiple of the exchange group (prod(group)) but the last;
    before the all-to-all over an axis of size g the chunk's batch is padded to a multiple of g."""
    share = -(-batch // replicas)
    G = math.prod(group)
    slots = -(-share // G)  # whole matrices per device for the whole share
    k = min(chunks, slots)
    out, start = [], 0
    for j in range(k):
        n = slots // k + (j < slots % k)
        count = min(n * G, share - start)
        b, padded = count, []
        for g in group:
            b = -(-b // g) * g
            padded.append(b)
            b //= g
        out.append(Chunk(start, count, tuple(padded), b))
        start += count
    return share, out


def _pad(t, n: int):
    """t [b, ...] with zero matrices appended up to n."""
    return t if t.shape[0] == n else jnp.pad(t, [(0, n - t.shape[0])] + [(0, 0)] * (t.ndim - 1))


def _all_to_all(t, axis: str, split: int, concat: int):
    """A tiled all-to-all, its operand behind an optimization barrier: otherwise XLA:CPU's
    simplifier splits it into per-peer operands, some of them a transpose or a pad of the
    pieces, of different layouts, which its verifier then rejects (jax 0.11.2)."""
    return jax.lax.all_to_all(jax.lax.optimization_barrier(t), axis, split, concat, tiled=True)


def orthogonalize_bucket(xs, placements: list[Placement], bucket: Bucket, run, dtype, chunks: int = NS_CHUNKS):
    """`run` (Newton-Schulz over [b, rows, cols], rows <= cols) on every matrix of the bucket's
    leaves `xs` (global arrays under the active mesh, each in its placement's spec); returns
    them orthogonalised, each in its own shape, dtype and sharding."""
    from jax.sharding import PartitionSpec as P

    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    R = math.prod(sizes[a] for a in bucket.replicas)
    group = tuple(sizes[a] for _, a in bucket.exchanges)

    def per_device(*locals_):
        parts = []
        for x, pl in zip(locals_, placements):
            t = jnp.transpose(x, pl.order)
            parts.append(t.reshape((-1,) + pl.piece).astype(dtype))
        t = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
        b = t.shape[0]
        share, plan = exchange_schedule(b, R, group, chunks)
        if R > 1:  # this replica's share of the matrices
            t = jax.lax.dynamic_slice_in_dim(_pad(t, share * R), jax.lax.axis_index(bucket.replicas) * share, share)
        done = []
        for ch in plan:
            c = t[ch.start:ch.start + ch.count]
            for (pos, axis), n in zip(bucket.exchanges, ch.padded):  # batch split, that matrix dim gathered
                c = _all_to_all(_pad(c, n), axis, 0, pos)
            whole = c.shape
            c = run(c.reshape(whole[0], bucket.rows, bucket.cols)).astype(dtype).reshape(whole)
            unpadded = (ch.count,) + tuple(n // g for n, g in zip(ch.padded[:-1], group[:-1]))
            for (pos, axis), n in zip(reversed(bucket.exchanges), reversed(unpadded)):
                c = _all_to_all(c, axis, pos, 0)[:n]
            done.append(c)
        t = jnp.concatenate(done) if len(done) > 1 else done[0]
        if R > 1:  # every replica gets every result
            t = jax.lax.all_gather(t, bucket.replicas, axis=0, tiled=True)[:b]
        outs, at = [], 0
        for x, pl in zip(locals_, placements):
            y = t[at:at + pl.batch]
            at += pl.batch
            y = y.reshape(tuple(x.shape[d] for d in pl.order))
            inverse = tuple(sorted(range(x.ndim), key=lambda i: pl.order[i]))
            outs.append(jnp.transpose(y, inverse).astype(x.dtype))
        return tuple(outs)

    specs = tuple(P(*pl.spec) for pl in placements)
    return jax.shard_map(per_device, in_specs=specs, out_specs=specs, check_vma=False)(*xs)
