"""The experts' weight gradient as one Pallas-Triton kernel that reads the rows where they lie.

    dw[g] = x[rows of g]^T dy[rows of g]:  x [M,K], dy [M,N] (rows sorted by group, groups in
    order), group_sizes [G] int32 (sum <= M) -> dw [G,K,N] in out_dtype; 0 for an empty group.

Why: tokamax's ragged-contracting kernel (the `kernel` form's weight gradient,
`k3jax.ops.grouped_matmul`) transposes x to [K,M] in HBM before it starts: in k3-small's step
on an H200 those transposes took 24.8 ms and the kernel itself 41.4 ms of a 568 ms step
(BENCHMARKS.md §4). Here each program owns one [BK,BN] tile of one group's dw and walks the
group's rows BR at a time: it loads x[rows, K block] and dy[rows, N block] as they lie and
multiplies x_tile^T dy_tile on the tensor cores (Triton transposes the tile on chip), masking
the rows outside the group; nothing is copied first.

On an H200 (2026-12-02, `benchmarks/checks/gmm_check.py --dw-pallas`, k3-small's 262,144 rows, 64
experts, K = 768): 0.61 ms at N = 512 and 1.26 ms at N = 1,024 (335 and 326 TFLOP/s), against
1.25 and 2.49 ms for tokamax's kernel with its transpose; exact to fp32 rounding (3e-5 at the
worst element) on uniform, tile-aligned and skewed routing, where tokamax's kernel was not
(BENCHMARKS.md section 3). It is the default (model.moe.gmm_weight_grad=pallas); off a GPU it
runs in the Pallas interpreter (the CPU tests). `grouped_dw_reference` is the plain form the tests compare against, beside float64.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32
# launch settings (no autotuner in Pallas-Triton): rows per step, the output tile, warps, stages;
# the fastest of nine swept on an H200 (benchmarks/results/gmm-2026-12-02b/1-pallas-dw/)
ROWS, TILE_K, TILE_N, WARPS, STAGES = 64, 128, 128, 4, 3


def _dw_kernel(starts_ref, sizes_ref, x_ref, dy_ref, out_ref, *, BR: int, BK: int, BN: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    g, kb, nb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, size = starts_ref[g], sizes_ref[g]
    ks = pl.ds(pl.multiple_of(kb * BK, BK), BK)
    ns = pl.ds(pl.multiple_of(nb * BN, BN), BN)
    end = start + size

    def body(i, acc):
        r0 = start + i * BR
        inside = ((r0 + jnp.arange(BR, dtype=jnp.int32)) < end)[:, None]
        xt = pltr.load(x_ref.at[pl.ds(r0, BR), ks], mask=inside, other=0)  # [BR,BK]
        dyt = pltr.load(dy_ref.at[pl.ds(r0, BR), ns], mask=inside, other=0)  # [BR,BN]
        return acc + jnp.dot(xt.T, dyt, preferred_element_type=F32)

    steps = (size + BR - 1) // BR
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((BK, BN), F32))
    out_ref[...] = acc.astype(out_ref.dtype)


def unsupported_reason(x, dy, rows: int = ROWS, tile_k: int = TILE_K, tile_n: int = TILE_N) -> str | None:
    """Why the kernel cannot take these operands (None when it can): Triton's loads want
    power-of-two blocks and its dots both sides >= 16, so K and N must be multiples of tiles
    that are."""
    K, N = x.shape[1], dy.shape[1]
    bk, bn = min(tile_k, K), min(tile_n, N)
    for name, v in (("rows", rows), ("tile_k", bk), ("tile_n", bn)):
        if v < 16 or v & (v - 1):
            return f"{name}={v} is not a power of two >= 16"
    if K % bk or N % bn:
        return f"K={K} and N={N} must be multiples of the tile ({bk}, {bn})"
    if x.shape[0] != dy.shape[0]:
        return f"x has {x.shape[0]} rows and dy {dy.shape[0]}"
    return None


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "rows", "tile_k", "tile_n", "warps", "stages"))
def grouped_dw(x, dy, group_sizes, *, out_dtype=None, interpret: bool = False, rows: int = ROWS,
               tile_k: int = TILE_K, tile_n: int = TILE_N, warps: int = WARPS, stages: int = STAGES):
    """dw [G,K,N] = per group x_g^T dy_g (shapes in the module docstring); fp32 accumulation,
    one rounding to out_dtype (default x's dtype)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    if (why := unsupported_reason(x, dy, rows, tile_k, tile_n)) is not None:
        raise ValueError(f"grouped_dw: {why}")
    (G,), K, N = group_sizes.shape, x.shape[1], dy.shape[1]
    bk, bn = min(tile_k, K), min(tile_n, N)
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    whole = lambda shape: pl.BlockSpec(shape, lambda g, k, n: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_dw_kernel, BR=rows, BK=bk, BN=bn),
        out_shape=jax.ShapeDtypeStruct((G, K, N), jnp.dtype(out_dtype or x.dtype)),
        grid=(G, K // bk, N // bn),
        in_specs=[whole((G,)), whole((G,)), whole(x.shape), whole(dy.shape)],
        out_specs=pl.BlockSpec((None, bk, bn), lambda g, k, n: (g, k, n)),
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=stages), interpret=interpret,
        name="grouped_dw")(starts, sizes, x, dy)


def grouped_dw_reference(x, dy, group_sizes, *, out_dtype=None):
    """The plain form: a one-hot [M,G] of each row's group (0 past sum(group_sizes)), contracted
    with both operands in fp32 (tests only: G times the work)."""
    M, G = x.shape[0], group_sizes.shape[0]
    group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(M), side="right")
    onehot = (group[:, None] == jnp.arange(G)[None, :]).astype(F32)
    dw = jnp.einsum("mg,mk,mn->gkn", onehot, x.astype(F32), dy.astype(F32))
    return dw.astype(jnp.dtype(out_dtype or x.dtype))
