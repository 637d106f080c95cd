"""Block AttnRes's depth mix at one site, forward and backward: an XLA form and a fused kernel.

Per token, over the sources V_0..V_{NB-1} (the block buffer's slots, slots >= n masked) and
V_NB = the in-block prefix:

    r_i = rsqrt(mean(V_i^2) + eps),  l_i = <V_i, q> r_i,  a = softmax(l),  out = sum_i a_i V_i

The site is one `jax.custom_vjp` whose outputs are (out, blocks): the block buffer passes
through it, and everything downstream uses the passed-through buffer. Its cotangent (all that
later sites and layers added to it) then arrives in this site's backward, which adds its own
share in the same pass instead of writing a fresh [NB,B,T,d] cotangent for XLA to add to the
running sum (a read of two buffers and a write of one, per site). The fused kernel updates
that running cotangent in place and leaves the masked slots untouched: it neither reads nor
writes a slot >= n, in either direction. The prefix does not pass through: its cotangent is a
fresh [B,T,d] array XLA adds where the prefix's other uses meet (a pass-through there made
XLA copy the aliased buffer at every site: deviceless H200 compile, 2026-12-01).

Backward, with g the output's cotangent:

    da_i = <g, V_i>;  dl_i = a_i (da_i - sum_j a_j da_j)
    dV_i = a_i g + dl_i r_i q - dl_i l_i r_i^2 / d * V_i     (d l_i / d V_i = r_i q - <V_i,q> r_i^3 V_i / d)
    dq   = sum over tokens and i of dl_i r_i V_i

Two implementations of one contract (`attn_res_site`):
- "xla": row reductions and elementwise passes XLA fuses (any backend). The per-token
  statistics are recomputed in the backward's first pass (it reads the sources anyway).
- "kernel": two Pallas-Triton kernels (GPU; the Pallas interpreter elsewhere, for tests), each
  one program per 32 tokens walking d in 128-wide chunks: the forward reads each valid source
  twice (statistics, then the mix) and writes the output; the backward reads g and each valid
  source twice, updates the blocks' running cotangent in place and writes the prefix's, with
  the query's gradient as per-program partial sums (fp32 [programs, d]) that XLA adds up: no
  column reduction over the tokens with side outputs, the kind of XLA:GPU kernel that ran 4x
  slower than its bytes in k3-small's profile (BENCHMARKS.md section 4).
Statistics are fp32 in both; sources, outputs and cotangents keep their dtype (bf16 in
training; the kernel adds its share to the running cotangent in fp32 and rounds once, where
XLA rounds the share and then the sum). Each is tested against float64 autodiff of the
operator (tests/test_attnres.py); `k3jax.layers.attnres.attn_res_mix_reference` is the plain
einsum form.

What is computed is the design's operator (fp32 statistics, the raw sources mixed and cast
back to the model dtype); only the backward's order of rounding differs from autodiff's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32
# launch settings (no autotuner in Pallas-Triton): tokens per program, d columns per load
# (Triton loads power-of-two blocks), warps; benchmarks/ops/attnres_op.py --sweep times others
TOKENS, CHUNK, WARPS = 32, 128, 4


# --------------------------------------------------------------------------------------
# XLA form


def _site_weights(blocks, num_blocks, prefix, q, eps: float):
    """(wb [NB,B,T], wp [B,T], (lb, rb, lp, rp)): the softmax weights (exactly 0 on slots >=
    num_blocks), the unmasked logits and the rsqrt factors, fp32, from one read of each source
    in its own dtype (two row reductions each; no normalised fp32 copy of the sources)."""
    def logit(v):
        v32 = v.astype(F32)
        r = jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1) + eps)
        return jnp.sum(v32 * q, axis=-1) * r, r

    (lb, rb), (lp, rp) = logit(blocks), logit(prefix)
    valid = (jnp.arange(blocks.shape[0]) < num_blocks)[:, None, None]
    lbm = jnp.where(valid, lb, -jnp.inf)
    m = jnp.maximum(jnp.max(lbm, axis=0), lp)
    eb, ep = jnp.exp(lbm - m), jnp.exp(lp - m)
    inv_z = 1.0 / (jnp.sum(eb, axis=0) + ep)
    return eb * inv_z, ep * inv_z, (lb, rb, lp, rp)


def _mix(blocks, prefix, wb, wp):
    """sum_i w_i V_i in fp32, cast to prefix's dtype: one elementwise pass reading each source
    once (an unrolled sum over the NB slots). As an einsum XLA:GPU ran this depth contraction
    as fp32 (TF32) batched GEMMs with K = NB."""
    out = wp[..., None] * prefix.astype(F32)
    for i in range(blocks.shape[0]):
        out = out + wb[i][..., None] * blocks[i].astype(F32)
    return out.astype(prefix.dtype)


def mix_xla(blocks, num_blocks, prefix, query, eps: float):
    wb, wp, _ = _site_weights(blocks, num_blocks, prefix, query.astype(F32), eps)
    return _mix(blocks, prefix, wb, wp)


def grads_xla(blocks, num_blocks, prefix, query, g, dblocks, eps: float):
    """-> (dblocks + this site's dV_blocks, dV_prefix, dq): see the module docstring."""
    q = query.astype(F32)
    wb, wp, (lb, rb, lp, rp) = _site_weights(blocks, num_blocks, prefix, q, eps)
    d = blocks.shape[-1]
    g32 = g.astype(F32)
    dab = jnp.sum(g32 * blocks.astype(F32), axis=-1)  # [NB,B,T]
    dap = jnp.sum(g32 * prefix.astype(F32), axis=-1)  # [B,T]
    mean_da = jnp.sum(wb * dab, axis=0) + wp * dap
    dlb, dlp = wb * (dab - mean_da), wp * (dap - mean_da)

    def source_grad(v, acc, a, dl, l, r):
        v32 = v.astype(F32)
        b, c = dl * r, dl * l * r * r / d  # l unmasked (finite): dl = 0 gives b = c = 0 exactly
        new = a[..., None] * g32 + b[..., None] * q - c[..., None] * v32
        new = new if acc is None else acc.astype(F32) + new
        return new.astype(v.dtype), b[..., None] * v32

    new_blocks, qb = source_grad(blocks, dblocks, wb, dlb, lb, rb)
    new_prefix, qp = source_grad(prefix, None, wp, dlp, lp, rp)
    lead = tuple(range(prefix.ndim - 1))
    dq = jnp.sum(qb, axis=(0,) + tuple(a + 1 for a in lead)) + jnp.sum(qp, axis=lead)
    return new_blocks, new_prefix, dq


# --------------------------------------------------------------------------------------
# fused kernels (Pallas, Triton lowering)


def kernel_unsupported(blocks, prefix) -> str | None:
    """Why the kernels cannot take these sources (None when they can)."""
    d = blocks.shape[-1]
    if d % CHUNK:
        return f"d_model={d} is not a multiple of {CHUNK}"
    if any(jnp.dtype(x.dtype) == jnp.float64 for x in (blocks, prefix)):
        return "float64 sources"
    return None


def _pad_tokens(x, axis: int, multiple: int):
    pad = (-x.shape[axis]) % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _masked(ref_view, valid):
    """Load a block where `valid` (a scalar bool) holds, zeros elsewhere without touching memory
    (a predicated-off Triton load). `other` in the ref's own dtype: the load's fill value
    must match its pointer's element type."""
    from jax.experimental.pallas import triton as pltr

    return pltr.load(ref_view, mask=valid, other=jnp.zeros((), ref_view.dtype))


def _slot(i: int):
    """A slot index for ref.at[...]: an int32 scalar (the interpreter's masked loads want an
    array index, not a Python int)."""
    return jnp.asarray(i, jnp.int32)


def _stats_pass(n, q_ref, blocks_ref, prefix_ref, g_ref, *, NB, nc, BT, DC, want_da):
    """Over d in chunks: per source <V,q>, sum V^2 and (want_da) <g,V>, each [BT] fp32.
    Slots >= n are masked loads (no memory traffic) and sum to 0."""
    from jax.experimental import pallas as pl

    def body(c, carry):
        cs = pl.ds(pl.multiple_of(c * DC, DC), DC)
        qc = q_ref[cs].astype(F32)[None, :]
        gc = g_ref[:, cs].astype(F32) if want_da else None
        out = []
        for i in range(NB + 1):
            if i < NB:
                v = _masked(blocks_ref.at[_slot(i), :, cs], i < n).astype(F32)
            else:
                v = prefix_ref[:, cs].astype(F32)
            s, ss, da = carry[i]
            out.append((s + jnp.sum(v * qc, axis=1), ss + jnp.sum(v * v, axis=1),
                        da + jnp.sum(gc * v, axis=1) if want_da else da))
        return tuple(out)

    zero = jnp.zeros((BT,), F32)
    return jax.lax.fori_loop(0, nc, body, tuple((zero, zero, zero) for _ in range(NB + 1)))


def _softmax(n, stats, *, NB, d, eps):
    """Per source: (a, l, r) [BT] fp32 from the pass's sums; a = 0 exactly on slots >= n."""
    r = [jax.lax.rsqrt(ss / d + eps) for _, ss, _ in stats]
    lu = [s * ri for (s, _, _), ri in zip(stats, r)]  # unmasked logits
    lm = [jnp.where(i < n, l, -jnp.inf) if i < NB else l for i, l in enumerate(lu)]
    m = functools.reduce(jnp.maximum, lm)
    e = [jnp.exp(l - m) for l in lm]
    inv_z = 1.0 / functools.reduce(jnp.add, e)
    return [ei * inv_z for ei in e], lu, r


def _fwd_kernel(n_ref, q_ref, blocks_ref, prefix_ref, out_ref, *, NB, d, DC, eps):
    from jax.experimental import pallas as pl

    n = n_ref[0]
    BT = prefix_ref.shape[0]
    nc = d // DC
    stats = _stats_pass(n, q_ref, blocks_ref, prefix_ref, None, NB=NB, nc=nc, BT=BT, DC=DC, want_da=False)
    a, _, _ = _softmax(n, stats, NB=NB, d=d, eps=eps)

    def body(c, carry):
        cs = pl.ds(pl.multiple_of(c * DC, DC), DC)
        acc = a[NB][:, None] * prefix_ref[:, cs].astype(F32)
        for i in range(NB):
            v = _masked(blocks_ref.at[_slot(i), :, cs], i < n).astype(F32)
            acc = acc + a[i][:, None] * v
        out_ref[:, cs] = acc.astype(out_ref.dtype)
        return carry

    jax.lax.fori_loop(0, nc, body, 0)


def _bwd_kernel(n_ref, q_ref, blocks_ref, prefix_ref, g_ref, dblocks_in, dblocks_ref, dprefix_ref, dq_ref,
                *, NB, d, DC, eps):
    """dblocks_ref aliases dblocks_in: each valid slot's running cotangent is read, increased
    and written back; slots >= n are left as they are. dprefix_ref: the prefix's cotangent."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    del dblocks_in  # the same buffer as dblocks_ref
    n = n_ref[0]
    BT = prefix_ref.shape[0]
    nc = d // DC
    stats = _stats_pass(n, q_ref, blocks_ref, prefix_ref, g_ref, NB=NB, nc=nc, BT=BT, DC=DC, want_da=True)
    a, lu, r = _softmax(n, stats, NB=NB, d=d, eps=eps)
    da = [s[2] for s in stats]
    mean_da = functools.reduce(jnp.add, [ai * dai for ai, dai in zip(a, da)])
    dl = [ai * (dai - mean_da) for ai, dai in zip(a, da)]
    b = [dli * ri for dli, ri in zip(dl, r)]
    cc = [dli * li * ri * ri / d for dli, li, ri in zip(dl, lu, r)]

    def body(c, carry):
        cs = pl.ds(pl.multiple_of(c * DC, DC), DC)
        qc = q_ref[cs].astype(F32)[None, :]
        gc = g_ref[:, cs].astype(F32)
        dq = jnp.zeros((DC,), F32)
        for i in range(NB + 1):
            if i < NB:
                valid = i < n
                v = _masked(blocks_ref.at[_slot(i), :, cs], valid).astype(F32)
                acc = _masked(dblocks_ref.at[_slot(i), :, cs], valid).astype(F32)
            else:
                v = prefix_ref[:, cs].astype(F32)
                acc = 0.0
            new = acc + a[i][:, None] * gc + b[i][:, None] * qc - cc[i][:, None] * v
            if i < NB:
                pltr.store(dblocks_ref.at[_slot(i), :, cs], new.astype(dblocks_ref.dtype), mask=valid)
            else:
                dprefix_ref[:, cs] = new.astype(dprefix_ref.dtype)
            dq = dq + jnp.sum(b[i][:, None] * v, axis=0)
        dq_ref[cs] = dq
        return carry

    jax.lax.fori_loop(0, nc, body, 0)


def _specs(NB, d, BT):
    from jax.experimental import pallas as pl

    return dict(
        n=pl.BlockSpec((1,), lambda t: (0,)),
        q=pl.BlockSpec((d,), lambda t: (0,)),
        blocks=pl.BlockSpec((NB, BT, d), lambda t: (0, t, 0)),
        rows=pl.BlockSpec((BT, d), lambda t: (t, 0)),
        part=pl.BlockSpec((None, d), lambda t: (t, 0)),
    )


def _flat(blocks, prefix, tokens):
    """[NB,B,T,d], [B,T,d] -> [NB,N,d], [N,d] with N padded to a multiple of `tokens` (zeros:
    finite statistics, no effect on anything else)."""
    NB, d = blocks.shape[0], blocks.shape[-1]
    bl = _pad_tokens(blocks.reshape(NB, -1, d), 1, tokens)
    pr = _pad_tokens(prefix.reshape(-1, d), 0, tokens)
    return bl, pr


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "tokens", "chunk", "warps"))
def mix_kernel(blocks, num_blocks, prefix, query, *, eps: float, interpret: bool, tokens: int = TOKENS,
               chunk: int = CHUNK, warps: int = WARPS):
    """The fused forward: `mix_xla`'s result (fp32 statistics, one rounding at the end)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    NB, d = blocks.shape[0], blocks.shape[-1]
    N = prefix.size // d
    bl, pr = _flat(blocks, prefix, tokens)
    Np = pr.shape[0]
    sp = _specs(NB, d, tokens)
    out = pl.pallas_call(
        functools.partial(_fwd_kernel, NB=NB, d=d, DC=chunk, eps=eps),
        out_shape=jax.ShapeDtypeStruct((Np, d), prefix.dtype), grid=(Np // tokens,),
        in_specs=[sp["n"], sp["q"], sp["blocks"], sp["rows"]], out_specs=sp["rows"],
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=1), interpret=interpret,
        name="attnres_mix")(jnp.reshape(num_blocks, (1,)).astype(jnp.int32), query.astype(F32), bl, pr)
    return out[:N].reshape(prefix.shape)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "tokens", "chunk", "warps"))
