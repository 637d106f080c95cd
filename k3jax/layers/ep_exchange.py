"""The moves of the expert-parallel exchange (`k3jax.layers.expert_parallel`), inside its shard_map.

Three moves, each linear in what it carries, each with its transpose written out:

* `Hop`: candidates [C] on this device go to peers along a mesh axis (optionally in index
  groups: the nodes, or the devices of one node), each candidate to one destination or none.
  `send` fills the receivers' buffers [D * cap]; `back` is its transpose: every candidate reads
  back the row its receiver wrote in the same slot, and a parent row sums its `fan` candidates.
  Two forms: "capacity" (`all_to_all` of fixed [D, cap] buffers; any backend) and "ragged"
  (`ragged_all_to_all` of exactly the rows sent, into a receive buffer of D * cap rows; the
  receivers grant each source a prefix, so the buffer holds what fits in source order).
* `TensorGroup`: the rows a device received go to every device of its `tensor` group (all-gather;
  ragged: only the valid prefix moves), and `sum` is the transpose: every device gets back its
  rows' results from every rank and adds them in fp32, in rank order.
* `fan_out`: a parent row's slots (expert ids and routing weights) split into children, one per
  destination holding at most `W` of them (a token sends one row per node it uses).

`linear(...)` wraps a move with its transpose as a custom VJP: gradients go back the way the
values came, as rows of the compute dtype. Every sum (a parent over its children, a row over the
tensor ranks) runs in fp32 in a fixed order: no scatter-add, so results are deterministic.

`kept(x, name)` names what a collective delivered (`jax.ad_checkpoint.checkpoint_name`) so a
remat policy can save it instead of running the collective again: the moves name the counts
they exchange in their constructors (`keep`); the caller names what `send` / `gather` return.

XLA:CPU has no ragged all-to-all; there `ragged_all_to_all` is emulated with an all-gather (its
documented semantics), so the ragged logic is tested on CPU. The platform is the mesh's (a
deviceless compile for a GPU from a CPU host lowers the real collective).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax.ad_checkpoint import checkpoint_name

from k3jax.ops.mesh_axes import TENSOR
from k3jax.ops.planning import target_backend

SLOTS_PER_ROW = 4  # W: a row carries at most 4 of a token's experts on its destination (see fan_out)


def mesh_platform(mesh) -> str:
    """The platform the mesh's devices are ('gpu', 'tpu', 'cpu'); the planning target (or this
    process's backend) for a mesh without devices."""
    device = getattr(getattr(mesh, "abstract_mesh", mesh), "abstract_device", None)
    platform = getattr(device, "platform", None)
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform) or target_backend()


@dataclasses.dataclass(frozen=True)
class Peers:
    """The devices one hop exchanges among: along mesh axis `axis`, `size` of them, in
    `groups` (jax's axis_index_groups: lists of axis indices; None = the whole axis)."""

    axis: str
    size: int
    groups: tuple[tuple[int, ...], ...] | None = None
    emulate: bool = False  # XLA:CPU: ragged_all_to_all through an all-gather

    def members(self) -> np.ndarray:
        """[axis size, size]: for each axis index, the axis indices of its group in order."""
        if self.groups is None:
            return np.tile(np.arange(self.size), (self.size, 1))
        out = np.zeros((sum(map(len, self.groups)), self.size), np.int32)
        for g in self.groups:
            out[list(g)] = g
        return out

    def position(self):
        """This device's index within its group."""
        i = jax.lax.axis_index(self.axis)
        if self.groups is None:
            return i
        pos = np.zeros(sum(map(len, self.groups)), np.int32)
        for g in self.groups:
            pos[list(g)] = np.arange(len(g))
        return jnp.asarray(pos)[i]

    def all_to_all(self, x):
        """x [size * m, ...]: block j goes to peer j; returns the blocks the peers sent, in order."""
        return jax.lax.all_to_all(x, self.axis, 0, 0, tiled=True, axis_index_groups=self.groups)

    def ragged_all_to_all(self, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        if not self.emulate:
            return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                             axis_name=self.axis, axis_index_groups=self.groups)
        # XLA:CPU: every device gathers every operand and keeps what its group's members sent it
        me = self.position()
        mine = jnp.asarray(self.members())[jax.lax.axis_index(self.axis)]  # [size] axis indices
        ops = jax.lax.all_gather(operand, self.axis)  # [axis, M, ...]
        in_off, sizes, out_off = (jax.lax.all_gather(a, self.axis) for a in (input_offsets, send_sizes, output_offsets))
        rows = jnp.arange(operand.shape[0])
        for p in range(self.size):
            src = mine[p]
            count, start, dst = sizes[src, me], in_off[src, me], out_off[src, me]
            take = ops[src, jnp.clip(start + rows, 0, operand.shape[0] - 1)]
            where = jnp.where(rows < count, dst + rows, output.shape[0])  # out of bounds: dropped
            output = output.at[where].set(take, mode="drop")
        return output


