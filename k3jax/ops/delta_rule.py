"""One chunked / recurrent pair for the whole linear-attention lineage.

Per token t and head, with state S in R^{K x V} (fp32):

    S <- 0                               if segment_ids changes between t-1 and t
    S <- Diag(exp(g_t)) S                decay: per channel [K], per head (scalar), or none
    u <- beta_t (v_t - S^T k_t)          delta rule   (linear attention: u <- v_t)
    S <- S + k_t u^T
    o_t = S^T (scale q_t)

`recurrent_delta_rule` is that loop (a `lax.scan` over tokens): the decode path and
the reference. `chunk_delta_rule` is the chunkwise-parallel WY/UT form (that of fla's
`naive_chunk_kda`): an fp32 `lax.scan` carries the state across chunks; everything inside
a chunk is batched over all chunks at once.

The UT transform (I + L)^-1 merges diagonal blocks in log-depth rounds of matmuls
(`unit_lower_inverse`), stable for any keys.

Numerics. Decays only ever appear as exp(G_i - G_j) with i >= j, never as
exp(G_i) * exp(-G_j). For per-channel decay the chunk is cut into 16-token
sub-blocks: off-diagonal blocks factor through the first row r of the later block,
exp(G_i - G_r) * exp(G_r - G_j), both factors <= 1. While no 16-token block decays by
more than SAFE_SPAN the diagonal blocks factor the same way (two matmuls for the whole
chunk); otherwise they use the exact pairwise [16, 16, K] masked form, exact for any
g <= 0. The choice is made at run time, or statically when the caller passes the gate's
lower bound (`decay_bound`; K3's gate: -5, so 15 x 5 < 80).

Log-decays are clamped at LOG_DECAY_FLOOR (and at decay_bound, when given) before the
in-chunk cumsum. exp(-80) is below fp32 resolution relative to anything else in the
state, so the outputs are unchanged, but -inf gates no longer make inf - inf = NaN, and
a huge gate no longer costs the cumsum its precision. The recurrent form applies the
gate unclamped except at decay_bound.
"""

from __future__ import annotations

import functools
from typing import Literal, Optional

import jax
import jax.numpy as jnp

from k3jax.segments import segment_starts

Decay = Optional[Literal["channel", "scalar"]]

LOG_DECAY_FLOOR = -80.0
SUB_BLOCK = 16
SAFE_SPAN = 80.0  # exp(80) ~ 5.5e34 < fp32 max ~ 3.4e38: room for the product with a_s
_HI = jax.lax.Precision.HIGHEST  # the reference path keeps fp32 matmuls exact on every backend


def _mm(spec: str, *xs, precision=_HI):
    return jnp.einsum(spec, *xs, precision=precision)


def matmul_precision(*xs):
    """fp32 (or fp64) inputs: exact fp32 matmuls (the reference numerics the tests check).
    bf16/fp16 inputs: the backend's default for fp32 operands (TF32 on NVIDIA GPUs, like
    fla's Triton dots); accumulation, decays, states and the UT inverse stay fp32 either way."""
    low = any(x is not None and jnp.dtype(x.dtype).itemsize < 4 for x in xs)
    return jax.lax.Precision.DEFAULT if low else _HI


def acc_dtype(*xs):
    """fp32, or fp64 when given fp64 inputs (x64 mode): the state never drops below fp32."""
    return jnp.result_type(jnp.float32, *[x.dtype for x in xs if x is not None])


# --------------------------------------------------------------------------------------
# input checks


