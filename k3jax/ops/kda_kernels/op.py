"""The fused chunked delta rule: five Pallas kernels under one `jax.custom_vjp`.

    forward:   intra_chunk(+Ainv) -> state_forward(o, h, v_new)
    backward:  state_backward -> wy_grad -> score_grad

By default (`Tuning.keep_intermediates`, config `model.kda.kernel_residuals: intermediates`)
the forward keeps what the backward reads: kernel 1's outputs with the UT inverse, and the
state pass's chunk states and v_new, ~0.7 GB per k3-small layer at 8 x 4096 tokens. With
`inputs`, as fla does, it keeps only its inputs (q, k, v, the cumulative gate, beta, h0,
segment counters) and the backward runs kernels 1 and 2 again first
(intra_chunk(+Ainv) -> state_forward(h, v_new)), so the operator's memory is that of its
inputs. Both give the same numbers. Outside the custom_vjp, plain XLA (and its autodiff) does the
cheap elementwise work: clamping the gate, the in-chunk cumulative sum of the log-decay
(whose transpose, the reverse cumsum, turns dG into dg), padding T, and the segment
counters.

Only the per-channel form is implemented in the kernels; a per-head gate (gated DeltaNet)
is broadcast over K. DeltaNet (no decay) passes no gate at all (gc = None): the kernels then
skip every decay factor and the dG terms. A gate of zeros would cost the same kernels a
[B,T,H,K] read and a dG write for nothing, and its in-chunk cumsum, a compile-time constant,
took XLA:GPU 2m22s of constant folding at the ladder's h200 size (16 x 2048 tokens, 4 x 128).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from k3jax.ops.kda_kernels import grad, intra, state
from k3jax.ops.kda_kernels.common import F32, SAFE_SPAN, SUB, Numerics, Tuning
from k3jax.ops.kda_kernels.cumsum import chunk_cumsum
from k3jax.ops.planning import planning_target, triton_stand_in
from k3jax.ops.remat_names import KDA_INTERMEDIATES
from k3jax.segments import segment_starts
from k3jax.ops.mesh_axes import active_mesh, row_head_axes

log = logging.getLogger("k3jax.ops")

LOG_DECAY_FLOOR = -80.0  # as k3jax.ops.delta_rule
CHUNK_SIZES = (16, 32, 64)
# the state pass computes o itself up to this many chunks per sequence; beyond, the output is
# a chunk-parallel kernel (the serial pass is the long-sequence bottleneck)
FUSE_OUTPUT_MAX_CHUNKS = 128


@dataclasses.dataclass(frozen=True)
class _Static:
    scale: float
    chunk: int
    num: Numerics
    out_dtype: object
    tuning: Tuning
    interpret: bool


def unsupported_reason(q, v, *, decay, delta: bool, decay_bound, chunk_size: int) -> str | None:
    """Why the fused kernels cannot run these inputs (None when they can)."""
    K, V = q.shape[-1], v.shape[-1]
    if not delta:
        return "no delta rule (linear attention)"
    if decay is not None:
        if decay_bound is None:
            return "the gate has no static lower bound (decay_bound=None, e.g. the softplus gate)"
        if (SUB - 1) * -float(decay_bound) >= SAFE_SPAN:
            return f"decay_bound={decay_bound} allows 16-token decay spans over {SAFE_SPAN:g} nats"
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d > 256 or d & (d - 1):
            return f"head dim {name}={d} is not a power of two in [16, 256]"
    if chunk_size not in CHUNK_SIZES:
        return f"chunk_size={chunk_size} is not one of {CHUNK_SIZES}"
    if any(jnp.dtype(x.dtype) == jnp.float64 for x in (q, v)):
        return "float64 inputs"
    return None


_logged: set = set()


def log_once(msg: str):
    if msg not in _logged:
        _logged.add(msg)
        log.info(msg)


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


# --------------------------------------------------------------------------------------
# planning (k3jax-plan, `k3jax.ops.planning`): without XLA:GPU's compiler (the [plan] extra)
# Triton kernels cannot be compiled off-GPU, so the planner compiles `memory_stand_in`, which
# keeps what they keep (their inputs), and adds their workspace analytically
# (`backward_workspace_bytes`); with it, the real kernels are compiled


def backward_workspace_bytes(tokens: int, heads: int, K: int, V: int, chunk: int, low_precision: bool,
                             keep_intermediates: bool = True) -> int:
    """HBM the fused kernels' backward allocates for one layer (what `_core_bwd` creates),
    for `tokens` tokens of `heads` heads: the state gradients, dv_new and the gradient kernels'
    fp32 partials; with `keep_intermediates` off also kernel 1's outputs and scratch, the
    per-chunk states and v_new, which it then recomputes (kept, they are the forward's
    residuals, which the stand-in keeps itself)."""
    c = 2 if low_precision else 4
    per_token = (K * V * c / chunk + V * c                   # dh per chunk; dv_new
                 + (3 * K + 2 * chunk + 1) * 4)              # dq, dk, dG partials, dAqk, dL, dbeta
    if not keep_intermediates:
        per_token += ((3 * K + V + 2 * chunk) * c + 4 * chunk  # w, kg, qg, u, Aqk, Ainv; fp32 L scratch
                      + K * V * c / chunk + V * c)             # h per chunk; v_new
    return int(tokens * heads * per_token)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def memory_stand_in(q, k, v, gc, beta, h0, r, st: _Static):
    """Same inputs, outputs and residuals as `_core`, computed by cheap elementwise ops (only
    traced and compiled by k3jax-plan, never run for results)."""
    return _stand_in_fwd(q, k, v, gc, beta, h0, r, st)[0]


def _stand_in_fwd(q, k, v, gc, beta, h0, r, st):
    B, T, H, K = q.shape
    V = v.shape[-1]
    C, NT, cd = st.chunk, T // st.chunk, st.num.cd
    s = jnp.sum(q.astype(F32) + k.astype(F32) + (0.0 if gc is None else gc), axis=-1) + beta  # [B,T,H]
    if r is not None:
        s = s + r[..., None].astype(F32)
    o = (v.astype(F32) * s[..., None]).astype(st.out_dtype)
    S = jnp.broadcast_to(jnp.mean(s, axis=1)[:, :, None, None], (B, H, K, V))
    if h0 is not None:
        S = S + h0
    kept = None
    if st.tuning.keep_intermediates:  # the kept intermediates' shapes and dtypes (`_Kept`)
        per_chunk = jnp.mean(s.reshape(B, NT, C, H), axis=2)  # [B,NT,H]
        rows = lambda x, n: (x.astype(F32) * s[..., None])[..., :n] if x.shape[-1] >= n else (  # noqa: E731
            jnp.broadcast_to(s[..., None], s.shape + (n,)))
        kept = _Kept(*(checkpoint_name(x, KDA_INTERMEDIATES) for x in (
            rows(q, K).astype(cd), rows(k, K).astype(cd), (q.astype(F32) + k.astype(F32)).astype(cd),
            rows(v, C).astype(cd), (rows(k, C) + 1).astype(cd),
            jnp.broadcast_to(per_chunk[..., None], (B, NT, H, K)),
            jnp.broadcast_to(per_chunk[..., None, None], (B, NT, H, K, V)).astype(cd),
            (v.astype(F32) - s[..., None]).astype(cd))))
    inputs = (q, k, v, gc, beta, h0, r)
    if kept is not None:  # named as `_core_fwd` names them
        inputs = tuple(None if x is None else checkpoint_name(x, KDA_INTERMEDIATES) for x in inputs)
    return (o, S), (*inputs, kept)


def _stand_in_bwd(st, res, cts):
    q, k, v, gc, beta, h0, r, kept = res
    do, dS = cts
    t = jnp.sum(do.astype(F32), axis=-1) + jnp.mean(dS, axis=(-2, -1))[:, None, :]  # [B,T,H]
    if kept is not None:  # read every kept array, as the backward kernels do
        t = t + sum(jnp.mean(x.astype(F32)) for x in kept)
    grad = lambda x: (x.astype(F32) * t[..., None]).astype(x.dtype)  # noqa: E731
    return (grad(q), grad(k), grad(v), None if gc is None else grad(gc), (beta * t).astype(beta.dtype),
            None if h0 is None else h0 * jnp.mean(t), None)


memory_stand_in.defvjp(_stand_in_fwd, _stand_in_bwd)


# --------------------------------------------------------------------------------------
# the custom_vjp core: padded [B,Tp,H,*] inputs in the matmul dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _core(q, k, v, gc, beta, h0, r, st: _Static):
    return _forward(q, k, v, gc, beta, h0, r, st)[0]


def _forward(q, k, v, gc, beta, h0, r, st: _Static, keep: bool = False):
    """(o, S), and with `keep` also the intermediates the backward reads (`_Kept`)."""
    t = st.tuning
    w, u, kg, qg, aqk, gam, *ainv = intra.intra_chunk(q, k, v, gc, beta, r, scale=st.scale, chunk=st.chunk,
                                                      num=st.num, warps=t.warps_intra, want_ainv=keep,
                                                      interpret=st.interpret, block_k=t.intra_block_k,
                                                      stages=t.stages_intra, inverse_blocks=t.intra_inverse,
                                                      split=t.intra_split, warps_scores=t.warps_scores)
    NT = q.shape[1] // st.chunk
    fuse = t.fuse_output if t.fuse_output >= 0 else int(NT <= FUSE_OUTPUT_MAX_CHUNKS)
    if fuse:
        o, S, *states = state.state_forward(w, u, kg, qg, aqk, gam, h0, chunk=st.chunk, num=st.num,
                                            out_dtype=st.out_dtype, want_o=True, want_states=keep,
                                            block=t.state_block_v, warps=t.warps_state, stages=t.stages_state,
                                            interpret=st.interpret)
    else:
        S, *states = state.state_forward(w, u, kg, qg, aqk, gam, h0, chunk=st.chunk, num=st.num,
                                         out_dtype=st.out_dtype, want_o=False, want_states=True,
                                         block=t.state_block_v, warps=t.warps_state, stages=t.stages_state,
                                         interpret=st.interpret)
        o = state.chunk_output(qg, aqk, *states, chunk=st.chunk, num=st.num, out_dtype=st.out_dtype,
                               warps=t.warps_output, interpret=st.interpret)
    if not keep:
        return (o, S), None
    return (o, S), _Kept(w, kg, qg, aqk, gam, ainv[0], *states)


class _Kept(NamedTuple):
    """What the backward reads besides the inputs: kernel 1's outputs (u aside) with Ainv, and the
    state pass's chunk states h [B,NT,H,K,V] and v_new [B,T,H,V]."""
    w: jax.Array
    kg: jax.Array
    qg: jax.Array
    aqk: jax.Array
    gam: jax.Array
    ainv: jax.Array
    h: jax.Array
    v_new: jax.Array


