"""Kernels 4 and 5, chunk-parallel: the gradients once the two state passes are done.

Kernel 4 (`wy_grad`), per chunk, from the state h entering it, the gradient dh of the state
leaving it, v_new and dv_new (kernels 2 and 3) and do:

    dAqk = do v_new^T (causal, same segment)          dqg = do h^T     dkg = v_new dh^T
    dw   = -dv_new h^T                                dgamma = rowsum(h * dh)
    WY:  w = Ainv X1, u = Ainv X2 (X1 = beta k e^G, X2 = beta v, u's gradient is dv_new)
         dX2 = Ainv^T dv_new, dX1 = Ainv^T dw = -dX2 h^T
         dL  = -Ainv^T (dw X1^T + dv_new X2^T) Ainv^T = -dX2 v_new^T (strictly causal, same segment)
and everything that is elementwise in q, k, v, beta, G: dv, and partial dq, dk, dbeta and
dG (the gradient of the in-chunk cumulative log-decay; the last row also collects the
chunk-end terms of kg and gamma). K and V are walked in 64-wide slices to bound registers.

Kernel 5 (`score_grad`) takes dAqk and dL back through the factored 16-row blocks of
kernel 1 (row side and column side of every block pair; one program per output block) and
adds its terms to kernel 4's partial gradients. The diagonal blocks use the `exact`
precision: there the row and column terms of dG cancel, and bf16 rounding would not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from k3jax.ops.kda_kernels.common import F32, SAFE_SPAN, SUB, Numerics, Specs, dot, iota2, kernel_jit


def _wy_grad_kernel(*refs, C, scale, has_gate, has_seg, num: Numerics, BK: int, BV: int):
    it = iter(refs)
    q_ref, k_ref, v_ref = (next(it) for _ in range(3))
    g_ref = next(it) if has_gate else None  # none: G = 0 (DeltaNet), and no dG to compute
    b_ref = next(it)
    r_ref = next(it) if has_seg else None
    ainv_ref, h_ref, dh_ref, do_ref, vn_ref, dvn_ref = (next(it) for _ in range(6))
    dq_ref, dk_ref, dv_ref = (next(it) for _ in range(3))
    dg_ref = next(it) if has_gate else None
    db_ref, daqk_ref, dl_ref = (next(it) for _ in range(3))
    K, V = h_ref.shape
    BK, BV = min(K, BK), min(V, BV)
    cd = num.cd

    def mask(strict: bool):  # built where used: a [C,C] mask held across the loops costs registers
        ri, ci = iota2(C, C)
        keep = ri > ci if strict else ri >= ci
        if has_seg:
            r = r_ref[...]
            keep = keep & (r[:, None] == r[None, :])
        return keep

    beta = b_ref[...].astype(F32)[:, None]  # [C,1]
    d_aqk = jnp.zeros((C, C), F32)
    d_l = jnp.zeros((C, C), F32)
    d_beta = jnp.zeros((C,), F32)
    dx2s = []
    for vb in range(V // BV):
        cs = pl.ds(vb * BV, BV)
        vn = vn_ref[:, cs]
        v = v_ref[:, cs].astype(F32)
        d_aqk = d_aqk + dot(do_ref[:, cs], vn, num.mm, tb=True)
        dx2 = dot(ainv_ref[...], dvn_ref[:, cs], num.mm, ta=True)  # gradient of X2 = beta v
        dv_ref[:, cs] = (dx2 * beta).astype(dv_ref.dtype)
        d_beta = d_beta + jnp.sum(v * dx2, axis=1)
        dx2 = dx2.astype(cd)
        d_l = d_l + dot(dx2, vn, num.mm, tb=True)
        dx2s.append(dx2)
    daqk_ref[...] = jnp.where(mask(False), d_aqk, 0.0)
    # dL = -Ainv^T dAinv Ainv^T with dAinv = dw X1^T + dv_new X2^T and dw = -dv_new h^T. Since
    # X2 - X1 h = (I + L)(u - w h) = (I + L) v_new, this is dL = -(Ainv^T dv_new) v_new^T = -dX2 v_new^T,
    # and likewise dX1 = Ainv^T dw = -dX2 h^T: no C x C products of Ainv are needed.
    dl_ref[...] = jnp.where(mask(True), -d_l, 0.0)

    is_last_row = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0) == C - 1
    for kb in range(K // BK):
        ks = pl.ds(kb * BK, BK)
        dqg = jnp.zeros((C, BK), F32)
        dkg = jnp.zeros((C, BK), F32)
        dx1 = jnp.zeros((C, BK), F32)
        dgam = jnp.zeros((BK,), F32)
        for vb in range(V // BV):
            cs = pl.ds(vb * BV, BV)
            h, dh = h_ref[ks, cs], dh_ref[ks, cs]
            dqg = dqg + dot(do_ref[:, cs], h, num.mm, tb=True)
            dkg = dkg + dot(vn_ref[:, cs], dh, num.mm, tb=True)
            dx1 = dx1 - dot(dx2s[vb], h, num.mm, tb=True)
            if has_gate:
                dgam = dgam + jnp.sum(h.astype(F32) * dh.astype(F32), axis=1)
        k = k_ref[:, ks].astype(F32)
        if has_gate:
            G = g_ref[:, ks]
            G_last = g_ref[C - 1, ks][None, :]
            e_g = jnp.exp(G)
            e_out = jnp.exp(G_last - G)
            gam = jnp.exp(G_last[0])
        else:
            e_g = e_out = jnp.ones((C, 1), F32)
        if has_seg:
            r = r_ref[...]
            r_last = r_ref[C - 1]
            e_g = jnp.where((r == 0)[:, None], e_g, 0.0)
            e_out = jnp.where((r == r_last)[:, None], e_out, 0.0)
            if has_gate:
                gam = jnp.where(r_last == 0, gam, 0.0)
        # qg = s q e^G
        dq = dqg * e_g * scale
        dq_ref[:, ks] = dq
        # kg = k e^{G_last - G}; gamma = e^{G_last}
        kg = k * e_out
        dk = e_out * dkg
        # X1 = beta k e^G (w = Ainv X1)
        ke = k * e_g
        dk = dk + dx1 * e_g * beta
        d_beta = d_beta + jnp.sum(dx1 * ke, axis=1)
        dk_ref[:, ks] = dk
        if has_gate:
            dG = q_ref[:, ks].astype(F32) * dq - kg * dkg + ke * beta * dx1
            dG_last = jnp.sum(kg * dkg, axis=0) + gam * dgam
            dg_ref[:, ks] = dG + jnp.where(is_last_row, dG_last[None, :], 0.0)
    db_ref[...] = d_beta


@kernel_jit
def wy_grad(q, k, v, gc, beta, r, ainv, h, dh, do, v_new, dv_new, *, scale, chunk, num: Numerics,
            dv_dtype, warps: int, interpret: bool, block_k: int = 32, block_v: int = 64):
    """Returns dv [B,T,H,V] (dv_dtype) and fp32 partials dq, dk, dG [B,T,H,K] (None without a
    gate, gc None), dbeta [B,T,H], and dAqk, dL [B,T,H,C], as (dq, dk, dv, dG, dbeta, dAqk, dL)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C, NT = chunk, T // chunk
    sp = Specs(H, C)
    gate = gc is not None
    in_specs = [sp.chunk(K), sp.chunk(K), sp.chunk(V)] + [sp.chunk(K)] * gate + [sp.chunk_vec()]
    args = [q, k, v] + [gc] * gate + [beta]
    if r is not None:
        in_specs.append(sp.chunk_rows())
        args.append(r)
    in_specs += [sp.chunk(C), sp.chunk_state(K, V), sp.chunk_state(K, V), sp.chunk(V), sp.chunk(V), sp.chunk(V)]
    args += [ainv, h, dh, do, v_new, dv_new]
    f32 = lambda *s: jax.ShapeDtypeStruct(s, F32)  # noqa: E731
    out_shape = [f32(B, T, H, K), f32(B, T, H, K), jax.ShapeDtypeStruct((B, T, H, V), dv_dtype)]
    out_shape += [f32(B, T, H, K)] * gate + [f32(B, T, H), f32(B, T, H, C), f32(B, T, H, C)]
    out_specs = [sp.chunk(K), sp.chunk(K), sp.chunk(V)] + [sp.chunk(K)] * gate
    out_specs += [sp.chunk_vec(), sp.chunk(C), sp.chunk(C)]
    kernel = functools.partial(_wy_grad_kernel, C=C, scale=scale, has_gate=gate, has_seg=r is not None, num=num,
                               BK=block_k, BV=block_v)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(NT, B * H), in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=1), interpret=interpret,
        name="kda_wy_grad")(*args)
    return tuple(out) if gate else (*out[:3], None, *out[3:])


