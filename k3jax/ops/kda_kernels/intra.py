"""Kernel 1, chunk-parallel: everything inside a chunk that does not need the state.

Per chunk of C rows (one program per chunk and (batch, head)), with G the in-chunk
cumulative log-decay [C,K], s the scale and r the in-chunk segment counter:

    Aqk[i,j] = s sum_c q_ic k_jc e^{G_ic - G_jc}      j <= i, same segment   (written [C,C])
    L[i,j]   = beta_i sum_c k_ic k_jc e^{G_ic - G_jc}  j <  i, same segment
    Ainv     = (I + L)^-1                                                    (optional output)
    w = Ainv (beta k e^G),  u = Ainv (beta v)         (beta k e^G) is 0 on rows after a segment start
    kg = k e^{G_last - G} (rows of the chunk's last segment),  qg = s q e^G (first segment)
    gamma = e^{G_last}, or 0 when a segment starts inside the chunk

The C x C matrices are built 16 rows at a time. Rows of block I factor every decay through
row a = 16 I, the block's first row: e^{G_i - G_a} <= 1 on the row side and e^{G_a - G_j} on
the column side, which is <= 1 before the block and at most e^{15 |bound|} inside it. The
caller guarantees 15 |bound| < 80 (a static gate bound), so nothing overflows and each block
row is one tensor-core dot (phase 1, a loop over blocks). The rows of L go to a scratch
output, and after a barrier (I + L)^-1 merges diagonal blocks in log-depth rounds of C x C
dots (phase 2), in TF32 for bf16 inputs: every product in the merge is of size ~1, so TF32
keeps ~1e-3 (XLA's form keeps it exact fp32). Measured alternatives that were slower on the
H200: forward substitution of the 16x16 diagonal blocks (C dependent masked reductions),
the in-chunk cumsum of g computed here instead of in XLA (cross-warp scans), and (2026-12-03,
forward at 8 x 4096 x 16 x 128, 2.42 ms as it is) phase 1's blocks unrolled, each over its
causal columns only (16, 32, 64, 64: a quarter fewer exps and dot columns; 4.35 ms), 32-wide
slices of K and V (3.17), 128-wide (2.54), two pipeline stages (3.45) and 8 warps (4.88 with
the unrolled blocks); benchmarks/results/issue23-close-2026-12-03/3-intra-sweep.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from k3jax.ops.kda_kernels.common import F32, SAFE_SPAN, SUB, Numerics, Specs, dot, iota2, kernel_jit


def unit_lower_inverse(L, precision):
    """(I + L)^-1 for a strictly lower-triangular [C,C] fp32 L by merging diagonal blocks, as
    k3jax.ops.delta_rule.unit_lower_inverse (which says why not the doubling series): pairs of
    rows elementwise, then per round T <- T - T (L on the pairs' lower-left blocks) T, 2 log2(C) - 2
    dots on the tensor cores. Masks from iotas (no value slicing in Pallas-Triton)."""
    C = L.shape[0]
    ri, ci = iota2(C, C)
    inv = jnp.where(ri == ci, 1.0, 0.0).astype(F32) - jnp.where(ri // 2 == ci // 2, L, 0.0)
    s = 2
    while s < C:
        lower_left = (ri // (2 * s) == ci // (2 * s)) & ((ri // s) % 2 == 1) & ((ci // s) % 2 == 0)
        link = dot(jnp.where(lower_left, L, 0.0), inv, precision)
        inv = inv - dot(inv, link, precision)
        s *= 2
    return inv


def block_unit_lower_inverse(l_ref, C: int, precision, interpret: bool) -> None:
    """(I + L)^-1 in place in l_ref ([C,C] fp32 scratch holding the strictly lower-triangular L,
    zeros above the diagonal) by forward substitution over 16 x 16 blocks, row block by row block:

        Ainv_ii = (I + L_ii)^-1                          (unit_lower_inverse at 16 x 16)
        Ainv_ij = -Ainv_ii sum_{k=j}^{i-1} L_ik Ainv_kj  (j < i)

    Row block i reads its own L blocks and the inverse blocks of the rows above (already written
    over their L), so each row block is written after all of its blocks are computed, and a
    barrier separates row blocks (the next one reads them). Every temporary is 16 x 16, where
    `unit_lower_inverse` over the whole chunk holds several fp32 C x C matrices (Tuning.intra_inverse
    chooses; measured on a GPU before it becomes the default). The products are those of the
    merge: of size ~1, in `precision`."""
    nb = C // SUB

    def block(i, j):
        return pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)

    for i in range(nb):
        diag = unit_lower_inverse(l_ref[block(i, i)], precision)
        row = []
        for j in range(i):
            acc = jnp.zeros((SUB, SUB), F32)
            for m in range(j, i):  # l_ref(i, m) still holds L_im; l_ref(m, j) holds Ainv_mj
                acc = acc + dot(l_ref[block(i, m)], l_ref[block(m, j)], precision)
            row.append(-dot(diag, acc, precision))
        for j, value in enumerate(row):
            l_ref[block(i, j)] = value
        l_ref[block(i, i)] = diag
        if not interpret:
            pltr.debug_barrier()  # the next row block reads this one


def _intra_kernel(*refs, C, scale, has_gate, has_seg, want_ainv, num: Numerics, interpret: bool, BK: int,
                  inverse_blocks: bool = False):
    it = iter(refs)
    q_ref, k_ref, v_ref = (next(it) for _ in range(3))
    g_ref = next(it) if has_gate else None  # in-chunk cumulative log-decay; none: G = 0 (DeltaNet)
    b_ref = next(it)
    r_ref = next(it) if has_seg else None
    w_ref, u_ref, kg_ref, qg_ref, aqk_ref, gam_ref = (next(it) for _ in range(6))
    ainv_ref = next(it) if want_ainv else None
    l_ref = next(it)  # fp32 [C,C] scratch for L
    nb, cd = C // SUB, num.cd
    K, V = k_ref.shape[-1], v_ref.shape[-1]
    BK, BV = min(K, BK), min(V, BK)  # 64-wide slices of K and V bound the registers

    # ---- phase 1, one 16-row block I per step: rows of Aqk and L
    def block_rows(I, carry):
        a = pl.multiple_of(I * SUB, SUB)
        span = pl.ds(a, SUB)
        acc_a = jnp.zeros((SUB, C), F32)
        acc_l = jnp.zeros((SUB, C), F32)
        for kb in range(K // BK):
            ks = pl.ds(kb * BK, BK)
            if has_gate:
                G_a = g_ref[a, ks][None, :]  # anchor: the block's first row
                D = jnp.exp(g_ref[span, ks] - G_a)  # <= 1
                q_row = (q_ref[span, ks].astype(F32) * (D * scale)).astype(cd)
                k_row = (k_ref[span, ks].astype(F32) * D).astype(cd)
                # columns: e^{G_a - G_j} <= 1 before the block, <= e^{15 |bound|} inside it, masked after
                k_col = (k_ref[:, ks].astype(F32) * jnp.exp(jnp.minimum(G_a - g_ref[:, ks], SAFE_SPAN))).astype(cd)
            else:
                q_row = (q_ref[span, ks].astype(F32) * scale).astype(cd)
                k_row, k_col = k_ref[span, ks].astype(cd), k_ref[:, ks].astype(cd)
            acc_a = acc_a + dot(q_row, k_col, num.mm, tb=True)
            acc_l = acc_l + dot(k_row, k_col, num.mm, tb=True)
        ri, ci = iota2(SUB, C)
        causal, strict = ci <= a + ri, ci < a + ri
        if has_seg:
            same = r_ref[span][:, None] == r_ref[...][None, :]
            causal, strict = causal & same, strict & same
        aqk_ref[span, :] = jnp.where(causal, acc_a, 0.0).astype(aqk_ref.dtype)
        l_ref[span, :] = jnp.where(strict, acc_l * b_ref[span].astype(F32)[:, None], 0.0)
        return carry

    jax.lax.fori_loop(0, nb, block_rows, 0)
    if not interpret:
        pltr.debug_barrier()  # the scratch rows written above are read back below

    # ---- phase 2: the UT inverse
    # TF32 for bf16 inputs (the block merge's products are all of size ~1); rounded to bf16 anyway
    if inverse_blocks:  # in place in the scratch, 16 x 16 blocks at a time
        block_unit_lower_inverse(l_ref, C, num.f32, interpret)
        ainv_c = l_ref[...].astype(cd)
    else:
        ainv_c = unit_lower_inverse(l_ref[...], num.f32).astype(cd)
    if want_ainv:
        ainv_ref[...] = ainv_c.astype(ainv_ref.dtype)

    # ---- WY vectors w = Ainv (beta k e^G), u = Ainv (beta v), and the chunk's boundary factors
    beta = b_ref[...].astype(F32)[:, None]
    if has_seg:
        r = r_ref[...]
        r_last = r_ref[C - 1]
        sees = (r == 0)[:, None]  # rows after a segment start never see the incoming state
        last = (r == r_last)[:, None]
    for kb in range(K // BK):
        ks = pl.ds(kb * BK, BK)
        k = k_ref[:, ks].astype(F32)
        if has_gate:
            G = g_ref[:, ks]
            e_g = jnp.exp(G)
            G_last = g_ref[C - 1, ks]
            kg = k * jnp.exp(G_last[None, :] - G)
            gam = jnp.exp(G_last)
        else:
            e_g = jnp.ones((C, 1), F32)
            kg = k
            gam = jnp.ones((BK,), F32)
        if has_seg:
            e_g = jnp.where(sees, e_g, 0.0)
        w_ref[:, ks] = dot(ainv_c, (k * e_g * beta).astype(cd), num.mm).astype(w_ref.dtype)
        qg_ref[:, ks] = (q_ref[:, ks].astype(F32) * (e_g * scale)).astype(qg_ref.dtype)
        if has_seg:
            kg = jnp.where(last, kg, 0.0)
            gam = jnp.where(r_last == 0, gam, 0.0)
        kg_ref[:, ks] = kg.astype(kg_ref.dtype)
        gam_ref[ks] = gam
    for vb in range(V // BV):
        vs = pl.ds(vb * BV, BV)
        u_ref[:, vs] = dot(ainv_c, (v_ref[:, vs].astype(F32) * beta).astype(cd), num.mm).astype(u_ref.dtype)


@kernel_jit
def intra_chunk(q, k, v, gc, beta, r, *, scale, chunk, num: Numerics, warps: int, want_ainv: bool,
                interpret: bool, block_k: int = 64, stages: int = 1, inverse_blocks: int = 0):
    """q, k [B,T,H,K], v [B,T,H,V] (num.cd), gc [B,T,H,K] fp32 (in-chunk cumsum of the log-decay)
    or None (no decay, DeltaNet: the kernel skips every decay factor), beta [B,T,H] fp32, r [B,T]
    int32 or None; T a multiple of `chunk`.

    Returns w, kg, qg [B,T,H,K], u [B,T,H,V], Aqk [B,T,H,C] (num.cd), gamma [B,NT,H,K] fp32,
    and Ainv [B,T,H,C] (num.cd) when `want_ainv`. block_k: K and V columns per slice (a power of
    two; K and V, powers of two themselves, are checked by the caller). inverse_blocks: phase 2 by
    block substitution (`block_unit_lower_inverse`) instead of the whole-chunk merge."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk
    NT = T // C
    if inverse_blocks not in (0, 1):
        raise ValueError(f"KDA kernel tuning intra_inverse={inverse_blocks}: 0 (whole-chunk merge) or 1 (16 x 16 blocks)")
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"KDA kernel tuning intra_block_k={block_k}: a power of two of at least 16")
    sp = Specs(H, C)
    cd = num.cd
    gate = gc is not None
    in_specs = [sp.chunk(K), sp.chunk(K), sp.chunk(V)] + [sp.chunk(K)] * gate + [sp.chunk_vec()]
    args = [q, k, v] + [gc] * gate + [beta]
    if r is not None:
        in_specs.append(sp.chunk_rows())
        args.append(r)
    out_shape = [jax.ShapeDtypeStruct((B, T, H, K), cd), jax.ShapeDtypeStruct((B, T, H, V), cd),
                 jax.ShapeDtypeStruct((B, T, H, K), cd), jax.ShapeDtypeStruct((B, T, H, K), cd),
                 jax.ShapeDtypeStruct((B, T, H, C), cd), jax.ShapeDtypeStruct((B, NT, H, K), F32)]
    out_specs = [sp.chunk(K), sp.chunk(V), sp.chunk(K), sp.chunk(K), sp.chunk(C), sp.chunk_gate(K)]
    if want_ainv:
        out_shape.append(jax.ShapeDtypeStruct((B, T, H, C), cd))
        out_specs.append(sp.chunk(C))
    # an fp32 [C,C] scratch block per chunk (Pallas-Triton has no scratch memory): written 16
    # rows at a time, then read back whole by the same program after a barrier; discarded
    out_shape.append(jax.ShapeDtypeStruct((B, T, H, C), F32))
    out_specs.append(sp.chunk(C))
    kernel = functools.partial(_intra_kernel, C=C, scale=scale, has_gate=gate, has_seg=r is not None,
                               want_ainv=want_ainv, num=num, interpret=interpret, BK=block_k,
                               inverse_blocks=bool(inverse_blocks))
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(NT, B * H), in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=stages), interpret=interpret,
        name="kda_intra_chunk")(*args)[:-1]
