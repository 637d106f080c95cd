"""A decode step's routed experts in two kernels: routing, each routed expert's GLU, the weighted sum.

    u = routed_experts_decode(logits, bias, z, w1, w3, w2, top_k=8, scaling=1.0, glu=spec, dtype=bf16)

For a few tokens (k3jax/layers/moe_gather.py: a decode step), from the router's logits [N, E]
(fp32, x W_router) and the latent input z [N, l]:

    scores = sigmoid(logits);  topk = the top_k experts of scores + bias (ties: the lower index)
    w_j    = scores[topk_j] / (sum_j scores[topk_j] + 1e-20) * scaling          (k3jax/layers/router.py)
    h_j    = glu(z W1[topk_j], z W3[topk_j])        [N*k, H], in `dtype`         (kernel 1)
    u      = sum_j w_j (h_j W2[topk_j])             [N, l] fp32                   (kernel 2)

XLA ran this as about nine kernels per MoE layer at batch 1 (the sigmoid, the top-k's sort, the
weights' gather and division, the gathered projections, the GLU, the combine). Each program of
kernel 1 owns one (token, slot) pair and BH hidden columns, recomputes its token's routing (E
scores: a few reductions) and reads only its expert's columns of W1 and W3; each program of
kernel 2 owns one token and BL latent columns and sums its token's top_k experts' columns of W2.

Numerics as `routed_experts_gathered`: operands in `dtype`, products summed in fp32, the GLU's
inputs and output in `dtype`, the combine in fp32. Weights may be stacked over a stage's repeats
([L, E, ...] with `layers`), read in place (see gemv.py). E must be a power of two; l and H
multiples of 16. `routed_experts_decode_reference` is the plain form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from k3jax.ops.decode_kernels.common import block_dividing, glu_f32, index_operands

F32 = jnp.float32
TUNING = {"block_h": 64, "block_l": 32, "block_k": 128, "warps": 4}


def unsupported_reason(logits, z, w1) -> str | None:
    E, l, H = w1.shape[-3:]
    if E & (E - 1) or E < 2:
        return f"{E} experts: not a power of two"
    for name, n in (("latent width", l), ("expert hidden", H)):
        if block_dividing(n) is None:
            return f"{name} {n} is not a multiple of 16"
    if logits.shape[-1] != E or z.shape[-1] != l:
        return f"logits {logits.shape} / z {z.shape} do not match experts {w1.shape}"
    return None


def _route(logits_ref, bias_ref, lb, E, top_k, scaling):
    """This token's (experts [top_k] int32 scalars, weights [top_k] fp32 scalars), as Router."""
    scores = jax.nn.sigmoid(logits_ref[...].astype(F32))  # [E]
    biased = scores + bias_ref[lb, :].astype(F32)
    iota = jax.lax.broadcasted_iota(jnp.int32, (E,), 0)
    experts, picked = [], []
    for _ in range(top_k):
        top = jnp.max(biased)
        e = jnp.min(jnp.where(biased == top, iota, E))  # the first of equal scores, as lax.top_k
        experts.append(e)
        picked.append(jnp.sum(jnp.where(iota == e, scores, 0.0)))
        biased = jnp.where(iota == e, -jnp.inf, biased)
    total = picked[0]
    for p in picked[1:]:
        total = total + p
    return experts, [p / (total + 1e-20) * scaling for p in picked]


