"""A decode step's projections: a few rows times several weights that share them, in one launch.

    ys = fused_gemv(x, [w_q, w_k, w_v], dtypes=(bf16, bf16, bf16))             # -> [y_i [M, N_i] fp32]
    ys = fused_gemv(x, [w_router, w_down], dtypes=(f32, bf16), norm=gamma, eps=1e-6)

x [M, K] with M <= MAX_ROWS (a decode step's tokens); w_i [K, N_i]. Segment i rounds both
operands to dtypes[i] (the layer's compute dtype; fp32 for the router), multiplies in fp32 and
accumulates in fp32: the numerics of a dot with preferred_element_type=fp32 (products of bf16
operands are exact in fp32). With `norm` (gamma [K]) x is RMS-normalised first, with RMSNorm's
numerics (k3jax/layers/norms.py: the statistic in fp32, the normalised value cast to x's dtype,
then times gamma in x's dtype); `return_normed` also returns that normalised x [M, K].

Why a kernel: at M = 1 XLA:GPU rewrites a dot as a multiply and a reduction, and its cost model
often keeps them apart (benchmarks/results/decode-fused-2026-12-01/README.md): two kernels per
projection, and the [K, N] product written to memory and read back, three times the weight's bytes.
Here each program owns a block of BN output columns of one segment and streams that block of its
weight once, BK rows at a time, as elementwise products summed over K (no dot: a single row cannot
fill a tensor-core tile). Grid: the column blocks of every segment, one after the other; a program
runs the one segment its index falls in (`pl.when`), and each weight's and output's block index is
clamped into range for the programs of the other segments (which neither read nor write them).

Stacked weights: a weight may be given as [L, K, N_i] with `layers[i]` (int32 scalar) picking
the slice, read in place (a decode step's scan over a stage's repeats slices its parameters per
repeat; XLA copies such a slice before a custom call, reading and writing the weight once more).
gamma likewise [L, K] with `norm_layer`.

Limits (Pallas-Triton, see common.py): K a multiple of 16 and N_i of 16 (blocks are powers of
two). `unsupported_reason` says why not; callers fall back to XLA.

`fused_gemv_reference` is the plain form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from k3jax.ops.decode_kernels.common import glu_f32, index_operands

F32 = jnp.float32
MAX_ROWS = 4  # rows the kernel takes; more rows make a matrix product, which XLA does well
TARGET_PROGRAMS = 264  # two per SM of an H200: column blocks shrink (down to 16) to reach this
# launch parameters (no autotuner in Pallas-Triton); benchmarks may override them
TUNING = {"block_n": 64, "block_k": 128, "warps": 4, "stages": 2}


def _pow2_dividing(n: int, cap: int, floor: int = 16) -> int | None:
    b = cap
    while b >= floor:
        if n % b == 0:
            return b
        b //= 2
    return None


def unsupported_reason(x, weights) -> str | None:
    """Why the kernel cannot take these operands (None when it can). weights: [K, N] or [L, K, N]."""
    if x.ndim != 2:
        return f"x must be [rows, K], got {x.shape}"
    M, K = x.shape
    if M > MAX_ROWS:
        return f"{M} rows > {MAX_ROWS}"
    if _pow2_dividing(K, 512) is None:
        return f"K={K} is not a multiple of 16"
    for w in weights:
        if w.ndim not in (2, 3) or w.shape[-2] != K:
            return f"weight {w.shape} does not take K={K}"
        if _pow2_dividing(w.shape[-1], 16) is None:
            return f"N={w.shape[-1]} is not a multiple of 16"
    return None


def _blocks_n(ns: list[int]) -> list[int]:
    """Each segment's column block: TUNING's, halved (not below 16) until the programs of all
    segments reach TARGET_PROGRAMS, each dividing its N."""
    bns = [_pow2_dividing(n, TUNING["block_n"]) for n in ns]
    while sum(n // b for n, b in zip(ns, bns)) < TARGET_PROGRAMS and any(b > 16 for b in bns):
        bns = [b // 2 if b > 16 else b for b in bns]
    return bns


def _kernel(*refs, n_idx, pos, segments, M, K, BK, norm, eps, normed_out, x_dtype, glu, n_add, round_dtype):
    """refs: n_idx index operands [1] (each weight's layer, then gamma's, at `pos`); x [M, K]
    (and x2 [M, K] with `glu`), (gamma [Lg, K]), w_i [L_i, K, BN_i] ..., addends [M, BN] ...;
    then y_i [M, BN_i] ..., (xn [M, K])."""
    n = len(segments)
    idx_refs, refs = refs[:n_idx], refs[n_idx:]
    x_ref, refs = refs[0], refs[1:]
    x2_ref = None
    if glu is not None:
        x2_ref, refs = refs[0], refs[1:]
    layer_of = lambda i: idx_refs[pos[i]][0]  # noqa: E731
    g_ref = None
    if norm:
        g_ref, refs = refs[0], refs[1:]
    w_refs, refs = refs[:n], refs[n:]
    add_refs, refs = refs[:n_add], refs[n_add:]
    y_refs, rest = refs[:n], refs[n:]
    j = pl.program_id(0)
    nk = K // BK
    xdt = x_dtype
    g_layer = layer_of(n) if norm else None

    def raw(m, k0):
        """Row m's columns [k0, k0+BK) of x (or glu(x, x2)), in x_dtype."""
        xk = x_ref[m, pl.ds(k0, BK)].astype(xdt)
        if glu is None:
            return xk
        return glu_f32(glu, xk.astype(F32), x2_ref[m, pl.ds(k0, BK)].astype(xdt).astype(F32)).astype(xdt)

    def chunk(m, k0, r):
        """... RMS-normalised with gamma when `norm`."""
        xk = raw(m, k0)
        if not norm:
            return xk
        return (xk.astype(F32) * r).astype(xdt) * g_ref[g_layer, pl.ds(k0, BK)].astype(xdt)

    rs = [None] * M
    if norm:
        for m in range(M):
            def sq(kb, acc, m=m):
                xk = raw(m, pl.multiple_of(kb * BK, BK)).astype(F32)
                return acc + jnp.sum(xk * xk)
            rs[m] = jax.lax.rsqrt(jax.lax.fori_loop(0, nk, sq, jnp.zeros((), F32)) / K + eps)
    if normed_out:
        xn_ref = rest[0]

        @pl.when(j == 0)
        def _():
            for m in range(M):
                def put(kb, c, m=m):
                    k0 = pl.multiple_of(kb * BK, BK)
                    xn_ref[m, pl.ds(k0, BK)] = chunk(m, k0, rs[m]).astype(xn_ref.dtype)
                    return c
                jax.lax.fori_loop(0, nk, put, 0)

    for i, (start, count, dt) in enumerate(segments):
        @pl.when((j >= start) & (j < start + count))
        def _(i=i, dt=dt):
            BN = w_refs[i].shape[-1]
            layer = layer_of(i)

            def body(kb, accs):
                k0 = pl.multiple_of(kb * BK, BK)
                w = w_refs[i][layer, pl.ds(k0, BK), :].astype(dt).astype(F32)  # [BK, BN]
                return tuple(acc + jnp.sum(chunk(m, k0, rs[m]).astype(dt).astype(F32)[:, None] * w, axis=0)
                             for m, acc in enumerate(accs))

            accs = jax.lax.fori_loop(0, nk, body, tuple(jnp.zeros((BN,), F32) for _ in range(M)))
            for m, acc in enumerate(accs):
                if n_add:  # the projection's output in its dtype, then each addend (rounded to that dtype
                    # too), each sum rounded to the output's dtype
                    acc = acc.astype(round_dtype)
                    for a_ref in add_refs:
                        acc = (acc.astype(F32) + a_ref[m, :].astype(round_dtype).astype(F32)).astype(y_refs[i].dtype)
                y_refs[i][m, :] = acc.astype(y_refs[i].dtype)


