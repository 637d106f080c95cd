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

Forms not yet timed on a GPU (benchmarks/results/kda-split-2026-12-07): the kernel split in two
as fla splits this work (`Tuning.intra_split`: phase 1 with qg and kg in one program per 16-row
block, then phases 2 and 3 per chunk, L passing through HBM as it passes through the scratch
here), and phase 2 by block substitution with the 16 x 16 blocks in registers
(`tile_unit_lower_inverse`, `Tuning.intra_inverse=2`). Both are the same helpers arranged
differently, so every form gives the same numbers.
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


def tile_unit_lower_inverse(l_ref, C: int, precision, interpret: bool) -> None:
    """(I + L)^-1 in place in l_ref, by the block substitution of `block_unit_lower_inverse`, with
    every 16 x 16 block of L read into registers once and the inverse's blocks kept there (fla's
    solve, as separate tiles: Pallas-Triton cannot slice a value, but can load and store ref
    blocks), so there is no barrier between row blocks; one barrier after the reads (every warp's,
    before any block is written over) and one after the writes (the caller reads the whole).
    Blocks by distance from the diagonal: Ainv_ij needs Ainv_mj for j <= m < i, all nearer."""
    nb = C // SUB

    def block(i, j):
        return pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)

    low = {(i, j): l_ref[block(i, j)] for i in range(nb) for j in range(i + 1)}
    if not interpret:
        pltr.debug_barrier()
    inv = {(i, i): unit_lower_inverse(low[i, i], precision) for i in range(nb)}
    for d in range(1, nb):
        for j in range(nb - d):
            i = j + d
            acc = dot(low[i, j], inv[j, j], precision)
            for m in range(j + 1, i):
                acc = acc + dot(low[i, m], inv[m, j], precision)
            inv[i, j] = -dot(inv[i, i], acc, precision)
    for (i, j), value in inv.items():
        l_ref[block(i, j)] = value
    if not interpret:
        pltr.debug_barrier()


def _score_rows(a, q_ref, k_ref, g_ref, b_ref, r_ref, *, C, scale, has_gate, has_seg, num: Numerics, BK):
    """Phase 1 for the 16 rows a .. a+15 (a = 16 I) of a chunk: their rows of Aqk (causal, same
    segment) and of L (strictly causal, same segment, times beta), two fp32 [16, C] values. The
    refs hold the whole chunk ([C, K], [C], ...)."""
    span = pl.ds(a, SUB)
    cd = num.cd
    K = k_ref.shape[-1]
    BK = min(K, BK)
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
    return jnp.where(causal, acc_a, 0.0), jnp.where(strict, acc_l * b_ref[span].astype(F32)[:, None], 0.0)