def _core_fwd(q, k, v, gc, beta, h0, r, st):
    keep = bool(st.tuning.keep_intermediates)
    out, kept = _forward(q, k, v, gc, beta, h0, r, st, keep)
    inputs = (q, k, v, gc, beta, h0, r)
    if kept is not None:
        # named, so that under remat=save_dots the scan's backward reads them instead of running
        # the forward kernels again (k3jax.ops.remat_names); the inputs too, so that it does not
        # run the layer's conv, norm and gate again only to rebuild them
        kept = _Kept(*(checkpoint_name(x, KDA_INTERMEDIATES) for x in kept))
        inputs = tuple(None if x is None else checkpoint_name(x, KDA_INTERMEDIATES) for x in inputs)
    return out, (*inputs, kept)


def _core_bwd(st: _Static, res, cts):
    q, k, v, gc, beta, h0, r, kept = res
    do, dS = cts
    t, num, C = st.tuning, st.num, st.chunk
    if kept is None:  # recompute kernels 1 and 2 (what fla does)
        w, u, kg, qg, aqk, gam, ainv = intra.intra_chunk(q, k, v, gc, beta, r, scale=st.scale, chunk=C, num=num,
                                                         warps=t.warps_intra, want_ainv=True,
                                                         interpret=st.interpret, block_k=t.intra_block_k,
                                                         stages=t.stages_intra,
                                                         inverse_blocks=t.intra_inverse, split=t.intra_split,
                                                         warps_scores=t.warps_scores)
        _, h, v_new = state.state_forward(w, u, kg, qg, aqk, gam, h0, chunk=C, num=num, out_dtype=st.out_dtype,
                                          want_o=False, want_states=True, block=t.state_block_v,
                                          warps=t.warps_state, stages=t.stages_state, interpret=st.interpret)
    else:
        w, kg, qg, aqk, gam, ainv, h, v_new = kept
    do = do.astype(num.cd)
    dh, dv_new, dh0 = state.state_backward(w, kg, qg, aqk, gam, do, dS.astype(F32), chunk=C, num=num,
                                           block=t.state_block_v, warps=t.warps_state, stages=t.stages_state,
                                           interpret=st.interpret)
    dq1, dk1, dv, dg1, db1, d_aqk, d_l = grad.wy_grad(q, k, v, gc, beta, r, ainv, h, dh, do, v_new, dv_new,
                                                      scale=st.scale, chunk=C, num=num, dv_dtype=v.dtype,
                                                      warps=t.warps_grad, interpret=st.interpret,
                                                      block_k=t.grad_block_k)
    dq, dk, dG, db = grad.score_grad(q, k, gc, beta, d_aqk, d_l, dq1, dk1, dg1, db1, scale=st.scale, chunk=C,
                                     num=num, dq_dtype=q.dtype, dk_dtype=k.dtype, warps=t.warps_score,
                                     interpret=st.interpret, split_k=t.score_split_k)
    return dq, dk, dv, dG, db.astype(beta.dtype), (None if h0 is None else dh0.astype(h0.dtype)), None