def fused_gemv(x, weights, *, dtypes, layers=None, norm=None, norm_layer=None, eps: float = 1e-6,
               return_normed: bool = False, x_dtype=None, glu=None, x2=None, addends=(), round_dtype=None,
               out_dtypes=None, interpret: bool = False):
    """The kernel (module docstring): x [M, K]; weights [K, N_i] or [L_i, K, N_i] with layers[i];
    norm: gamma [K] or [L, K] with norm_layer; x_dtype: x rounded to it first (x's dtype by
    default; e.g. an fp32 projection that the plain path rounds to the compute dtype before
    its norm); glu (a `glu_f32` spec) with x2: the input is glu(x, x2) in x_dtype (a gated MLP's
    down projection); addends (one weight only): [M, N] arrays added to the output rounded to
    round_dtype, one after the other (each rounded to round_dtype first), each sum rounded to the
    last addend's dtype (a residual stream's adds); out_dtypes: each output's dtype (fp32 by
    default; the addends' with addends). -> [y_i [M, N_i]] (+ the normalised x [M, K] in x_dtype
    when return_normed)."""
    why = unsupported_reason(x, weights)
    if why:
        raise ValueError(f"fused_gemv: {why}")
    if addends and len(weights) != 1:
        raise ValueError("fused_gemv: addends need a single weight")
    M, K = x.shape
    x_dtype = jnp.dtype(x_dtype or x.dtype)
    BK = _pow2_dividing(K, TUNING["block_k"])
    weights = [w if w.ndim == 3 else w[None] for w in weights]
    layers = [0] * len(weights) if layers is None else list(layers)
    if norm is not None:
        norm = norm if norm.ndim == 2 else norm[None]
        layers.append(0 if norm_layer is None else norm_layer)
    idx, pos = index_operands(layers)
    ns = [w.shape[-1] for w in weights]
    bns = _blocks_n(ns)
    segments, start = [], 0
    for n, bn, dt in zip(ns, bns, dtypes):
        segments.append((start, n // bn, jnp.dtype(dt)))
        start += n // bn
    clamp = lambda s, c: (lambda j: (0, jnp.minimum(jnp.maximum(j - s, 0), c - 1)))  # noqa: E731
    clamp3 = lambda s, c: (lambda j: (0, 0, jnp.minimum(jnp.maximum(j - s, 0), c - 1)))  # noqa: E731
    full = lambda *shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    in_specs = [full(1)] * len(idx) + [full(M, K)] * (2 if glu is not None else 1)
    in_specs += [full(*norm.shape)] if norm is not None else []
    in_specs += [pl.BlockSpec((w.shape[0], K, bn), clamp3(s, c)) for (s, c, _), bn, w in zip(segments, bns, weights)]
    in_specs += [pl.BlockSpec((M, bns[0]), clamp(*segments[0][:2])) for _ in addends]
    out_specs = [pl.BlockSpec((M, bn), clamp(s, c)) for (s, c, _), bn in zip(segments, bns)]
    out_dt = addends[-1].dtype if addends else F32
    out_dts = [out_dt] * len(ns) if out_dtypes is None or addends else list(out_dtypes)
    out_shape = [jax.ShapeDtypeStruct((M, n), dt) for n, dt in zip(ns, out_dts)]
    if return_normed:
        out_specs.append(full(M, K))
        out_shape.append(jax.ShapeDtypeStruct((M, K), x_dtype))
    kernel = functools.partial(_kernel, n_idx=len(idx), pos=tuple(pos), segments=tuple(segments), M=M, K=K, BK=BK,
                               norm=norm is not None, eps=float(eps), normed_out=return_normed, x_dtype=x_dtype,
                               glu=glu, n_add=len(addends), round_dtype=jnp.dtype(round_dtype or out_dt))
    args = idx + [x] + ([x2] if glu is not None else []) + ([norm] if norm is not None else []) + weights
    args += list(addends)
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(start,), in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=TUNING["warps"], num_stages=TUNING["stages"]),
        interpret=interpret, name="decode_gemv",
    )(*args)


