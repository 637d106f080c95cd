"""The short convolution's backward as one Pallas-Triton kernel (KDA's q/k/v convs).

The forward, per channel c and row t of a [B,T,P] input (W taps, segment resets):

    acc_t = sum_{i<W} w[i] * [r_ext(t+i) == r_ext(t+W-1)] * xp(t+i),   y_t = SiLU(acc_t)

where xp = [window; x] along T (the W-1 earlier inputs first) and r_ext the segment counter of
each xp row (the window's rows count as segment 0, the segment of x's first token). Its
gradient, for the upstream gradient g [B,T,P]:

    dacc_s = g_s * SiLU'(acc_s)
    dx_t   = sum_{j<W} w[W-1-j] * [r(t) == r(t+j)] * dacc_{t+j}
    dw[i]  = sum_{b,s} [r_ext(s+i) == r_ext(s+W-1)] * dacc_s * xp(s+i)
    dwindow: dxp's first W-1 rows (below, in XLA: W-1 rows)

Why a kernel: the XLA form (`k3jax.layers.conv._conv_silu_bwd`) is a handful of fusions that
each write an fp32 [B,T,P] array, and the weight gradient's reduction over B*T shares a fusion
with a full-size output, which XLA:GPU runs slowly. On an H200 the convs took 40.6 ms of k3-small's
546 ms step, 236 kernels, about 1.1 ms per conv (benchmarks/results/gmm-2026-12-02b/README.md).
Here each program owns a [BT,BP] tile of dx: it recomputes acc and dacc at the W row offsets it
needs from shifted loads of xp (each of the 2W-1 offsets loaded once), writes dx once in x's dtype,
and writes its tile's partial weight gradient [W,BP] in fp32, summed over the tiles by XLA
(B*T/BT*W*P floats).

Measured on the H200 (benchmarks/results/kernels-2026-12-02c), first form: the kernel matched
the XLA form (dw 3e-7, dx one bf16 rounding) but took 0.50-0.66 ms per call, and the copies
padding g and x's tail another 0.24, so the step did not move (556.4 against 556.6 ms). This
form loads each row offset once (16 loads of x per program before, 7 now) and reads past the
ends with masked loads instead of padded copies: 0.73 ms against XLA's 0.92, and k3-small's step
538.6 ms against 548.5 in one lease, so it is the default on a GPU (`model.kda.conv_impl: auto`).
Since then each program loops over several row tiles and reduces the weight gradient once at
the end: in one lease (benchmarks/results/kernels-2026-12-02d/1-default-profile) 16-row tiles, 8
per program, took 0.726 ms against 0.840 for one 32-row tile per program (XLA's form 0.848);
that is the default. The kernel is still ~10x off the memory bound. With normalize (KDA's q and
k, l2-normalised per head after the conv) the norm's backward runs first, inside the kernel, on
one 128-channel head per tile: k3-small's step 525.0 ms against 552.3 with XLA's backwards
(benchmarks/results/kernels-2026-12-02d/3-variants).
That program computed each row's dacc W times (once per row offset dx reads), and with the norm
its row reductions W times too. The two-pass form (`_two_pass_kernel`, the default since
2026-12-04) computes it once per row and reads it back from a scratch output: 0.584 ms against
0.671, and 0.688 against 0.970 with the norm (FORM below). Still ~5x off the memory bound.
`short_conv_grad_reference` is the plain form kept beside it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.ops.norm_vjp import scaled_vjp

F32 = jnp.float32
# launch settings: rows and channels per tile (the largest of these dividing T and P), row tiles
# per program (the most of TILES dividing T / rows), warps (no autotuner in Pallas-Triton). On the
# H200, one tile per program: 32 x 64 with 4 warps was the fastest in two leases
# (benchmarks/results/kernels-2026-12-02c/3-reworked: 0.731 ms; 16 x 64 0.741, 32 x 64 with 8
# warps 0.860, 64 x 64 0.933, 32 x 128 0.954); then, in one lease (kernels-2026-12-02d/
# 1-default-profile), 16 x 64 in loops of 8 tiles 0.726 ms, 32 x 64 in loops of 16 (two stages)
# 0.775, of 4 0.787, of 2 0.805, and one 32 x 64 tile per program 0.840
ROWS, CHANNELS, TILES, WARPS = (16,), (64, 32, 16), (8, 4, 2, 1), 4
# the program's form: "recompute" (`_grad_kernel`: dacc recomputed at each of the W row offsets
# dx reads) or "two_pass" (`_two_pass_kernel`: dacc once per row, through a scratch output). On the
# H200 at k3-small's [8, 4096, 1536], 16 x 64 tiles in loops of 8, 4 warps, in one lease
# (benchmarks/results/kernels-2026-12-04/1-ab-keep-router): 0.584 ms against 0.671; with the
# per-head norm (16 x 128) 0.688 against 0.970 (8 warps 0.767, loops of 4 0.724); XLA's 0.835 / 1.019
FORMS = ("recompute", "two_pass")
FORM = "two_pass"


def tile(x) -> tuple[int | None, int | None]:
    """(rows, channels) of the tile for x [B,T,P]: the largest power of two in ROWS / CHANNELS
    dividing T / P (None where none does)."""
    _, T, P = x.shape
    return next((r for r in ROWS if T % r == 0), None), next((c for c in CHANNELS if P % c == 0), None)


def loop_tiles(x, rows: int) -> int:
    """Row tiles per program for x [B,T,P] and `rows` per tile: the most of TILES dividing T / rows."""
    return next(n for n in TILES if (x.shape[1] // rows) % n == 0)


def group_reason(norm_group: int, P: int) -> str | None:
    """Why the kernel cannot l2-normalise groups of `norm_group` of P channels (one channel tile
    each): None when the group is a power of two in [16, 256] dividing P."""
    if norm_group < 16 or norm_group > 256 or norm_group & (norm_group - 1) or P % norm_group:
        return f"the normalised group of {norm_group} channels must be a power of two in [16, 256] dividing P={P}"
    return None


def unsupported_reason(x, size: int, norm_group: int | None = None) -> str | None:
    """Why the kernel cannot take x [B,T,P] (None when it can): T must be a multiple of 16 and
    P of 16 (power-of-two tiles); with a normalisation group, `group_reason`."""
    rows, channels = tile(x)
    if rows is None or channels is None:
        return f"T={x.shape[1]} and P={x.shape[2]} must be multiples of 16"
    if size < 1:
        return f"conv size {size} < 1"
    return None if norm_group is None else group_reason(norm_group, x.shape[2])


def extended(x, window, r):
    """xp [B, T+W-1, P] = [window; x] and r_ext [B, T+W-1] int32 = [0 (the window's segment); r].
    The kernel reads rows past their ends with masked loads (0 for x and g, -1 for r_ext, which
    matches no row); the Pallas interpreter pads a load running off the end rather than
    shifting it back, so it computes the same."""
    B = x.shape[0]
    W = window.shape[1] + 1
    xp = jnp.concatenate([window.astype(x.dtype), x], axis=1)
    r_ext = jnp.concatenate([jnp.zeros((B, W - 1), jnp.int32), r.astype(jnp.int32)], axis=1)
    return xp, r_ext


def dy_of_normalized(silu_acc, dn, eps: float, dtype):
    """The cotangent of y = SiLU(acc) rounded to `dtype` (the conv's output), from dn, that of
    n = y * rsqrt(sum(y^2) + eps) over the last axis (one normalisation group: a head), all
    [rows, group] fp32 -> fp32 holding `dtype` values: the l2 norm's own backward
    (`k3jax.ops.norm_vjp.scaled_vjp`, as `k3jax.layers.norms.l2_normalize` runs it) on the rounded
    y, its result in `dtype` (the cotangent of a `dtype` array), then fp32 for the conv's backward."""
    return scaled_vjp(silu_acc.astype(dtype), dn, eps, False)[0].astype(F32)


def _grad_kernel(xp_ref, r_ref, g_ref, w_ref, dx_ref, *dw_refs, W: int, BT: int, BP: int, T: int, L: int,
                 norm_eps: float | None):
    """One program: L consecutive row tiles [BT, BP] of one row of the batch (a loop when L > 1),
    its partial weight gradient summed over their rows once, at the end. With norm_eps, g is the
    cotangent of the l2-normalised output and BP one normalisation group (`dy_of_normalized`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    b, tb, pb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ps = pl.ds(pl.multiple_of(pb * BP, BP), BP)
    rows = jax.lax.broadcasted_iota(jnp.int32, (BT, BP), 0)
    rows1 = jax.lax.broadcasted_iota(jnp.int32, (BT,), 0)
    w = [w_ref[i, ps].astype(F32)[None, :] for i in range(W)]

    def one_tile(l, dw_acc):
        """Tile l of this program: writes its dx, returns dw_acc plus its rows' [BT, BP] terms."""
        t0 = (tb * L + l) * BT
        # each distinct row offset is loaded once (2W-1 of x and of r_ext, W of g), not once per use
        x_at = [pltr.load(xp_ref.at[b, pl.ds(t0 + o, BT), ps], mask=t0 + o + rows < T + W - 1,
                          other=0.0).astype(F32) for o in range(2 * W - 1)]  # xp rows t0+o .., fp32 [BT,BP]
        r_at = [pltr.load(r_ref.at[b, pl.ds(t0 + o, BT)], mask=t0 + o + rows1 < T + W - 1, other=-1)[:, None]
                for o in range(2 * W - 1)]  # r_ext rows t0+o .., [BT,1]
        dx = jnp.zeros((BT, BP), F32)
        dw_acc = list(dw_acc)
        for j in range(W):  # dacc at rows s = t + j
            r_s = r_at[j + W - 1]
            acc = jnp.zeros((BT, BP), F32)
            for i in range(W):
                acc = acc + jnp.where(r_at[j + i] == r_s, x_at[j + i], 0.0) * w[i]
            sig = 1.0 / (1.0 + jnp.exp(-acc))
            g = pltr.load(g_ref.at[b, pl.ds(t0 + j, BT), ps], mask=t0 + j + rows < T, other=0.0).astype(F32)
            if norm_eps is not None:  # g is d(normalised y): through the norm first
                g = dy_of_normalized(acc * sig, g, norm_eps, xp_ref.dtype)
            dacc = g * sig * (1.0 + acc * (1.0 - sig))
            dx = dx + jnp.where(r_at[W - 1] == r_s, dacc, 0.0) * w[W - 1 - j]
            if j == 0:  # this tile's rows s = t: their share of every tap's weight gradient
                for i in range(W):
                    dw_acc[i] = dw_acc[i] + jnp.where(r_at[i] == r_s, dacc, 0.0) * x_at[i]
        start = 0 if isinstance(l, int) else pl.multiple_of(l * BT, BT)
        dx_ref[pl.ds(start, BT), :] = dx.astype(dx_ref.dtype)
        return tuple(dw_acc)

    zeros = tuple(jnp.zeros((BT, BP), F32) for _ in range(W))
    dw_acc = one_tile(0, zeros) if L == 1 else jax.lax.fori_loop(0, L, one_tile, zeros)
    for i in range(W):  # one cross-row reduction per tap per program
        dw_refs[i][...] = jnp.sum(dw_acc[i], axis=0)


def _two_pass_kernel(xp_ref, r_ref, g_ref, w_ref, dx_ref, *refs, W: int, BT: int, BP: int, T: int, L: int,
                     norm_eps: float | None, interpret: bool):
    """The same program as `_grad_kernel`, with each row's dacc computed once. Pass 1 walks the
    L row tiles and one more (the W-1 rows after them that dx reads), computing dacc tile by tile
    (one SiLU and, with norm_eps, one norm backward per row, where `_grad_kernel` computes each
    W times) and the weight gradient's terms, and writes dacc to a scratch output (Pallas-Triton
    has no scratch memory; the program reads it back, from L2, after a CTA barrier). Pass 2
    reads dacc at the W row offsets each dx tile needs and writes dx."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    *dw_refs, scr_ref = refs
    b, tb, pb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ps = pl.ds(pl.multiple_of(pb * BP, BP), BP)
    rows = jax.lax.broadcasted_iota(jnp.int32, (BT, BP), 0)
    rows1 = jax.lax.broadcasted_iota(jnp.int32, (BT,), 0)
    w = [w_ref[i, ps].astype(F32)[None, :] for i in range(W)]

    def r_rows(t):  # r_ext rows t .., [BT,1]; -1 (no segment) past the end
        return pltr.load(r_ref.at[b, pl.ds(t, BT)], mask=t + rows1 < T + W - 1, other=-1)[:, None]

    def dacc_tile(l, dw_acc):
        """Tile l's dacc (rows s = t0 ..) into the scratch; its terms of the weight gradient
        added to dw_acc (None: the tile after the program's rows, only read by pass 2)."""
        t0 = (tb * L + l) * BT
        x_at = [pltr.load(xp_ref.at[b, pl.ds(t0 + i, BT), ps], mask=t0 + i + rows < T + W - 1,
                          other=0.0).astype(F32) for i in range(W)]
        r_at = [r_rows(t0 + i) for i in range(W)]
        r_s = r_at[W - 1]
        acc = jnp.zeros((BT, BP), F32)
        for i in range(W):
            acc = acc + jnp.where(r_at[i] == r_s, x_at[i], 0.0) * w[i]
        sig = 1.0 / (1.0 + jnp.exp(-acc))
        g = pltr.load(g_ref.at[b, pl.ds(t0, BT), ps], mask=t0 + rows < T, other=0.0).astype(F32)
        if norm_eps is not None:  # g is d(normalised y): through the norm first
            g = dy_of_normalized(acc * sig, g, norm_eps, xp_ref.dtype)
        dacc = g * sig * (1.0 + acc * (1.0 - sig))  # 0 past T (g is)
        start = l * BT if isinstance(l, int) else pl.multiple_of(l * BT, BT)
        scr_ref[pl.ds(start, BT), :] = dacc
        if dw_acc is None:
            return None
        return tuple(dw_acc[i] + jnp.where(r_at[i] == r_s, dacc, 0.0) * x_at[i] for i in range(W))

    zeros = tuple(jnp.zeros((BT, BP), F32) for _ in range(W))
    dw_acc = dacc_tile(0, zeros) if L == 1 else jax.lax.fori_loop(0, L, dacc_tile, zeros)
    dacc_tile(L, None)
    for i in range(W):  # one cross-row reduction per tap per program
        dw_refs[i][...] = jnp.sum(dw_acc[i], axis=0)
    if not interpret:
        pltr.debug_barrier()  # the scratch rows written above are read back at other offsets below

    def dx_tile(l, carry):
        t0 = (tb * L + l) * BT
        start = 0 if isinstance(l, int) else pl.multiple_of(l * BT, BT)
        r_t = r_rows(t0 + W - 1)  # r(t) = r_ext(t + W - 1)
        dx = jnp.zeros((BT, BP), F32)
        for j in range(W):  # dacc at rows s = t + j
            dx = dx + jnp.where(r_t == r_rows(t0 + j + W - 1), scr_ref[pl.ds(start + j, BT), :], 0.0) * w[W - 1 - j]
        dx_ref[pl.ds(start, BT), :] = dx.astype(dx_ref.dtype)
        return carry

    if L == 1:
        dx_tile(0, 0)
    else:
        jax.lax.fori_loop(0, L, dx_tile, 0)


@functools.partial(jax.jit, static_argnames=("interpret", "rows", "channels", "warps", "tiles", "stages", "normalize",
                                             "form"))
def short_conv_grad(weight, x, window, r, g, *, interpret: bool = False, rows: int | None = None,
                    channels: int | None = None, warps: int = WARPS, tiles: int | None = None, stages: int = 1,
                    normalize: tuple[int, float] | None = None, form: str = FORM):
    """The gradient of y = SiLU(conv(x)) (module docstring): weight [W,P], x [B,T,P], window
    [B,W-1,P], r [B,T] int (the segment counter), g [B,T,P] -> (dweight [W,P] in weight's dtype,
    dx [B,T,P] in x's dtype, dwindow [B,W-1,P] in window's dtype). rows / channels: the tile
    (default `tile(x)`). tiles: row tiles per program, in a loop that sums the weight gradient's
    terms elementwise and reduces them over rows once (W cross-row reductions per program instead
    of per tile); it must divide T / rows (default `loop_tiles`). stages: Triton's
    software-pipelining depth for that loop. normalize = (group, eps): the forward went on to
    l2-normalise y over each `group` consecutive channels (KDA's q and k per head), and g is the
    cotangent of that; the kernel takes the norm's backward first (`dy_of_normalized`), with one
    group per channel tile."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    W = weight.shape[0]
    if (why := unsupported_reason(x, W)) is not None:
        raise ValueError(f"short_conv_grad: {why}")
    if normalize is not None and (why := unsupported_reason(x, W, normalize[0])) is not None:
        raise ValueError(f"short_conv_grad: {why}")
    rows = rows or tile(x)[0]
    channels = normalize[0] if normalize is not None else (channels or tile(x)[1])
    B, T, P = x.shape
    if T % rows or P % channels:
        raise ValueError(f"short_conv_grad: T={T} and P={P} must be multiples of the tile ({rows}, {channels})")
    tiles = loop_tiles(x, rows) if tiles is None else tiles
    if tiles < 1 or (T // rows) % tiles:
        raise ValueError(f"short_conv_grad: tiles={tiles} must divide T / rows = {T // rows}")
    if form not in FORMS:
        raise ValueError(f"short_conv_grad: form must be one of {FORMS}, got {form!r}")
    if form == "two_pass" and W - 1 > rows:
        raise ValueError(f"short_conv_grad: two_pass reads W-1={W - 1} rows past a tile of {rows}")
    xp, r_ext = extended(x, window, r)
    nt = T // (rows * tiles)  # programs along T
    whole = lambda shape: pl.BlockSpec(shape, lambda b, t, p: (0,) * len(shape))  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((B, T, P), x.dtype)] + [jax.ShapeDtypeStruct((B, nt, P), F32)] * W
    out_specs = [pl.BlockSpec((None, rows * tiles, channels), lambda b, t, p: (b, t, p))] + [
        pl.BlockSpec((None, None, channels), lambda b, t, p: (b, t, p))] * W
    settings = dict(W=W, BT=rows, BP=channels, T=T, L=tiles, norm_eps=None if normalize is None else float(normalize[1]))
    if form == "two_pass":  # + each program's dacc scratch (its tiles and one more), discarded
        kernel = functools.partial(_two_pass_kernel, interpret=interpret, **settings)
        out_shape.append(jax.ShapeDtypeStruct((B, nt, (tiles + 1) * rows, P), F32))
        out_specs.append(pl.BlockSpec((None, None, (tiles + 1) * rows, channels), lambda b, t, p: (b, t, 0, p)))
    else:
        kernel = functools.partial(_grad_kernel, **settings)
    dx, *dw_parts = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, nt, P // channels),
        in_specs=[whole(xp.shape), whole(r_ext.shape), whole(g.shape), whole(weight.shape)], out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=stages), interpret=interpret,
        name="short_conv_grad")(xp, r_ext, g.astype(x.dtype), weight.astype(F32))
    dw_parts = dw_parts[:W]
    dweight = jnp.stack([jnp.sum(d, axis=(0, 1)) for d in dw_parts]).astype(weight.dtype)
    return dweight, dx, _window_grad(weight, xp, r_ext, g, normalize, x.dtype).astype(window.dtype)


def _window_grad(weight, xp, r_ext, g, normalize=None, dtype=None):
    """dxp's first W-1 rows (the window's gradient): from dacc at rows 0..W-2 only, in XLA on
    [B, W-1, P] slices."""
    W = weight.shape[0]
    w = weight.astype(F32)
    if W == 1:
        return jnp.zeros(xp.shape[:1] + (0,) + xp.shape[2:], F32)
    xs = xp[:, :2 * W - 2].astype(F32)
    rs = r_ext[:, :2 * W - 2]
    dacc = []
    for s in range(W - 1):
        acc = sum(jnp.where((rs[:, s + i] == rs[:, s + W - 1])[:, None], xs[:, s + i], 0.0) * w[i] for i in range(W))
        sig = jax.nn.sigmoid(acc)
        gs = g[:, s].astype(F32)
        if normalize is not None:  # per group of channels, as the kernel
            group, eps = normalize
            shape = gs.shape[:-1] + (gs.shape[-1] // group, group)
            gs = dy_of_normalized((acc * sig).reshape(shape), gs.reshape(shape), eps, dtype).reshape(gs.shape)
        dacc.append(gs * sig * (1.0 + acc * (1.0 - sig)))
    rows = []
    for q in range(W - 1):  # dxp[q] = sum_i w[i] [r_ext(q) == r_ext(q-i+W-1)] dacc[q-i]
        terms = [jnp.where((rs[:, q] == rs[:, q - i + W - 1])[:, None], dacc[q - i], 0.0) * w[i]
                 for i in range(W) if q - i >= 0]
        rows.append(sum(terms))
    return jnp.stack(rows, axis=1)


def short_conv_grad_reference(weight, x, window, r, g, normalize: tuple[int, float] | None = None):
    """The plain form, by autodiff of the forward written directly (tests); with normalize =
    (group, eps), of that forward rounded to x's dtype and l2-normalised over each group."""
    W = weight.shape[0]

    def forward(weight, x32, window):
        xp, r_ext = extended(x32, window.astype(F32), r)
        T = x.shape[1]
        acc = sum(jnp.where((r_ext[:, i:i + T] == r_ext[:, W - 1:W - 1 + T])[..., None], xp[:, i:i + T], 0.0)
                  * weight.astype(F32)[i] for i in range(W))
        y = jax.nn.silu(acc)
        if normalize is None:
            return y
        group, eps = normalize
        y = y.astype(x.dtype).astype(F32).reshape(y.shape[:-1] + (y.shape[-1] // group, group))
        return (y * jax.lax.rsqrt(jnp.sum(y * y, axis=-1, keepdims=True) + eps)).reshape(x.shape)

    _, vjp = jax.vjp(forward, weight, x.astype(F32), window)
    dw, dx, dwin = vjp(g.astype(F32))
    return dw.astype(weight.dtype), dx.astype(x.dtype), dwin.astype(window.dtype)
