"""Context parallelism (`mesh.context`): each row's T tokens split into C contiguous shards.

Contiguous, not striped: the recurrence needs its tokens in order. Everything per token
(projections, norms, MoE, AttnRes, the loss) runs on the sharded activations as it is; three
things cross shard edges, each a `jax.shard_map` over the mesh (rows over data x fsdp x expert,
tokens over context, heads over tensor where they divide):

- the delta-rule recurrence (KDA, gated DeltaNet, DeltaNet, linear attention; `recurrence`):
  a shard's pass is affine in its incoming state, S_out = M S_in + h (M [K,K] per head, the
  product of its transitions; h its final state from zero). One pass with value columns
  [v | 0] from the state [0 | I] yields [h | M] in fp32; one all-gather shares every shard's
  (M, h) and last/first segment ids; each shard folds the upstream summaries, zeroing the state
  where a shard starts a new document (the segment contract, k3jax/segments.py), and reruns
  its pass from the true incoming state. The backward is autodiff through the gather.
- the short convolutions (`short_conv`): the upstream shard's last W-1 inputs arrive by one
  ppermute, kept only where they belong to this shard's first document.
- softmax attention (MLA, the softmax mixer; `attention`): the caller gathers the keys (MLA
  gathers its 576-value latent and expands it after), and each shard attends its queries over
  them at their global token indices with segment ids (`k3jax.ops.context_attn`), no [T,T] mask.

Cost: the delta-rule layers run their chunk pass twice (the summary pass is V+K columns wide),
and every shard expands the gathered MLA latent of the whole row. Parameters are sharded over
`context` like over `fsdp` (k3jax/sharding/rules.py). k3jax-plan traces one shard's program without
devices (`planning_context`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.layers.conv import short_conv as _short_conv
from k3jax.ops.context_attn import blocked_attention
from k3jax.ops.mesh_axes import BATCH_AXES, CONTEXT, active_mesh, fit_axes, row_head_axes

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Emulated:
    """k3jax-plan's stand-in for a context mesh: one device's program (the last shard's, which
    attends over the most keys) traced without devices, its collectives replaced by local ops of
    the same shapes (an all-gather by C copies), so XLA's memory figures are one device's."""

    size: int

    @property
    def shape(self):
        return {CONTEXT: self.size}


_PLANNING: contextvars.ContextVar[int] = contextvars.ContextVar("k3jax_planning_context", default=1)


@contextlib.contextmanager
def planning_context(size: int):
    """Inside, the model traces one device's share of a `size`-way context-parallel program
    (k3jax-plan compiles it for its memory; the values it computes are meaningless)."""
    token = _PLANNING.set(size)
    try:
        yield
    finally:
        _PLANNING.reset(token)


def planning_context_size() -> int:
    """The context-parallel size `planning_context` traces for (1 outside it)."""
    return _PLANNING.get()


def context_mesh():
    """The active mesh when it splits tokens over `context` (size > 1), an `Emulated` one while
    planning, else None."""
    if _PLANNING.get() > 1:
        return Emulated(_PLANNING.get())
    mesh = active_mesh()
    if mesh is None or mesh.shape.get(CONTEXT, 1) == 1:
        return None
    return mesh


def splits(mesh, T: int, min_shard: int = 1) -> bool:
    """Whether a call of T tokens runs context-parallel on `mesh`: whole shards of at least
    `min_shard` tokens (a decode step, T = 1, runs on the whole row). While planning, T is
    already one shard."""
    if mesh is None:
        return False
    if isinstance(mesh, Emulated):
        return T >= min_shard
    C = mesh.shape[CONTEXT]
    return T % C == 0 and T // C >= min_shard


@dataclasses.dataclass(frozen=True)
class _Comm:
    """The collectives of a shard's body: real ones inside shard_map, local stand-ins of the
    same shapes while planning."""

    size: int
    emulated: bool

    def index(self):
        return self.size - 1 if self.emulated else jax.lax.axis_index(CONTEXT)

    def all_gather(self, x):
        if self.emulated:
            return jnp.broadcast_to(x[None], (self.size,) + x.shape)
        return jax.lax.all_gather(x, CONTEXT)

    def from_upstream(self, x):
        """Shard j receives shard j-1's x (shard 0: zeros)."""
        if self.emulated:
            return x
        return jax.lax.ppermute(x, CONTEXT, [(j, j + 1) for j in range(self.size - 1)])