def fused_gemv_reference(x, weights, *, dtypes, layers=None, norm=None, norm_layer=None, eps: float = 1e-6,
                         return_normed: bool = False, x_dtype=None, glu=None, x2=None, addends=(), round_dtype=None,
                         out_dtypes=None):
    """The plain form: glu, RMSNorm (as k3jax.layers.norms.rms_norm), one dot per weight, the adds."""
    x_dtype = x_dtype or x.dtype
    x = x.astype(x_dtype)
    if glu is not None:
        x = glu_f32(glu, x.astype(F32), x2.astype(x_dtype).astype(F32)).astype(x_dtype)
    pick = lambda a, i: a if a.ndim == 2 else a[i]  # noqa: E731
    if norm is not None:
        g = norm if norm.ndim == 1 else norm[0 if norm_layer is None else norm_layer]
        x32 = x.astype(F32)
        r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        x = (x32 * r).astype(x.dtype) * g.astype(x.dtype)
    layers = [None] * len(weights) if layers is None else layers
    ys = [jnp.dot(x.astype(dt), pick(w, i).astype(dt), preferred_element_type=F32,
                  precision=jax.lax.Precision.HIGHEST) for w, dt, i in zip(weights, dtypes, layers)]
    if addends:
        rd = round_dtype or addends[-1].dtype
        y = ys[0].astype(rd)
        for a in addends:
            y = (y.astype(F32) + a.astype(rd).astype(F32)).astype(addends[-1].dtype)
        ys = [y]
    elif out_dtypes is not None:
        ys = [y.astype(dt) for y, dt in zip(ys, out_dtypes)]
    return ys + [x] if return_normed else ys