def kept(x, name: str | None):
    """x under the checkpoint name `name` (a remat policy that saves it keeps x for the
    backward pass instead of running the collective that made it again); x itself for None."""
    return x if name is None else checkpoint_name(x, name)


def _fill(shape, value, dtype):
    return jnp.full(shape, value, dtype)


def _sum_fan(vals, fan: int, dtype):
    """[C, ...] -> [C / fan, ...]: each parent's `fan` consecutive candidates summed in fp32."""
    if fan == 1:
        return vals.astype(dtype)
    v = vals.reshape((vals.shape[0] // fan, fan) + vals.shape[1:]).astype(jnp.float32)
    return jnp.sum(v, axis=1).astype(dtype)


class _Mover:
    """Static configuration plus the traced index arrays `a` it moves rows by. A custom VJP
    must not close over traced values, so `linear` passes `a` in and `rebind`s a copy."""

    a: dict

    def rebind(self, arrays: dict):
        other = copy.copy(self)
        other.a = arrays
        return other


class Hop(_Mover):
    """One exchange among `peers` of C candidates, candidate c going to dest[c] in [0, D) or,
    with dest[c] = D, nowhere. Receivers hold `rows` = D * cap slots. Built inside the shard_map
    (the ragged form exchanges the counts here; keep: the checkpoint name of what it received)."""

    def __init__(self, peers: Peers, dest, cap: int, ragged: bool, keep: str | None = None):
        D, C = peers.size, dest.shape[0]
        self.peers, self.cap, self.ragged, self.C = peers, cap, ragged, C
        self.rows = D * cap
        order = jnp.argsort(dest, stable=True)  # by destination; the unsent last
        counts = jnp.bincount(dest, length=D + 1).astype(jnp.int32)
        starts = jnp.cumsum(counts) - counts  # [D + 1]
        pos = jnp.zeros((C,), jnp.int32).at[order].set(jnp.arange(C, dtype=jnp.int32))  # sorted position
        rank = pos - starts[dest]  # place among the candidates for the same destination
        self.a = dict(dest=dest, rank=rank, pos=pos, order=order)
        if not ragged:
            self.a["keep"] = (dest < D) & (rank < cap)
            return
        counts, starts = counts[:D], starts[:D]
        # every receiver learns how many rows each source wants to send it and grants a prefix
        want = kept(peers.all_to_all(counts), keep)
        granted_in = jnp.minimum(want, jnp.maximum(self.rows - (jnp.cumsum(want) - want), 0))
        recv_offsets = jnp.cumsum(granted_in) - granted_in
        granted_out = kept(peers.all_to_all(granted_in), keep)  # what each receiver takes from me ...
        self.a.update(
            out_offsets=kept(peers.all_to_all(recv_offsets), keep),  # ... and where it puts it
            back_offsets=kept(peers.all_to_all(starts), keep),  # where each source keeps its rows for me
            starts=starts, granted_in=granted_in, granted_out=granted_out, recv_offsets=recv_offsets,
            keep=(dest < D) & (rank < granted_out[jnp.minimum(dest, D - 1)]))
        self.received = jnp.sum(granted_in)  # the receive buffer's valid prefix

    def send(self, x, fan: int = 1, fill=0):
        """x [C / fan, ...] (candidate c carries x[c // fan]) -> the receive buffer [rows, ...],
        `fill` where nothing arrived."""
        tail, a = x.shape[1:], self.a
        if self.ragged:
            operand = x[a["order"] // fan]
            out = _fill((self.rows,) + tail, fill, x.dtype)
            return self.peers.ragged_all_to_all(operand, out, a["starts"], a["granted_out"], a["out_offsets"],
                                                a["granted_in"])
        D = self.peers.size
        src = jnp.arange(self.C) // fan
        buf = _fill((D, self.cap) + tail, fill, x.dtype)
        buf = buf.at[jnp.where(a["keep"], a["dest"], D), a["rank"]].set(x[src], mode="drop")
        return self.peers.all_to_all(buf.reshape((self.rows,) + tail))

    def back(self, y, fan: int = 1, dtype=None):
        """The transpose of `send`: y [rows, ...] in the receive buffer's layout -> [C / fan, ...],
        each parent the fp32 sum of what its candidates' slots hold (0 for one not delivered)."""
        tail, a = y.shape[1:], self.a
        if self.ragged:
            sorted_vals = self.peers.ragged_all_to_all(y, jnp.zeros((self.C,) + tail, y.dtype), a["recv_offsets"],
                                                       a["granted_in"], a["back_offsets"], a["granted_out"])
            vals = sorted_vals[a["pos"]]
        else:
            D = self.peers.size
            back = self.peers.all_to_all(y).reshape((D, self.cap) + tail)
            vals = back[jnp.minimum(a["dest"], D - 1), jnp.minimum(a["rank"], self.cap - 1)]
        vals = jnp.where(a["keep"].reshape((-1,) + (1,) * len(tail)), vals, jnp.zeros((), y.dtype))
        return _sum_fan(vals, fan, dtype or y.dtype)


class TensorGroup(_Mover):
    """The devices of one `tensor` group share the rows each of them received (`gather`) and
    return each other's results (`sum`, its transpose). With `valid` (the ragged form: each
    device's valid prefix) only those rows move (keep: the checkpoint name of the prefixes'
    exchange)."""

    def __init__(self, t: int, rows: int, valid=None, emulate: bool = False, keep: str | None = None):
        self.t, self.rows = t, rows
        self.peers = Peers(TENSOR, t, None, emulate)
        self.ragged = valid is not None and t > 1
        self.a = {}
        if self.ragged:
            valid = jnp.asarray(valid, jnp.int32)
            self.a = dict(me=jax.lax.axis_index(TENSOR), valid=valid,
                          valid_all=kept(jax.lax.all_gather(valid, TENSOR), keep))

    def gather(self, x, fill=0):
        """x [rows, ...] -> [t * rows, ...]: rank r's rows at r * rows."""
        if self.t == 1:
            return x
        if not self.ragged:
            return jax.lax.all_gather(x, TENSOR, axis=0, tiled=True)
        t, R, a = self.t, self.rows, self.a
        out = _fill((t * R,) + x.shape[1:], fill, x.dtype)
        return self.peers.ragged_all_to_all(x, out, jnp.zeros((t,), jnp.int32), jnp.full((t,), a["valid"]),
                                            jnp.full((t,), a["me"] * R, jnp.int32), a["valid_all"])

    def sum(self, y, dtype=jnp.float32):
        """The transpose of `gather`: y [t * rows, ...] (results for every rank's rows) -> [rows, ...],
        this device's rows summed over the ranks in fp32."""
        if self.t == 1:
            return y.astype(dtype)
        t, R, a = self.t, self.rows, self.a
        if not self.ragged:
            parts = jax.lax.all_to_all(y, TENSOR, 0, 0, tiled=True)
        else:
            parts = self.peers.ragged_all_to_all(y, jnp.zeros_like(y), jnp.arange(t, dtype=jnp.int32) * R,
                                                 a["valid_all"], jnp.full((t,), a["me"] * R, jnp.int32),
                                                 jnp.full((t,), a["valid"]))
        parts = parts.reshape((t, R) + y.shape[1:]).astype(jnp.float32)
        return jnp.sum(parts, axis=0).astype(dtype)


class Arrays(_Mover):
    """Index arrays for a `linear` move written as a plain function (attribute access: .a[name])."""

    def __init__(self, **arrays):
        self.a = arrays


def linear(forward, transpose, *movers: _Mover):
    """x -> forward(x, *movers), linear in x, with transpose(ct, *movers) its transpose, as one
    custom-VJP function (the collectives' own transposes know neither index groups nor the
    emulation). The movers' index arrays are passed in, not closed over, and the cotangent is
    returned in x's dtype."""

    def call(x):
        dtype = x.dtype

        @jax.custom_vjp
        def f(x, arrays):
            return forward(x, *(m.rebind(a) for m, a in zip(movers, arrays)))

        def fwd(x, arrays):
            return f(x, arrays), arrays

        def bwd(arrays, ct):
            return transpose(ct, *(m.rebind(a) for m, a in zip(movers, arrays))).astype(dtype), None

        f.defvjp(fwd, bwd)
        return f(x, tuple(m.a for m in movers))

    return call


def fan_out(experts, weights, dest_of, D: int, W: int):
    """Split parent rows into children, one per destination (and per W of its slots there).

    experts [M,K] int32 (-1: empty slot), weights [M,K] fp32, dest_of(experts) -> [M,K]
    destinations in [0, D). A parent's slots are ordered by destination (stable), and child
    candidate j of parent m starts at its j-th ordered slot when that slot opens a run of at most
    W slots with one destination. Returns (dest [M*K] (D: no child starts there), child experts
    [M*K, W] (-1: empty), child weights [M*K, W]); candidate c belongs to parent c // K."""
    M, K = experts.shape
    valid = experts >= 0
    dest = jnp.where(valid, dest_of(jnp.maximum(experts, 0)), D)
    pos = jnp.arange(K, dtype=jnp.int32)
    srt = jnp.argsort(dest * K + pos[None, :], axis=-1)  # by destination, then slot
    ds = jnp.take_along_axis(dest, srt, axis=-1)
    first = jnp.concatenate([jnp.ones((M, 1), bool), ds[:, 1:] != ds[:, :-1]], axis=-1)
    rank = pos[None, :] - jax.lax.cummax(jnp.where(first, pos[None, :], 0), axis=1)  # place in its run
    starts = (ds < D) & (rank % W == 0)
    j = pos[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]  # [K, W]: a child's slots j .. j+W-1
    jc = jnp.minimum(j, K - 1)
    ok = ((j < K)[None] & (ds[:, jc] == ds[:, :, None]) & (rank[:, jc] // W == (rank // W)[:, :, None])
          & starts[:, :, None])
    src = srt[:, jc].reshape(M, K * W)  # the parent slot each child slot copies
    child_e = jnp.where(ok, jnp.take_along_axis(experts, src, axis=-1).reshape(M, K, W), -1)
    child_w = jnp.where(ok, jnp.take_along_axis(weights, src, axis=-1).reshape(M, K, W), 0.0)
    return jnp.where(starts, ds, D).reshape(-1), child_e.reshape(M * K, W), child_w.reshape(M * K, W)


# ------------------------------------------------------------------------------------------
# expected rows (uniform routing), shared with the planner (train/plan/communication.py)


def rows_per_destination(num_experts: int, experts_there: int, top_k: int, W: int = SLOTS_PER_ROW) -> float:
    """Expected rows one token sends to one destination holding `experts_there` of the
    `num_experts` experts, when its top_k experts are a uniformly random set: E[ceil(S / W)],
    S ~ hypergeometric (its experts that live there)."""
    E, g, k = num_experts, experts_there, top_k
    total = math.comb(E, k)
    return sum(math.comb(g, s) * math.comb(E - g, k - s) / total * math.ceil(s / W) for s in range(1, min(g, k) + 1))