def gather_tokens(x, mesh):
    """x [B,T,...] sharded over context -> the same array replicated over context (an
    all-gather of the token axis; rows stay on their devices)."""
    if isinstance(mesh, Emulated):  # one shard's x stands for each of the C shards
        return jnp.concatenate([x] * mesh.size, axis=1)
    rows = fit_axes(mesh, BATCH_AXES, x.shape[0])
    return jax.lax.with_sharding_constraint(x, P(rows, *([None] * (x.ndim - 1))))


def _upstream_starts(first_ids, last_ids, C):
    """[C,B] bool: shard j's first token starts a document (shard 0: always, from the caller's
    point of view its initial state is the row's own)."""
    cont = first_ids[1:] == last_ids[:-1]
    return jnp.concatenate([jnp.zeros_like(cont[:1]), ~cont], axis=0)


def recurrence(fn, q, k, v, g, beta, *, initial_state, segment_ids, mesh):
    """fn(q, k, v, g, beta, initial_state=, segment_ids=) -> (o [B,T,H,V], S [B,H,K,V] fp32), a
    chunked delta-rule operator with its options bound, run context-parallel.

    q, k [B,T,H,K], v [B,T,H,V], g [B,T,H,K] / [B,T,H] / None, beta [B,T,H] / None, segment_ids
    [B,T], initial_state [B,H,K,V] or None (the state before token 0). Returns fn's outputs for
    the whole row: o sharded like q, S the state after the row's last token."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = mesh.shape[CONTEXT]
    comm = _Comm(C, isinstance(mesh, Emulated))
    rows, heads = (None, None) if comm.emulated else row_head_axes(mesh, B, H)
    x4 = P(rows, CONTEXT, heads, None)
    x3 = P(rows, CONTEXT, heads)
    s4 = P(rows, heads, None, None)
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids
    args = {"q": (q, x4), "k": (k, x4), "v": (v, x4), "seg": (seg, P(rows, CONTEXT))}
    if g is not None:
        args["g"] = (g, x4 if g.ndim == 4 else x3)
    if beta is not None:
        args["beta"] = (beta, x3)
    if initial_state is not None:
        args["h0"] = (initial_state, s4)
    names = tuple(args)

    def local(*xs):
        a = dict(zip(names, xs))
        q, k, v, seg = a["q"], a["k"], a["v"], a["seg"]
        g, beta = a.get("g"), a.get("beta")
        Bl, _, Hl, _ = q.shape
        # the shard's affine summary in one pass: value columns [v | 0], incoming state [0 | I]
        v_aug = jnp.concatenate([v, jnp.zeros(v.shape[:3] + (K,), v.dtype)], axis=-1)
        eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (Bl, Hl, K, K))
        s_aug = jnp.concatenate([jnp.zeros((Bl, Hl, K, V), jnp.float32), eye], axis=-1)
        _, S_aug = fn(q, k, v_aug, g, beta, initial_state=s_aug, segment_ids=seg)
        h, M = S_aug[..., :V].astype(jnp.float32), S_aug[..., V:].astype(jnp.float32)
        all_h = comm.all_gather(h)  # [C,Bl,Hl,K,V]
        all_M = comm.all_gather(M)  # [C,Bl,Hl,K,K]
        starts = _upstream_starts(comm.all_gather(seg[:, 0]), comm.all_gather(seg[:, -1]), C)  # [C,Bl]
        S0 = a["h0"].astype(jnp.float32) if "h0" in a else jnp.zeros((Bl, Hl, K, V), jnp.float32)

        def fold(S, xs):  # every shard folds the same chain of C small matmuls
            M_j, h_j, start_j = xs
            S = jnp.where(start_j[:, None, None, None], 0.0, S)  # shard j starts a document
            return jnp.einsum("bhij,bhjv->bhiv", M_j, S, precision=_HI) + h_j, S

        S, incoming = jax.lax.scan(fold, S0, (all_M, all_h, starts))
        S_in = incoming[comm.index()]
        o, _ = fn(q, k, v, g, beta, initial_state=S_in, segment_ids=seg)
        return o, S

    if comm.emulated:
        return local(*(args[n][0] for n in names))
    run = jax.shard_map(local, mesh=mesh, in_specs=tuple(args[n][1] for n in names),
                        out_specs=(x4, s4), check_vma=False)
    return run(*(args[n][0] for n in names))


def short_conv(weight, x, segment_ids, window, mesh, impl: str = "xla"):
    """`k3jax.layers.conv.short_conv` with tokens over context: x [B,T,P], weight [W,P],
    window [B,W-1,P] or None (inputs before token 0), impl as `model.kda.conv_impl`. Returns
    (y [B,T,P], next window)."""
    B, _, Pc = x.shape
    W = weight.shape[0]
    comm = _Comm(mesh.shape[CONTEXT], isinstance(mesh, Emulated))
    if window is None:
        window = jnp.zeros((B, W - 1, Pc), x.dtype)

    def local(weight, x, seg, window):
        halo = comm.from_upstream(x[:, -(W - 1):])  # shard j's tail is shard j+1's halo
        # ids shifted by one so that shard 0's (zero) halo ids match no real id
        halo_ids = comm.from_upstream(seg[:, -(W - 1):] + 1) - 1
        halo = jnp.where((halo_ids == seg[:, :1])[..., None], halo, jnp.zeros_like(halo))
        halo = jnp.where(comm.index() == 0, window.astype(x.dtype), halo)
        return _short_conv(weight, x, seg, halo, impl=impl)[0]

    if comm.emulated:
        y = local(weight, x, segment_ids, window)
    else:
        rows, chans = row_head_axes(mesh, B, Pc)
        y = jax.shard_map(local, mesh=mesh,
                          in_specs=(P(None, chans), P(rows, CONTEXT, chans), P(rows, CONTEXT), P(rows, None, chans)),
                          out_specs=P(rows, CONTEXT, chans), check_vma=False)(weight, x, segment_ids, window)
    # the next window: the row's last W-1 inputs of its last document (T >= W-1 here)
    tail, tail_ids = x[:, -(W - 1):], segment_ids[:, -(W - 1):]
    next_window = jnp.where((tail_ids == segment_ids[:, -1:])[..., None], tail, jnp.zeros_like(tail))
    return y, next_window


def attention(q, k, v, segment_ids, *, scale, mesh, kv_segment_ids=None, q_index=None, k_index=None):
    """Causal attention of context-sharded queries q [B,T,H,D] over keys k [B,S,Hkv,D] and
    values v [B,S,Hkv,Dv] that every shard holds whole (the caller gathered them). Query t of
    the row sits at index q_index[t] (default t), key s at k_index[s] (default s); it sees keys
    at or before its index with its segment id (kv_segment_ids [B,S], default segment_ids).
    Returns o [B,T,H,Dv] sharded like q."""
    B, T = q.shape[:2]
    S, Hkv = k.shape[1], k.shape[2]
    if isinstance(mesh, Emulated):  # the last shard: its queries sit after every other shard's
        q_index = (S - T) + jnp.arange(T, dtype=jnp.int32) if q_index is None else q_index
        return blocked_attention(q, k, v, q_index, jnp.arange(S, dtype=jnp.int32) if k_index is None else k_index,
                                 segment_ids, segment_ids if kv_segment_ids is None else kv_segment_ids, scale=scale)
    rows, heads = row_head_axes(mesh, B, Hkv)  # query heads follow their kv head
    kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
    q_index = jnp.arange(T, dtype=jnp.int32) if q_index is None else q_index
    k_index = jnp.arange(S, dtype=jnp.int32) if k_index is None else k_index

    def local(q, k, v, q_seg, k_seg, q_idx, k_idx):
        return blocked_attention(q, k, v, q_idx, k_idx, q_seg, k_seg, scale=scale)

    run = jax.shard_map(local, mesh=mesh,
                        in_specs=(P(rows, CONTEXT, heads, None), P(rows, None, heads, None),
                                  P(rows, None, heads, None), P(rows, CONTEXT), P(rows, None), P(CONTEXT), P()),
                        out_specs=P(rows, CONTEXT, heads, None), check_vma=False)
    return run(q, k, v, segment_ids, kv_seg, q_index, k_index)