_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------------------
# public entry


def chunk_delta_rule_fused(q, k, v, g, beta, *, decay, scale, initial_state=None, segment_ids=None,
                           chunk_size: int = 64, decay_bound=None, tuning: Tuning = Tuning(), interpret=None):
    """The fused-kernel form of `k3jax.ops.delta_rule.chunk_delta_rule` (delta rule only).

    Same contract: q, k [B,T,H,K], v [B,T,H,V], g [B,T,H,K] ("channel"), [B,T,H] ("scalar") or
    None, beta [B,T,H], initial_state [B,H,K,V], segment_ids [B,T]; returns (o [B,T,H,V] in v's
    dtype, S [B,H,K,V] fp32). The caller checks `unsupported_reason` first. interpret=None runs
    the kernels compiled on GPU and in the Pallas interpreter on CPU (tests)."""
    interpret = (_on_cpu() and planning_target() is None) if interpret is None else interpret
    fn = functools.partial(_fused_local, decay=decay, scale=scale, chunk_size=chunk_size,
                           decay_bound=decay_bound, tuning=tuning, interpret=interpret)
    mesh = active_mesh(required_axes=())
    if mesh is None:
        return fn(q, k, v, g, beta, initial_state, segment_ids)
    return _sharded(fn, mesh, q, k, v, g, beta, initial_state, segment_ids)