def _write_gated_qk(rows, q_ref, k_ref, g_ref, r_ref, qg_ref, kg_ref, *, C, scale, has_gate, has_seg, BK):
    """qg = s q e^G (0 on rows after a segment start: they never see the incoming state) and
    kg = k e^{G_last - G} (0 outside the chunk's last segment) for the chunk rows `rows`, written
    whole to qg_ref and kg_ref ([rows, K]); the input refs hold the whole chunk."""
    K = k_ref.shape[-1]
    BK = min(K, BK)
    if has_seg:
        r = r_ref[rows]
        sees = (r == 0)[:, None]
        last = (r == r_ref[C - 1])[:, None]
    for kb in range(K // BK):
        ks = pl.ds(kb * BK, BK)
        k = k_ref[rows, ks].astype(F32)
        if has_gate:
            G = g_ref[rows, ks]
            e_g = jnp.exp(G)
            kg = k * jnp.exp(g_ref[C - 1, ks][None, :] - G)
        else:
            e_g = jnp.ones((1, 1), F32)
            kg = k
        if has_seg:
            e_g = jnp.where(sees, e_g, 0.0)
            kg = jnp.where(last, kg, 0.0)
        qg_ref[:, ks] = (q_ref[rows, ks].astype(F32) * (e_g * scale)).astype(qg_ref.dtype)
        kg_ref[:, ks] = kg.astype(kg_ref.dtype)


def _inverse(l_ref, C, num: Numerics, interpret: bool, inverse_blocks: int):
    """Phase 2: (I + L)^-1 of the strictly lower-triangular fp32 L in l_ref ([C, C]), in num.cd.
    TF32 for bf16 inputs (the block merge's products are all of size ~1); rounded to bf16 anyway.
    inverse_blocks: 0 the whole-chunk merge, 1 block substitution through the scratch, 2 the same
    with the blocks in registers (both in place in l_ref)."""
    if inverse_blocks:
        (block_unit_lower_inverse if inverse_blocks == 1 else tile_unit_lower_inverse)(l_ref, C, num.f32, interpret)
        return l_ref[...].astype(num.cd)
    return unit_lower_inverse(l_ref[...], num.f32).astype(num.cd)


def _write_wy(ainv_c, k_ref, v_ref, g_ref, b_ref, r_ref, w_ref, u_ref, gam_ref, *, C, has_gate, has_seg,
              num: Numerics, BK):
    """The WY vectors w = Ainv (beta k e^G) (e^G 0 on rows after a segment start), u = Ainv (beta v),
    and the chunk's decay gamma = e^{G_last} (0 when a segment starts inside the chunk)."""
    cd = num.cd
    K, V = k_ref.shape[-1], v_ref.shape[-1]
    BK, BV = min(K, BK), min(V, BK)
    beta = b_ref[...].astype(F32)[:, None]
    if has_seg:
        r_last = r_ref[C - 1]
        sees = (r_ref[...] == 0)[:, None]
    for kb in range(K // BK):
        ks = pl.ds(kb * BK, BK)
        k = k_ref[:, ks].astype(F32)
        if has_gate:
            e_g = jnp.exp(g_ref[:, ks])
            gam = jnp.exp(g_ref[C - 1, ks])
        else:
            e_g = jnp.ones((C, 1), F32)
            gam = jnp.ones((BK,), F32)
        if has_seg:
            e_g = jnp.where(sees, e_g, 0.0)
            gam = jnp.where(r_last == 0, gam, 0.0)
        w_ref[:, ks] = dot(ainv_c, (k * e_g * beta).astype(cd), num.mm).astype(w_ref.dtype)
        gam_ref[ks] = gam
    for vb in range(V // BV):
        vs = pl.ds(vb * BV, BV)
        u_ref[:, vs] = dot(ainv_c, (v_ref[:, vs].astype(F32) * beta).astype(cd), num.mm).astype(u_ref.dtype)


def _intra_kernel(*refs, C, scale, has_gate, has_seg, want_ainv, num: Numerics, interpret: bool, BK: int,
                  inverse_blocks: int = 0):
    """The whole of kernel 1 in one program per (chunk, batch x head)."""
    it = iter(refs)
    q_ref, k_ref, v_ref = (next(it) for _ in range(3))
    g_ref = next(it) if has_gate else None  # in-chunk cumulative log-decay; none: G = 0 (DeltaNet)
    b_ref = next(it)
    r_ref = next(it) if has_seg else None
    w_ref, u_ref, kg_ref, qg_ref, aqk_ref, gam_ref = (next(it) for _ in range(6))
    ainv_ref = next(it) if want_ainv else None
    l_ref = next(it)  # fp32 [C,C] scratch for L
    flags = dict(C=C, has_gate=has_gate, has_seg=has_seg)

    def block_rows(I, carry):  # phase 1, one 16-row block I per step: rows of Aqk and L
        a = pl.multiple_of(I * SUB, SUB)
        aqk, l = _score_rows(a, q_ref, k_ref, g_ref, b_ref, r_ref, scale=scale, num=num, BK=BK, **flags)
        aqk_ref[pl.ds(a, SUB), :] = aqk.astype(aqk_ref.dtype)
        l_ref[pl.ds(a, SUB), :] = l
        return carry

    jax.lax.fori_loop(0, C // SUB, block_rows, 0)
    if not interpret:
        pltr.debug_barrier()  # the scratch rows written above are read back below
    ainv_c = _inverse(l_ref, C, num, interpret, inverse_blocks)
    if want_ainv:
        ainv_ref[...] = ainv_c.astype(ainv_ref.dtype)
    _write_wy(ainv_c, k_ref, v_ref, g_ref, b_ref, r_ref, w_ref, u_ref, gam_ref, num=num, BK=BK, **flags)
    _write_gated_qk(pl.ds(0, C), q_ref, k_ref, g_ref, r_ref, qg_ref, kg_ref, scale=scale, BK=BK, **flags)


def _scores_kernel(*refs, C, scale, has_gate, has_seg, num: Numerics, BK: int):
    """Kernel 1 split, first part: one program per 16-row block of a chunk (grid (t, block, bh)):
    the block's rows of Aqk and L, qg and kg."""
    it = iter(refs)
    q_ref, k_ref = next(it), next(it)
    g_ref = next(it) if has_gate else None
    b_ref = next(it)
    r_ref = next(it) if has_seg else None
    aqk_ref, l_ref, qg_ref, kg_ref = (next(it) for _ in range(4))
    flags = dict(C=C, has_gate=has_gate, has_seg=has_seg)
    a = pl.multiple_of(pl.program_id(1) * SUB, SUB)
    aqk, l = _score_rows(a, q_ref, k_ref, g_ref, b_ref, r_ref, scale=scale, num=num, BK=BK, **flags)
    aqk_ref[...] = aqk.astype(aqk_ref.dtype)
    l_ref[...] = l
    _write_gated_qk(pl.ds(a, SUB), q_ref, k_ref, g_ref, r_ref, qg_ref, kg_ref, scale=scale, BK=BK, **flags)


def _wy_kernel(*refs, C, has_gate, has_seg, want_ainv, num: Numerics, interpret: bool, BK: int,
               inverse_blocks: int):
    """Kernel 1 split, second part: one program per (chunk, batch x head): the UT inverse of the
    first part's L, w, u and gamma."""
    it = iter(refs)
    k_ref, v_ref = next(it), next(it)
    g_ref = next(it) if has_gate else None
    b_ref = next(it)
    r_ref = next(it) if has_seg else None
    l_ref = next(it)
    w_ref, u_ref, gam_ref = (next(it) for _ in range(3))
    ainv_ref = next(it) if want_ainv else None
    if inverse_blocks:
        l_ref = next(it)  # the same buffer as the input L (aliased): the block inverse works in place
    ainv_c = _inverse(l_ref, C, num, interpret, inverse_blocks)
    if want_ainv:
        ainv_ref[...] = ainv_c.astype(ainv_ref.dtype)
    _write_wy(ainv_c, k_ref, v_ref, g_ref, b_ref, r_ref, w_ref, u_ref, gam_ref, C=C, has_gate=has_gate,
              has_seg=has_seg, num=num, BK=BK)


@kernel_jit
def intra_chunk(q, k, v, gc, beta, r, *, scale, chunk, num: Numerics, warps: int, want_ainv: bool,
                interpret: bool, block_k: int = 64, stages: int = 1, inverse_blocks: int = 0, split: int = 0,
                warps_scores: int = 0):
    """q, k [B,T,H,K], v [B,T,H,V] (num.cd), gc [B,T,H,K] fp32 (in-chunk cumsum of the log-decay)
    or None (no decay, DeltaNet: the kernel skips every decay factor), beta [B,T,H] fp32, r [B,T]
    int32 or None; T a multiple of `chunk`.

    Returns w, kg, qg [B,T,H,K], u [B,T,H,V], Aqk [B,T,H,C] (num.cd), gamma [B,NT,H,K] fp32,
    and Ainv [B,T,H,C] (num.cd) when `want_ainv`. block_k: K and V columns per slice (a power of
    two; K and V, powers of two themselves, are checked by the caller). inverse_blocks: phase 2 by
    block substitution (1: `block_unit_lower_inverse`, 2: `tile_unit_lower_inverse`) instead of the
    whole-chunk merge (0). split: two
    kernels instead of one, as fla splits this work: phase 1 (the rows of Aqk and L, qg and kg)
    with one program per 16-row block, C / 16 times the programs, then the inverse, w, u and
    gamma per chunk, reading L back from HBM (the one-kernel form writes it to a scratch output
    and reads it back too)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk
    NT = T // C
    if inverse_blocks not in (0, 1, 2):
        raise ValueError(f"KDA kernel tuning intra_inverse={inverse_blocks}: 0 (whole-chunk merge), 1 (16 x 16 blocks) "
                         "or 2 (16 x 16 blocks in registers)")
    if split not in (0, 1):
        raise ValueError(f"KDA kernel tuning intra_split={split}: 0 (one kernel) or 1 (two kernels)")
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"KDA kernel tuning intra_block_k={block_k}: a power of two of at least 16")
    if split:
        return _intra_split(q, k, v, gc, beta, r, scale=scale, chunk=chunk, num=num, warps=warps,
                            want_ainv=want_ainv, interpret=interpret, block_k=block_k, stages=stages,
                            inverse_blocks=inverse_blocks, warps_scores=warps_scores or warps)
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
                               inverse_blocks=inverse_blocks)
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(NT, B * H), in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=stages), interpret=interpret,
        name="kda_intra_chunk")(*args)[:-1]


def _intra_split(q, k, v, gc, beta, r, *, scale, chunk, num: Numerics, warps, want_ainv, interpret, block_k,
                 stages, inverse_blocks, warps_scores):
    """`intra_chunk` with split=1: kda_intra_scores (grid (t, block, bh)) -> kda_intra_wy (grid (t, bh))."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk
    NT = T // C
    sp = Specs(H, C)
    cd = num.cd
    gate = gc is not None
    seg = r is not None
    params = pltr.CompilerParams(num_warps=warps, num_stages=stages)
    flags = dict(C=C, has_gate=gate, has_seg=seg, num=num, BK=block_k)

    in_specs = [sp.sub_chunk(K), sp.sub_chunk(K)] + [sp.sub_chunk(K)] * gate + [sp.sub_chunk_vec()]
    in_specs += [sp.sub_chunk_rows()] * seg
    args = [q, k] + [gc] * gate + [beta] + [r] * seg
    out_shape = [jax.ShapeDtypeStruct((B, T, H, C), cd), jax.ShapeDtypeStruct((B, T, H, C), F32),
                 jax.ShapeDtypeStruct((B, T, H, K), cd), jax.ShapeDtypeStruct((B, T, H, K), cd)]
    out_specs = [sp.sub_rows(C), sp.sub_rows(C), sp.sub_rows(K), sp.sub_rows(K)]
    aqk, L, qg, kg = pl.pallas_call(
        functools.partial(_scores_kernel, scale=scale, **flags), out_shape=out_shape,
        grid=(NT, C // SUB, B * H), in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=warps_scores, num_stages=stages),
        interpret=interpret, name="kda_intra_scores")(*args)

    in_specs = [sp.chunk(K), sp.chunk(V)] + [sp.chunk(K)] * gate + [sp.chunk_vec()] + [sp.chunk_rows()] * seg
    in_specs.append(sp.chunk(C))
    args = [k, v] + [gc] * gate + [beta] + [r] * seg + [L]
    out_shape = [jax.ShapeDtypeStruct((B, T, H, K), cd), jax.ShapeDtypeStruct((B, T, H, V), cd),
                 jax.ShapeDtypeStruct((B, NT, H, K), F32)]
    out_specs = [sp.chunk(K), sp.chunk(V), sp.chunk_gate(K)]
    if want_ainv:
        out_shape.append(jax.ShapeDtypeStruct((B, T, H, C), cd))
        out_specs.append(sp.chunk(C))
    aliases = {}
    if inverse_blocks:  # L is inverted in place: an output aliased to it, discarded
        aliases = {len(args) - 1: len(out_shape)}
        out_shape.append(jax.ShapeDtypeStruct((B, T, H, C), F32))
        out_specs.append(sp.chunk(C))
    w, u, gam, *rest = pl.pallas_call(
        functools.partial(_wy_kernel, want_ainv=want_ainv, interpret=interpret, inverse_blocks=inverse_blocks,
                          **flags), out_shape=out_shape, grid=(NT, B * H), in_specs=in_specs, out_specs=out_specs,
        input_output_aliases=aliases, compiler_params=params, interpret=interpret, name="kda_intra_wy")(*args)
    return (w, u, kg, qg, aqk, gam) + ((rest[0],) if want_ainv else ())