def check_inputs(name: str, q, k, v, g, beta, decay: Decay, initial_state, segment_ids, *, delta: bool):
    """Validate shapes with messages that name the argument, before any JAX tracing."""
    if q.ndim != 4:
        raise ValueError(f"{name}: q must be [B,T,H,K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{name}: k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)} [B,T,H,K]")
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"{name}: v must be [B,T,H,V] = [{B},{T},{H},V], got {tuple(v.shape)}")
    V = v.shape[-1]
    if decay == "channel" and (g is None or g.shape != (B, T, H, K)):
        raise ValueError(f"{name}: g must be the per-channel log-decay [B,T,H,K] = {(B, T, H, K)}, "
                         f"got {None if g is None else tuple(g.shape)}")
    if decay == "scalar" and (g is None or g.shape != (B, T, H)):
        raise ValueError(f"{name}: g must be the per-head log-decay [B,T,H] = {(B, T, H)}, "
                         f"got {None if g is None else tuple(g.shape)}")
    if delta and (beta is None or beta.shape != (B, T, H)):
        raise ValueError(f"{name}: beta must be [B,T,H] = {(B, T, H)}, got {None if beta is None else tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"{name}: initial_state must be [B,H,K,V] = {(B, H, K, V)}, got {tuple(initial_state.shape)}")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"{name}: segment_ids must be [B,T] = {(B, T)}, got {tuple(segment_ids.shape)}")


# --------------------------------------------------------------------------------------
# recurrent form (reference and decode)


def recurrent_delta_rule(q, k, v, g, beta, *, decay: Decay, delta: bool = True, scale=None,
                         initial_state=None, segment_ids=None, decay_bound: float | None = None,
                         name: str = "recurrent_delta_rule"):
    """Token-by-token scan. Shapes as in the module docstring; returns (o [B,T,H,V], S [B,H,K,V] fp32).
    decay_bound: as in `chunk_delta_rule` (g is clamped to it)."""
    check_inputs(name, q, k, v, g, beta, decay, initial_state, segment_ids, delta=delta)
    B, _, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    acc = acc_dtype(q, k, v, g, beta, initial_state)
    S0 = jnp.zeros((B, H, K, V), acc) if initial_state is None else initial_state.astype(acc)
    reset = None if segment_ids is None else segment_starts(segment_ids)
    xs = {
        "q": jnp.moveaxis(q.astype(acc) * scale, 1, 0),
        "k": jnp.moveaxis(k.astype(acc), 1, 0),
        "v": jnp.moveaxis(v.astype(acc), 1, 0),
    }
    if decay is not None:
        g = g.astype(acc) if decay_bound is None else jnp.maximum(g.astype(acc), decay_bound)
        xs["g"] = jnp.moveaxis(g, 1, 0)
    if delta:
        xs["beta"] = jnp.moveaxis(beta.astype(acc), 1, 0)
    if reset is not None:
        xs["reset"] = jnp.moveaxis(reset, 1, 0)

    def step(S, x):
        if "reset" in x:
            S = jnp.where(x["reset"][:, None, None, None], 0.0, S)
        if decay == "channel":
            S = jnp.exp(x["g"])[..., None] * S
        elif decay == "scalar":
            S = jnp.exp(x["g"])[..., None, None] * S
        if delta:
            pred = _mm("bhkv,bhk->bhv", S, x["k"])
            u = x["beta"][..., None] * (x["v"] - pred)
        else:
            u = x["v"]
        S = S + x["k"][..., :, None] * u[..., None, :]
        o = _mm("bhkv,bhk->bhv", S, x["q"])
        return S, o

    S, o = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), S


# --------------------------------------------------------------------------------------
# chunkwise-parallel form