def _fused_local(q, k, v, g, beta, h0, segment_ids, *, decay, scale, chunk_size, decay_bound, tuning,
                 interpret):
    B, T, H, K = q.shape
    C = chunk_size
    low = all(jnp.dtype(x.dtype).itemsize < 4 for x in (q, k, v))
    num = Numerics.for_inputs(low, interpret)
    out_dtype = v.dtype
    q, k, v = (x.astype(num.cd) for x in (q, k, v))
    floor = LOG_DECAY_FLOOR if decay_bound is None else max(LOG_DECAY_FLOOR, float(decay_bound))
    if decay == "channel":
        g = jnp.maximum(g.astype(F32), floor)
    elif decay == "scalar":
        g = jnp.broadcast_to(jnp.maximum(g.astype(F32), floor)[..., None], (B, T, H, K))
    else:
        g = None  # DeltaNet: the kernels' static no-gate form (never a tensor of zeros)
    pad = (-T) % C
    Tp = T + pad
    padt = lambda x: x if not pad else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    q, k, v = map(padt, (q, k, v))
    beta = padt(beta.astype(F32))  # padding: beta = 0, k = v = 0, g = 0 -> no effect on the state
    if tuning.cumsum_kernel not in (0, 1):
        raise ValueError(f"KDA kernel tuning cumsum_kernel={tuning.cumsum_kernel}: 0 (XLA's cumsum) or 1 (a kernel)")
    gc = None
    if g is not None:
        # the in-chunk cumsum outside the custom_vjp: its transpose turns dG into dg. In XLA, or as
        # a Pallas kernel (Tuning.cumsum_kernel); computed inside kernel 1 it measured 1.4 ms slower
        # at 8x4096x16 (cross-warp scans and row picks)
        if tuning.cumsum_kernel and not triton_stand_in():
            gc = chunk_cumsum(padt(g), C, bool(interpret))
        else:
            gc = jnp.cumsum(padt(g).reshape(B, Tp // C, C, H, K), axis=2).reshape(B, Tp, H, K)
    r = None
    if segment_ids is not None:
        change = segment_starts(segment_ids)
        r = jnp.cumsum(padt(change).reshape(B, Tp // C, C).astype(jnp.int32), axis=2).reshape(B, Tp)
    h0 = None if h0 is None else h0.astype(F32)
    st = _Static(float(scale), C, num, out_dtype, tuning, bool(interpret))
    core = memory_stand_in if triton_stand_in() else _core
    o, S = core(q, k, v, gc, beta, h0, r, st)
    return o[:, :T], S


# --------------------------------------------------------------------------------------
# meshes: a pallas_call is one device's program, so run it per shard


def _sharded(fn, mesh, q, k, v, g, beta, h0, seg):
    """Rows over the batch axes (data, fsdp, expert), heads over `tensor`, as the layer's
    activations are laid out; the operator is independent per row and per head. Axes that do
    not divide a dimension replicate it."""
    B, _, H, _ = q.shape
    rows, heads = row_head_axes(mesh, B, H)
    x4 = P(rows, None, heads, None)
    specs = (x4, x4, x4, None if g is None else (x4 if g.ndim == 4 else P(rows, None, heads)),
             P(rows, None, heads), P(rows, heads, None, None), P(rows, None))
    full = (q, k, v, g, beta, h0, seg)
    present = [i for i, x in enumerate(full) if x is not None]

    def local(*xs):
        args = [None] * len(full)
        for i, x in zip(present, xs):
            args[i] = x
        return fn(*args)

    run = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs[i] for i in present),
                        out_specs=(x4, P(rows, heads, None, None)), check_vma=False)
    return run(*(full[i] for i in present))