def _score_grad_kernel(*refs, C, scale, has_gate, num: Numerics, BK: int, S: int):
    """One program per 16-row sub-block X of a chunk and slice of K/S channels (the blocks and
    channels are independent here, and short programs hide each other's latency better than one
    long one per chunk); dbeta, a sum over the channels, is written per slice (S > 1) and summed
    in XLA. Without a gate (DeltaNet) every decay factor is 1 and there is no dG."""
    it = iter(refs)
    q_ref, k_ref = next(it), next(it)
    g_ref = next(it) if has_gate else None
    b_ref, daqk_ref, dl_ref, dq1_ref, dk1_ref = (next(it) for _ in range(5))
    dg1_ref = next(it) if has_gate else None
    db1_ref, dq_ref, dk_ref = next(it), next(it), next(it)
    dg_ref = next(it) if has_gate else None
    db_ref = next(it)
    nb, cd = C // SUB, num.cd
    K = q_ref.shape[-1]
    KS = K // S  # this program's channels: [k0, k0 + KS)
    BK = min(KS, BK)
    k0 = pl.program_id(3) * KS if S > 1 else 0
    X = pl.program_id(1)
    x0 = pl.multiple_of(X * SUB, SUB)
    sx = pl.ds(x0, SUB)

    def low(x, y, **kw):  # off-diagonal blocks: operands in cd
        return dot(x.astype(cd), y.astype(cd), num.mm, **kw)

    def exact(x, y, **kw):  # the diagonal block: its row and column terms cancel in dG
        return dot(x, y, num.exact, **kw)

    b_x = b_ref[sx].astype(F32)[:, None]
    d_beta = db1_ref[...] if S == 1 else jnp.where(pl.program_id(3) == 0, db1_ref[...], 0.0)
    for kb in range(KS // BK):  # every term is per channel except dbeta's sum over them
        ks = pl.ds(k0 + kb * BK, BK)
        if has_gate:
            G_x = g_ref[sx, ks]
            G_a = g_ref[x0, ks][None, :]

        # row side: block X's rows against the columns of blocks J <= X, anchored at X's first row
        def k_col(j0):
            kj = k_ref[pl.ds(j0, SUB), ks].astype(F32)
            if not has_gate:
                return kj
            return kj * jnp.exp(jnp.minimum(G_a - g_ref[pl.ds(j0, SUB), ks], SAFE_SPAN))

        kc = k_col(x0)
        acc_a = exact(daqk_ref[sx, sx], kc)
        acc_l = exact(dl_ref[sx, sx], kc)

        def row_term(J, acc):
            j0 = pl.multiple_of(J * SUB, SUB)
            kc = k_col(j0)
            return (acc[0] + low(daqk_ref[sx, pl.ds(j0, SUB)], kc),
                    acc[1] + low(dl_ref[sx, pl.ds(j0, SUB)], kc))

        acc_a, acc_l = jax.lax.fori_loop(0, X, row_term, (acc_a, acc_l))
        if has_gate:
            d = jnp.exp(G_x - G_a)
            dq_a, p = acc_a * d * scale, acc_l * d
        else:
            dq_a, p = acc_a * scale, acc_l
        dk_row = p * b_x
        q_x = q_ref[sx, ks].astype(F32)
        k_x = k_ref[sx, ks].astype(F32)
        dq_ref[:, ks] = (dq1_ref[:, ks] + dq_a).astype(dq_ref.dtype)
        d_beta = d_beta + jnp.sum(k_x * p, axis=1)

        # column side: block X's columns against the rows of blocks I >= X, anchored at I's first row
        def rows_i(i0):
            si = pl.ds(i0, SUB)
            q_i = q_ref[si, ks].astype(F32) * scale
            k_i = k_ref[si, ks].astype(F32) * b_ref[si].astype(F32)[:, None]
            if not has_gate:
                return si, q_i, k_i, 1.0
            d_i = jnp.exp(g_ref[si, ks] - g_ref[i0, ks][None, :])
            lift = jnp.exp(jnp.minimum(g_ref[i0, ks][None, :] - G_x, SAFE_SPAN))
            return si, q_i * d_i, k_i * d_i, lift

        si, q_i, k_i, lift = rows_i(x0)
        col = (exact(daqk_ref[si, sx], q_i, ta=True) + exact(dl_ref[si, sx], k_i, ta=True)) * lift

        def col_term(I, col):
            si, q_i, k_i, lift = rows_i(pl.multiple_of(I * SUB, SUB))
            return col + (low(daqk_ref[si, sx], q_i, ta=True) + low(dl_ref[si, sx], k_i, ta=True)) * lift

        col = jax.lax.fori_loop(X + 1, nb, col_term, col)
        dk_ref[:, ks] = (dk1_ref[:, ks] + dk_row + col).astype(dk_ref.dtype)
        if has_gate:
            dg_ref[:, ks] = dg1_ref[:, ks] + q_x * dq_a + k_x * (dk_row - col)
    db_ref[...] = d_beta


@kernel_jit
def score_grad(q, k, gc, beta, d_aqk, d_l, dq1, dk1, dg1, db1, *, scale, chunk, num: Numerics, dq_dtype,
               dk_dtype, warps: int, interpret: bool, block_k: int = 64, split_k: int = 1):
    """Returns dq [B,T,H,K] (dq_dtype), dk (dk_dtype), dG [B,T,H,K] fp32 (None without a gate:
    gc and dg1 None), dbeta [B,T,H] fp32. split_k: programs per sub-block, each K / split_k
    channels (a power of two dividing K)."""
    B, T, H, K = q.shape
    C, NT = chunk, T // chunk
    S = split_k
    if S < 1 or K % S or (K // S) < 16 or (K // S) & (K // S - 1):
        raise ValueError(f"score_grad: split_k={S} must leave power-of-two slices of >= 16 of K={K}")
    sp = Specs(H, C)
    gate = gc is not None
    in_specs = [sp.sub_chunk(K), sp.sub_chunk(K)] + [sp.sub_chunk(K)] * gate + [
        sp.sub_chunk_vec(), sp.sub_chunk(C), sp.sub_chunk(C), sp.sub_rows(K), sp.sub_rows(K)] + [
        sp.sub_rows(K)] * gate + [sp.sub_rows_vec()]
    args = [q, k] + [gc] * gate + [beta, d_aqk, d_l, dq1, dk1] + [dg1] * gate + [db1]
    out_shape = [jax.ShapeDtypeStruct((B, T, H, K), dq_dtype), jax.ShapeDtypeStruct((B, T, H, K), dk_dtype)]
    out_shape += [jax.ShapeDtypeStruct((B, T, H, K), F32)] * gate
    out_specs = [sp.sub_rows(K), sp.sub_rows(K)] + [sp.sub_rows(K)] * gate
    grid = (NT, C // SUB, B * H)
    if S == 1:
        out_shape.append(jax.ShapeDtypeStruct((B, T, H), F32))
        out_specs.append(sp.sub_rows_vec())
    else:  # a 4-D grid: every spec's index map takes (and ignores) the slice index
        grid += (S,)
        in_specs = [_ignoring_slice(spec) for spec in in_specs]
        out_specs = [_ignoring_slice(spec) for spec in out_specs]
        nb = C // SUB
        out_shape.append(jax.ShapeDtypeStruct((B, T, H, S), F32))
        out_specs.append(pl.BlockSpec((None, SUB, None, None), lambda t, x, bh, s: (bh // H, t * nb + x, bh % H, s)))
    kernel = functools.partial(_score_grad_kernel, C=C, scale=scale, has_gate=gate, num=num, BK=block_k, S=S)
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=1), interpret=interpret,
        name="kda_score_grad")(*args)
    out = list(out)
    if S > 1:
        out[-1] = jnp.sum(out[-1], axis=-1)
    return tuple(out) if gate else (out[0], out[1], None, out[2])


def _ignoring_slice(spec):
    """A (t, x, bh) BlockSpec as one of the (t, x, bh, s) grid: every program of a sub-block
    sees the same (whole-K) blocks and reads or writes only its own channels of them."""
    index = spec.index_map
    return pl.BlockSpec(spec.block_shape, lambda t, x, bh, s: index(t, x, bh))