def unit_lower_inverse(L, precision=_HI):
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], by merging diagonal blocks.

    Blocks of s rows, each holding its exact inverse, merge in pairs into blocks of 2s rows:
    for I + L = [[A, 0], [M, B]] the inverse is [[A^-1, 0], [-B^-1 M A^-1, B^-1]], which is
    T - T M' T with T the two blocks' inverses side by side and M' = L on (second half of the
    pair, first half) only. Pairs of single rows merge elementwise (T = I - L there), then
    log2(C) - 1 rounds of two matmuls each: 10 at C = 64.

    Diverges from ../shared/design/kda-kernel-plan.md (F1), which inverts the diagonal blocks
    by the doubling series. Why not the series (I + N)(I + N^2)(I + N^4)... (N = -L): its partial sums are sums of
    powers of N, whose entries grow like binomials (up to ~C(C-1, C/2) beta^(C/2)) when rows of
    L are alike (correlated keys, no decay) and cancel to an inverse of entries <= 1. At C = 64
    fp32 then lost every digit (keys of mean cosine 0.6, beta ~ 0.9: inverse error 1.3e3; TF32:
    3.6e7), and DeltaNet's training went to NaN. Every product here is of true inverses of
    sub-blocks and true blocks of L, all of size ~1: TF32 products keep ~1e-3.

    Matmuls rather than a triangular-solve custom call: faster on GPU for many small blocks,
    and the LAPACK trsm call inside a rematerialised scan deadlocked XLA:CPU (jax 0.10.2).
    """
    C = L.shape[-1]
    i = jnp.arange(C)
    inv = jnp.eye(C, dtype=L.dtype) - jnp.where((i[:, None] // 2 == i[None, :] // 2), L, 0.0)
    s = 2
    while s < C:
        pair, half = i // (2 * s), (i // s) % 2
        lower_left = (pair[:, None] == pair[None, :]) & (half[:, None] == 1) & (half[None, :] == 0)
        link = _mm("...ij,...jk->...ik", jnp.where(lower_left, L, 0.0), inv, precision=precision)
        inv = inv - _mm("...ij,...jk->...ik", inv, link, precision=precision)
        s *= 2
    return inv


def _causal(C: int, strict: bool):
    i = jnp.arange(C)
    return (i[:, None] > i[None, :]) if strict else (i[:, None] >= i[None, :])


def _blocks(a, b, G):
    """Split the C rows into 16-row blocks: (ab, bb, Gb [.., nb, S, K], ref [.., nb, K], a_s)."""
    C, K = a.shape[-2:]
    S = SUB_BLOCK if C % SUB_BLOCK == 0 else C
    lead = a.shape[:-2]
    ab, bb, Gb = (x.reshape(*lead, C // S, S, K) for x in (a, b, G))
    ref = Gb[..., 0, :]
    return ab, bb, Gb, ref, ab * jnp.exp(Gb - ref[..., None, :])


def _factored_scores(a, b, G, strict: bool, precision):
    """Two matmuls through each block's first row; exact while every block span < SAFE_SPAN."""
    C = a.shape[-2]
    _, _, _, ref, a_s = _blocks(a, b, G)
    b_s = b[..., None, :, :] * jnp.exp(jnp.minimum(ref[..., :, None, :] - G[..., None, :, :], SAFE_SPAN))
    full = _mm("...nik,...njk->...nij", a_s, b_s, precision=precision).reshape(*a.shape[:-2], C, C)
    return jnp.where(_causal(C, strict), full, 0.0)


def _pairwise_scores(a, b, G, strict: bool, precision):
    """Exact pairwise [16, 16, K] decays on the diagonal blocks, factored form off them."""
    C = a.shape[-2]
    ab, bb, Gb, ref, a_s = _blocks(a, b, G)
    nb, S = ab.shape[-3], ab.shape[-2]
    lead = a.shape[:-2]
    tri = _causal(S, strict)[:, :, None]
    pair = jnp.exp(jnp.where(tri, Gb[..., :, None, :] - Gb[..., None, :, :], -jnp.inf))
    diag = _mm("...nik,...njk,...nijk->...nij", ab, bb, pair, precision=precision)
    out = _mm("...nij,nm->...nimj", diag, jnp.eye(nb, dtype=a.dtype)).reshape(*lead, C, C)
    if nb == 1:
        return out
    blk = jnp.arange(C) // S
    b_s = b[..., None, :, :] * jnp.exp(jnp.minimum(ref[..., :, None, :] - G[..., None, :, :], 0.0))
    off = _mm("...nik,...njk->...nij", a_s, b_s, precision=precision).reshape(*lead, C, C)
    return out + jnp.where(blk[:, None] > blk[None, :], off, 0.0)