def grads_kernel(blocks, num_blocks, prefix, query, g, dblocks, *, eps: float, interpret: bool,
                 tokens: int = TOKENS, chunk: int = CHUNK, warps: int = WARPS):
    """The fused backward: `grads_xla`'s results; dblocks is updated in place."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    NB, d = blocks.shape[0], blocks.shape[-1]
    N = prefix.size // d
    bl, pr = _flat(blocks, prefix, tokens)
    dbl, _ = _flat(dblocks, prefix, tokens)
    gf = _pad_tokens(g.reshape(-1, d), 0, tokens)
    Np = pr.shape[0]
    P = Np // tokens
    sp = _specs(NB, d, tokens)
    new_bl, new_pr, part = pl.pallas_call(
        functools.partial(_bwd_kernel, NB=NB, d=d, DC=chunk, eps=eps),
        out_shape=(jax.ShapeDtypeStruct(dbl.shape, dbl.dtype), jax.ShapeDtypeStruct(pr.shape, prefix.dtype),
                   jax.ShapeDtypeStruct((P, d), F32)),
        grid=(P,),
        in_specs=[sp["n"], sp["q"], sp["blocks"], sp["rows"], sp["rows"], sp["blocks"]],
        out_specs=(sp["blocks"], sp["rows"], sp["part"]),
        input_output_aliases={5: 0},
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=1), interpret=interpret,
        name="attnres_mix_grad")(jnp.reshape(num_blocks, (1,)).astype(jnp.int32), query.astype(F32),
                                 bl, pr, gf, dbl)
    new_blocks = new_bl[:, :N].reshape(blocks.shape)
    return new_blocks, new_pr[:N].reshape(prefix.shape), jnp.sum(part, axis=0)


# --------------------------------------------------------------------------------------
# the site


def resolve_impl(impl: str, blocks, prefix) -> str:
    """model.attn_res_impl -> "xla" | "kernel" | "interpret". auto: the kernels where they
    compile (a GPU target, the sources fit), XLA elsewhere; kernel: the kernels everywhere (off
    a GPU in the Pallas interpreter: tests)."""
    from k3jax.ops.mesh_axes import active_mesh
    from k3jax.ops.planning import target_backend, triton_stand_in

    if impl == "xla":
        return "xla"
    why = kernel_unsupported(blocks, prefix)
    if impl == "kernel":
        if why:
            raise ValueError(f"model.attn_res_impl=kernel: {why}")
        return "kernel" if target_backend() == "gpu" and not triton_stand_in() else "interpret"
    if impl != "auto":
        raise ValueError(f"model.attn_res_impl: unknown {impl!r} (auto, kernel, xla)")
    # one device only: under a mesh the pallas_call would need a shard_map over the token axes
    # (not written yet), and GSPMD would gather the sources to every device around it
    one_device = active_mesh(required_axes=()) is None
    return "kernel" if target_backend() == "gpu" and not triton_stand_in() and why is None and one_device else "xla"


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def attn_res_site(blocks, num_blocks, prefix, query, eps: float, impl: str):
    """-> (out [B,T,d] in prefix's dtype, blocks): the mix, and the block buffer passed
    through (use it downstream; see the module docstring).

    blocks [NB,B,T,d]; num_blocks int32 scalar (valid slots); prefix [B,T,d]; query [d] fp32;
    impl "xla" | "kernel" | "interpret" (the kernels in the Pallas interpreter)."""
    return _forward(blocks, num_blocks, prefix, query, eps, impl), blocks


def _forward(blocks, num_blocks, prefix, query, eps, impl):
    if impl == "xla":
        return mix_xla(blocks, num_blocks, prefix, query, eps)
    return mix_kernel(blocks, num_blocks, prefix, query, eps=eps, interpret=impl == "interpret")


def _site_fwd(blocks, num_blocks, prefix, query, eps, impl):
    # residuals: the inputs only (the sources are held anyway: the block buffer and the carry)
    out = _forward(blocks, num_blocks, prefix, query, eps, impl)
    return (out, blocks), (blocks, num_blocks, prefix, query)


def _site_bwd(eps, impl, res, cts):
    blocks, num_blocks, prefix, query = res
    g, dblocks = cts
    if impl == "xla":
        new_blocks, new_prefix, dq = grads_xla(blocks, num_blocks, prefix, query, g, dblocks, eps)
    else:
        new_blocks, new_prefix, dq = grads_kernel(blocks, num_blocks, prefix, query, g, dblocks,
                                                  eps=eps, interpret=impl == "interpret")
    return new_blocks, None, new_prefix, dq.astype(query.dtype)


attn_res_site.defvjp(_site_fwd, _site_bwd)