def _up_kernel(*refs, n_idx, pos, E, l, BK, top_k, scaling, glu, dtype):
    """Grid (pair p = n*top_k + j, hidden block). refs: n_idx index operands [1] (layers of w1,
    w3, w2, bias at `pos`); logits_ref [E], z_ref [l] (token n); bias_ref [Lb, E]; w1/w3_ref
    [L, E, l, BH]; h_ref [BH] (pair p)."""
    idx_refs = refs[:n_idx]
    logits_ref, bias_ref, z_ref, w1_ref, w3_ref, h_ref = refs[n_idx:]
    l1, l3, lb = (idx_refs[pos[i]][0] for i in (0, 1, 3))
    j = pl.program_id(0) % top_k
    experts, _ = _route(logits_ref, bias_ref, lb, E, top_k, scaling)
    e = experts[0]
    for s in range(1, top_k):
        e = jnp.where(j == s, experts[s], e)
    BH = h_ref.shape[0]
    rnd = lambda a: a.astype(dtype).astype(F32)  # noqa: E731

    def body(kb, acc):
        a, b = acc
        rows = pl.ds(pl.multiple_of(kb * BK, BK), BK)
        zk = rnd(z_ref[rows])[:, None]
        return (a + jnp.sum(zk * rnd(w1_ref[l1, e, rows, :]), axis=0),
                b + jnp.sum(zk * rnd(w3_ref[l3, e, rows, :]), axis=0))

    a, b = jax.lax.fori_loop(0, l // BK, body, (jnp.zeros((BH,), F32), jnp.zeros((BH,), F32)))
    h_ref[...] = glu_f32(glu, rnd(a), rnd(b)).astype(h_ref.dtype)


def _down_kernel(*refs, n_idx, pos, E, H, BK, top_k, scaling):
    """Grid (token n, latent block). refs: the index operands, logits_ref [E], bias_ref, h_ref
    [top_k, H] (token n's pairs), w2_ref [L, E, H, BL], u_ref [BL]."""
    idx_refs = refs[:n_idx]
    logits_ref, bias_ref, h_ref, w2_ref, u_ref = refs[n_idx:]
    l2, lb = (idx_refs[pos[i]][0] for i in (2, 3))
    experts, weights = _route(logits_ref, bias_ref, lb, E, top_k, scaling)
    BL = u_ref.shape[0]
    u = jnp.zeros((BL,), F32)
    for s in range(top_k):
        def body(kb, acc, s=s):
            rows = pl.ds(pl.multiple_of(kb * BK, BK), BK)
            w = w2_ref[l2, experts[s], rows, :].astype(h_ref.dtype).astype(F32)
            return acc + jnp.sum(h_ref[s, rows].astype(F32)[:, None] * w, axis=0)

        u = u + weights[s] * jax.lax.fori_loop(0, H // BK, body, jnp.zeros((BL,), F32))
    u_ref[...] = u


def routed_experts_decode(logits, bias, z, w1, w3, w2, *, top_k: int, scaling: float, glu: tuple, dtype,
                          layers=None, interpret: bool = False):
    """The kernels (module docstring). logits [N, E] fp32, bias [E] or [Lb, E], z [N, l];
    w1 / w3 [E, l, H] or [L, E, l, H], w2 [E, H, l] or [L, E, H, l]; layers: (w1, w3, w2, bias)
    layers of the stacked ones. -> u [N, l] fp32."""
    why = unsupported_reason(logits, z, w1)
    if why:
        raise ValueError(f"routed_experts_decode: {why}")
    w1, w3, w2 = (w if w.ndim == 4 else w[None] for w in (w1, w3, w2))
    bias = bias if bias.ndim == 2 else bias[None]
    N, E = logits.shape
    l, H = w1.shape[-2:]
    idx, pos = index_operands(layers or (0, 0, 0, 0))
    ix = [pl.BlockSpec((1,), lambda *_: (0,))] * len(idx)
    BH = block_dividing(H, (TUNING["block_h"], 32, 16))
    BL = block_dividing(l, (TUNING["block_l"], 16))
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731
    params = pltr.CompilerParams(num_warps=TUNING["warps"], num_stages=2)
    up = functools.partial(_up_kernel, n_idx=len(idx), pos=tuple(pos), E=E, l=l,
                           BK=block_dividing(l, (TUNING["block_k"], 64, 32, 16)),
                           top_k=top_k, scaling=float(scaling), glu=glu, dtype=jnp.dtype(dtype))
    h = pl.pallas_call(
        up,
        out_shape=jax.ShapeDtypeStruct((N * top_k, H), dtype),
        grid=(N * top_k, H // BH),
        in_specs=ix + [pl.BlockSpec((None, E), lambda p, c: (p // top_k, 0)), full(bias),
                  pl.BlockSpec((None, l), lambda p, c: (p // top_k, 0)),
                  pl.BlockSpec(w1.shape[:3] + (BH,), lambda p, c: (0, 0, 0, c)),
                  pl.BlockSpec(w3.shape[:3] + (BH,), lambda p, c: (0, 0, 0, c))],
        out_specs=pl.BlockSpec((None, BH), lambda p, c: (p, c)),
        compiler_params=params, interpret=interpret, name="moe_experts_up",
    )(*idx, logits, bias, z, w1, w3)
    down = functools.partial(_down_kernel, n_idx=len(idx), pos=tuple(pos), E=E, H=H,
                             BK=block_dividing(H, (TUNING["block_k"], 64, 32, 16)),
                             top_k=top_k, scaling=float(scaling))
    return pl.pallas_call(
        down,
        out_shape=jax.ShapeDtypeStruct((N, l), F32),
        grid=(N, l // BL),
        in_specs=ix + [pl.BlockSpec((None, E), lambda n, c: (n, 0)), full(bias),
                  pl.BlockSpec((None, top_k, H), lambda n, c: (n, 0, 0)),
                  pl.BlockSpec(w2.shape[:3] + (BL,), lambda n, c: (0, 0, 0, c))],
        out_specs=pl.BlockSpec((None, BL), lambda n, c: (n, c)),
        compiler_params=params, interpret=interpret, name="moe_experts_down",
    )(*idx, logits, bias, h.reshape(N, top_k, H), w2)


def routed_experts_decode_reference(logits, bias, z, w1, w3, w2, *, top_k: int, scaling: float, glu: tuple, dtype,
                                    layers=None):
    """The plain form: Router's selection and weights, then every pair's GLU MLP, weighted."""
    layers = layers or (0, 0, 0, 0)
    pick = lambda a, i, n: a if a.ndim == n else a[i]  # noqa: E731
    w1, w3, w2 = pick(w1, layers[0], 3), pick(w3, layers[1], 3), pick(w2, layers[2], 3)
    bias = pick(bias, layers[3], 1)
    scores = jax.nn.sigmoid(logits.astype(F32))
    _, experts = jax.lax.top_k(scores + bias.astype(F32), top_k)
    picked = jnp.take_along_axis(scores, experts, axis=-1)
    weights = picked / (jnp.sum(picked, -1, keepdims=True) + 1e-20) * scaling
    rnd = lambda a: a.astype(dtype).astype(F32)  # noqa: E731
    hp = jax.lax.Precision.HIGHEST
    zp = rnd(z)[:, None, :]  # [N, 1, l]
    a = jnp.einsum("nxl,nklh->nkh", zp, rnd(w1[experts]), precision=hp)
    b = jnp.einsum("nxl,nklh->nkh", zp, rnd(w3[experts]), precision=hp)
    h = rnd(glu_f32(glu, rnd(a), rnd(b)))
    out = jnp.einsum("nkh,nkhl->nkl", h, rnd(w2[experts]), precision=hp)
    return jnp.einsum("nk,nkl->nl", weights, out, precision=hp)