def _all_spans_safe(G):
    S = SUB_BLOCK if G.shape[-2] % SUB_BLOCK == 0 else G.shape[-2]
    Gb = G.reshape(*G.shape[:-2], G.shape[-2] // S, S, G.shape[-1])
    return jnp.max(Gb[..., 0, :] - Gb[..., -1, :]) < SAFE_SPAN  # largest decay inside one block


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _branching_scores(a, b, G, strict: bool, precision):
    fac, pair = (functools.partial(f, strict=strict, precision=precision) for f in (_factored_scores, _pairwise_scores))
    return jax.lax.cond(_all_spans_safe(G), fac, pair, a, b, G)


def _branching_fwd(a, b, G, strict, precision):
    return _branching_scores(a, b, G, strict, precision), (a, b, G)


def _branching_bwd(strict, precision, res, ct):
    # the backward pass takes the same branch and differentiates only it; plain autodiff of
    # lax.cond would keep the residuals of both branches (all [16, 16, K] pairwise decays)
    def vjp(fn):
        return lambda a, b, G: jax.vjp(lambda *x: fn(*x, strict=strict, precision=precision), a, b, G)[1](ct)

    a, b, G = res
    return jax.lax.cond(_all_spans_safe(G), vjp(_factored_scores), vjp(_pairwise_scores), a, b, G)


_branching_scores.defvjp(_branching_fwd, _branching_bwd)


def _channel_scores(a, b, G, strict: bool, precision=_HI, always_safe: bool = False):
    """[..., C, C]: sum_c a_ic b_jc exp(G_ic - G_jc) on j < i (strict) or j <= i; 0 elsewhere.

    a, b, G: [..., C, K], G non-increasing along C (a cumulative log-decay). Every 16-row
    block I factors through its first row r: exp(G_i - G_r) * exp(G_r - G_j). For j before the
    block both factors are <= 1. Inside the block exp(G_r - G_j) >= 1 grows with the block's
    decay span; while every span stays under SAFE_SPAN (always true for K3's gate, g >= -5:
    15 x 5 < 80) the whole matrix is two matmuls. Otherwise the diagonal blocks take the exact
    pairwise [16, 16, K] form. The choice is a runtime `lax.cond` on the data (with its own
    VJP, so the backward pass keeps only the inputs), unless the caller proved every span
    safe (`always_safe`, from a gate's lower bound): then there is no branch at all.
    """
    if always_safe:
        return _factored_scores(a, b, G, strict, precision)
    return _branching_scores(a, b, G, strict, precision)


def _scores(a, b, G, decay: Decay, strict: bool, precision=_HI, always_safe: bool = False):
    C = a.shape[-2]
    if decay == "channel":
        return _channel_scores(a, b, G, strict, precision, always_safe)
    dots = _mm("...ik,...jk->...ij", a, b, precision=precision)
    mask = _causal(C, strict)
    if decay == "scalar":
        return dots * jnp.exp(jnp.where(mask, G[..., :, None] - G[..., None, :], -jnp.inf))
    return jnp.where(mask, dots, 0.0)


def _intra_chunk(q, k, v, G, beta, r, *, decay: Decay, delta: bool, precision=_HI, always_safe: bool = False):
    """Everything that is parallel over chunks. Inputs [B,H,N,C,*] fp32, r [B,1,N,C] segment counters.

    Returns the UT/WY factors and the chunk-local operators used by the state scan.
    """
    same = r[..., :, None] == r[..., None, :]  # no segment start between j and i
    sees = (r == 0)[..., None]  # row still sees the chunk's incoming state
    last_same = (r == r[..., -1:])[..., None]  # row contributes to the outgoing state

    if decay == "channel":
        gamma = jnp.exp(G)  # G <= 0: safe
        k_out = k * jnp.exp(G[..., -1:, :] - G)
        keep = gamma[..., -1, :]
    elif decay == "scalar":
        gamma = jnp.exp(G)[..., None]
        k_out = k * jnp.exp(G[..., -1:] - G)[..., None]
        keep = jnp.broadcast_to(gamma[..., -1, :], q.shape[:-2] + (q.shape[-1],))
    else:
        gamma = jnp.ones_like(q[..., :1])
        k_out = k
        keep = jnp.ones(q.shape[:-2] + (q.shape[-1],), q.dtype)
    keep = keep * sees[..., -1, :]  # a segment start inside the chunk drops the incoming state
    k_out = jnp.where(last_same, k_out, 0.0)
    q_in = jnp.where(sees, q * gamma, 0.0)

    A_qk = jnp.where(same, _scores(q, k, G, decay, strict=False, precision=precision, always_safe=always_safe), 0.0)
    if delta:
        L = jnp.where(same, _scores(k, k, G, decay, strict=True, precision=precision, always_safe=always_safe),
                      0.0) * beta[..., :, None]
        k_in = jnp.where(sees, k * gamma, 0.0)
        rhs = beta[..., None] * jnp.concatenate([k_in, v], axis=-1)
        # the UT inverse stays exact fp32: it is where the delta rule's conditioning lives
        X = _mm("...ij,...jk->...ik", unit_lower_inverse(L), rhs, precision=precision)
        W, U = X[..., : q.shape[-1]], X[..., q.shape[-1]:]
    else:
        W, U = None, v
    return W, U, A_qk, q_in, k_out, keep


def _state_pass(S0, xs, *, delta: bool, associative: bool, precision):
    """States entering each chunk and the corrected values, chunks first ([N, B, H, ...]).

    Each chunk maps S -> A S + b with A = diag(keep) - k_out^T W and b = k_out^T U. The
    sequential form is a `lax.scan` (N dependent steps of small matmuls); the associative
    form composes the maps in log2(N) rounds of batched [K, K] matmuls, which wins when N is
    large (long sequences, few batch x heads) and the scan's steps are latency-bound.
    """
    mm = lambda spec, *a: _mm(spec, *a, precision=precision)  # noqa: E731
    if not associative:
        def step(S, x):
            U_true = x["U"] - mm("bhck,bhkv->bhcv", x["W"], S) if delta else x["U"]
            S_next = x["keep"][..., None] * S + mm("bhck,bhcv->bhkv", x["k_out"], U_true)
            return S_next, (S, U_true)
        S, (h, U_true) = jax.lax.scan(step, S0, xs)
        return h, U_true, S

    K = S0.shape[-2]
    A = xs["keep"][..., :, None] * jnp.eye(K, dtype=S0.dtype)
    if delta:
        A = A - mm("nbhck,nbhcj->nbhkj", xs["k_out"], xs["W"])
    b = mm("nbhck,nbhcv->nbhkv", xs["k_out"], xs["U"])

    def compose(first, second):  # apply `first`, then `second`
        (A1, b1), (A2, b2) = first, second
        return mm("...ij,...jk->...ik", A2, A1), mm("...ij,...jv->...iv", A2, b1) + b2

    A_cum, b_cum = jax.lax.associative_scan(compose, (A, b), axis=0)
    after = mm("nbhij,bhjv->nbhiv", A_cum, S0) + b_cum  # state after each chunk
    h = jnp.concatenate([S0[None], after[:-1]], axis=0)
    U_true = xs["U"] - mm("nbhck,nbhkv->nbhcv", xs["W"], h) if delta else xs["U"]
    return h, U_true, after[-1]


IMPLS = ("auto", "pallas", "xla")


def select_impl(impl: str, q, v, *, decay: Decay, delta: bool, decay_bound, chunk_size: int,
                name: str = "chunk_delta_rule") -> str:
    """"pallas" or "xla": which form of the chunked operator runs these inputs.

    auto: the fused kernels on GPU when they support the inputs (a static gate bound with
    15 |bound| < 80 or no decay, power-of-two head dims, chunk 16/32/64), else XLA, with one log
    line saying why; CPU and TPU always take XLA. pallas: the kernels, or a ValueError naming
    what they cannot run (on CPU they run in the Pallas interpreter: tests). xla: plain XLA."""
    from k3jax.ops.kda_kernels import (
        op as fused,  # the kernels import Pallas: only when asked
    )
    from k3jax.ops.planning import target_backend

    if impl not in IMPLS:
        raise ValueError(f"{name}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        return "xla"
    reason = fused.unsupported_reason(q, v, decay=decay, delta=delta, decay_bound=decay_bound,
                                      chunk_size=chunk_size)
    if impl == "pallas":
        if reason:
            raise ValueError(f"{name}: impl='pallas' cannot run these inputs: {reason}. "
                             "Use impl='auto' (falls back to XLA) or 'xla'.")
        return "pallas"
    if target_backend() != "gpu":
        return "xla"
    if reason:
        fused.log_once(f"{name}: XLA path on GPU ({reason})")
        return "xla"
    fused.log_once(f"{name}: fused Pallas kernels")
    return "pallas"


def chunk_delta_rule(q, k, v, g, beta, *, decay: Decay, delta: bool = True, scale=None, initial_state=None,
                     segment_ids=None, chunk_size: int = 64, state_pass: str = "auto",
                     decay_bound: float | None = None, impl: str = "auto", tuning=None,
                     name: str = "chunk_delta_rule"):
    """Chunkwise-parallel form; same contract and results as `recurrent_delta_rule`.

    impl: "auto" | "pallas" | "xla" (see `select_impl`); tuning: the kernels' launch
    parameters (`k3jax.ops.kda_kernels.Tuning`), None for the defaults.

    decay_bound: a lower bound the caller guarantees for g (K3's gate: g > -5). When 15 steps
    of it stay under SAFE_SPAN the per-channel scores take the two-matmul form statically
    (no runtime branch, far less memory under autodiff). g is clamped to the bound, so a
    broken promise gives the bounded gate's result, never an overflow.

    state_pass: "scan" (sequential over chunks), "associative" (log-depth), or "auto"
    (associative beyond 256 chunks per batch x head: measured faster on an H200 at 1024, equal at
    256, slower at 64).
    """
    check_inputs(name, q, k, v, g, beta, decay, initial_state, segment_ids, delta=delta)
    if chunk_size <= 0 or (chunk_size > SUB_BLOCK and chunk_size % SUB_BLOCK):
        raise ValueError(f"{name}: chunk_size must be <= {SUB_BLOCK} or a multiple of it, got {chunk_size}")
    if select_impl(impl, q, v, decay=decay, delta=delta, decay_bound=decay_bound, chunk_size=chunk_size,
                   name=name) == "pallas":
        from k3jax.ops.kda_kernels import Tuning, chunk_delta_rule_fused

        return chunk_delta_rule_fused(q, k, v, g, beta, decay=decay, scale=q.shape[-1] ** -0.5 if scale is None else scale,
                                      initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size,
                                      decay_bound=decay_bound, tuning=tuning or Tuning())
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    acc = acc_dtype(q, k, v, g, beta, initial_state)
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C

    reset = None if segment_ids is None else segment_starts(segment_ids)
    if reset is None:
        reset = jnp.zeros((B, T), bool)

    def chunks(x, fill=0.0):
        """[B,T,H,*] -> [B,H,N,C,*] fp32, zero-padded (padding has beta = 0 and g = 0: a no-op)."""
        x = x.astype(acc) if x.dtype != bool else x
        if pad:
            x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        x = x.reshape(B, N, C, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1) if x.ndim >= 4 else x

    qc, kc, vc = chunks(q) * scale, chunks(k), chunks(v)
    r = jnp.cumsum(chunks(reset).astype(jnp.int32), axis=-1)[:, None]  # [B,1,N,C]
    G = None
    if decay is not None:
        floor = LOG_DECAY_FLOOR if decay_bound is None else max(LOG_DECAY_FLOOR, float(decay_bound))
        gc = chunks(jnp.maximum(g.astype(acc), floor))
        G = jnp.cumsum(gc, axis=3)  # per chunk only, never across the sequence
    bc = chunks(beta) if delta else None

    # Recompute the intra-chunk tensors in the backward pass instead of storing the pairwise
    # decays. prevent_cse=False: the optimisation barrier it would add deadlocked XLA:CPU
    # (jax 0.10.2) in a model with two KDA layers; inside the layer scan CSE cannot merge
    # the recomputation away anyway.
    prec = matmul_precision(q, k, v)
    # rows of one 16-token block span at most SUB_BLOCK - 1 decay steps
    always_safe = decay_bound is not None and (SUB_BLOCK - 1) * -float(decay_bound) < SAFE_SPAN
    intra = jax.checkpoint(lambda *a: _intra_chunk(*a, decay=decay, delta=delta, precision=prec,
                                                   always_safe=always_safe), prevent_cse=False)
    W, U, A_qk, q_in, k_out, keep = intra(qc, kc, vc, G, bc, r)

    S0 = jnp.zeros((B, H, K, V), acc) if initial_state is None else initial_state.astype(acc)
    xs = {"U": U, "k_out": k_out, "keep": keep}
    if delta:
        xs["W"] = W
    xs = jax.tree.map(lambda x: jnp.moveaxis(x, 2, 0), xs)  # chunks first
    if state_pass not in ("auto", "scan", "associative"):
        raise ValueError(f"{name}: state_pass must be auto, scan or associative, got {state_pass!r}")
    associative = state_pass == "associative" or (state_pass == "auto" and N > 256)
    h, U_true, S = _state_pass(S0, xs, delta=delta, associative=associative, precision=prec)
    h, U_true = jnp.moveaxis(h, 0, 2), jnp.moveaxis(U_true, 0, 2)  # [B,H,N,K,V], [B,H,N,C,V]
    o = (_mm("bhnck,bhnkv->bhncv", q_in, h, precision=prec)
         + _mm("bhnij,bhnjv->bhniv", A_qk, U_true, precision=prec))
    o = jnp.moveaxis(o, 1, 3).reshape(B, N * C, H, V)[:, :T]
    return o.astype(v.dtype), S
