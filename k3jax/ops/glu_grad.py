"""The experts' GLU on the concatenated gate|up product, with its backward as one XLA fusion or
one Pallas kernel.

    glu_of_gate_up(gate_up [M, 2H], valid_rows, spec, backward) -> h [M, H] = glu(gate_up[:, :H], gate_up[:, H:]),
                                                                  0 in rows >= valid_rows

spec = (name, beta, linear_beta) as `k3jax.layers.activations.glu_spec` gives it (SiTU-GLU, or
SwiGLU for any other name); the forward is that GLU in fp32, rounded to gate_up's dtype, as
`apply_glu` computes it. The backward, for dh [M, H]:

    d(gate_up)[:, :H] = dh * up(b) * gate'(a),   d(gate_up)[:, H:] = dh * gate(a) * up'(b)

Why: on the kernel path the gate and up products are one GEMM's output, so autodiff of the GLU
on its two halves writes d(gate_up) as a sum of two pads, and XLA:GPU, which will not evaluate
the tanh/sigmoid feeding both halves twice, stores them in fp32 first: per MoE layer of k3-small
a copy of each half, two f32 [M, H] arrays and a select: 4.3 GB read and written, where both
forms here read gate_up and dh once and write d(gate_up) once (1.3 GB; compiled for an H200,
`benchmarks/tools/glue_regions.py`: the step's MoE glue fell from 186 to 142 GB):
- `glu_grad_xla` (model.moe.glu_grad=xla, the default): written so that XLA:GPU emits one loop
  fusion (its docstring says how);
- `glu_grad` (pallas): each program reads one [BM, BH] tile of a, of b and of dh, and writes both
  halves of its rows. 0.64-0.68 ms against autodiff's 1.38 alone; in the step, as fast as the
  fusion (523.9 against 525.0 ms, one lease, kernels-2026-12-02d/3-variants), so it stays opt-in:
  a custom call also needs each layer's saved gate|up copied out of the scan's stack (12.9 GB a
  step, compiled for an H200), where the fusion reads it in place.

The rows past `valid_rows` (the grouped GEMMs' unrouted rows, which tokamax's kernels leave
unwritten) are zeroed here, in the forward's fusion and in both backwards (a select: whatever
those rows of gate_up or dh hold, their h and d(gate_up) are 0). So the grouped GEMM on either
side needs no masking pass of its own: on the H200 a select XLA placed between two custom calls
took 17.9 ms of a 551 ms k3-small step (2026-12-02 evening, kernels-2026-12-02c/2-profiles).
`glu_grad_reference` is the plain form (autodiff of the forward).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.ops.decode_kernels.common import glu_f32, interpret

F32 = jnp.float32
ROWS, COLS, WARPS = (64, 32, 16), (128, 64, 32, 16), 4


def _sigmoid_exp(x):  # Triton lowers exp; 1 / (1 + e^-x) is the logistic it computes
    return 1.0 / (1.0 + jnp.exp(-x))


def glu_grads_f32(spec, a, b, g, sigmoid=jax.nn.sigmoid):
    """(da, db) in fp32 for fp32 a, b and the fp32 cotangent g of the GLU `spec` (module
    docstring): the one copy of these formulas, used by `k3jax.layers.activations`' hand-written
    VJPs (XLA) and by the kernel (sigmoid written with exp)."""
    name, beta, linear_beta = spec
    s = sigmoid(a)
    if name == "situ":
        t = jnp.tanh(a / beta)
        gate = beta * t * s
        d_gate = (1.0 - t * t) * s + gate * (1.0 - s)
        if linear_beta is None:
            up, d_up = b, 1.0
        else:
            u = jnp.tanh(b / linear_beta)
            up, d_up = linear_beta * u, 1.0 - u * u
        return g * up * d_gate, g * gate * d_up
    return g * b * s * (1.0 + a * (1.0 - s)), g * a * s


def tile(gate_up) -> tuple[int | None, int | None]:
    """(rows, columns) of the tile for gate_up [M, 2H]: the largest of ROWS / COLS dividing M / H."""
    M, H = gate_up.shape[0], gate_up.shape[1] // 2
    return next((r for r in ROWS if M % r == 0), None), next((c for c in COLS if H % c == 0), None)


def unsupported_reason(gate_up) -> str | None:
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        return f"gate_up must be [M, 2H], got {gate_up.shape}"
    if None in tile(gate_up):
        return f"M={gate_up.shape[0]} and H={gate_up.shape[1] // 2} must be multiples of 16"
    return None


def _grad_kernel(a_ref, b_ref, g_ref, n_ref, out_ref, *, spec, BM: int, BH: int, H: int):
    from jax.experimental import pallas as pl

    i, j = pl.program_id(0), pl.program_id(1)
    da, db = glu_grads_f32(spec, a_ref[...].astype(F32), b_ref[...].astype(F32), g_ref[...].astype(F32),
                           sigmoid=_sigmoid_exp)
    valid = (i * BM + jax.lax.broadcasted_iota(jnp.int32, (BM, 1), 0)) < n_ref[...][None, :]  # [BM, 1]
    da, db = jnp.where(valid, da, 0.0), jnp.where(valid, db, 0.0)  # a select: NaN in a dropped row stays out
    rows = pl.ds(pl.multiple_of(i * BM, BM), BM)
    out_ref[rows, pl.ds(pl.multiple_of(j * BH, BH), BH)] = da.astype(out_ref.dtype)
    out_ref[rows, pl.ds(pl.multiple_of(H + j * BH, BH), BH)] = db.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("spec", "interpret", "warps"))
def glu_grad(gate_up, dh, spec: tuple, *, valid_rows=None, interpret: bool = False, warps: int = WARPS):
    """d(gate_up) [M, 2H] in gate_up's dtype for dh [M, H] (module docstring), 0 in the rows at
    and past valid_rows (an int32 scalar; None: every row)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltr

    if (why := unsupported_reason(gate_up)) is not None:
        raise ValueError(f"glu_grad: {why}")
    M, H = gate_up.shape[0], gate_up.shape[1] // 2
    bm, bh = tile(gate_up)
    nh = H // bh
    n = jnp.full((1,), M if valid_rows is None else valid_rows, jnp.int32)
    return pl.pallas_call(
        functools.partial(_grad_kernel, spec=spec, BM=bm, BH=bh, H=H),
        out_shape=jax.ShapeDtypeStruct(gate_up.shape, gate_up.dtype),
        grid=(M // bm, nh),
        in_specs=[pl.BlockSpec((bm, bh), lambda i, j: (i, j)), pl.BlockSpec((bm, bh), lambda i, j: (i, j + nh)),
                  pl.BlockSpec((bm, bh), lambda i, j: (i, j)), pl.BlockSpec((1,), lambda i, j: (0,))],
        out_specs=pl.BlockSpec(gate_up.shape, lambda i, j: (0, 0)),
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=1), interpret=interpret,
        name="glu_grad")(gate_up, gate_up, dh, n)


def _forward(gate_up, spec):
    H = gate_up.shape[1] // 2
    return glu_f32(spec, gate_up[:, :H].astype(F32), gate_up[:, H:].astype(F32)).astype(gate_up.dtype)


def _masked_forward(gate_up, valid_rows, spec):
    h = _forward(gate_up, spec)
    return jnp.where((jnp.arange(h.shape[0], dtype=jnp.int32) < valid_rows)[:, None], h, jnp.zeros((), h.dtype))


def glu_grad_xla(gate_up, dh, spec: tuple, *, valid_rows=None):
    """`glu_grad` as one XLA fusion: d(gate_up) [M, 2H] in gate_up's dtype, 0 in the rows at and
    past valid_rows (None: every row).

    Written over the [M, 2, H] view x of gate_up: each element (m, p, j) reads its own value and
    its partner in the other half (x reversed over the pair axis), takes a and b from those two by
    a select on p, and selects the gate or the up formula. Every tanh and sigmoid then has one
    [M, 2, H] operand, so XLA:GPU fuses the whole backward into one loop fusion that reads gate_up
    and dh once and writes d(gate_up) once, evaluating a's and b's tanh/sigmoid in both halves
    (cheap beside the memory traffic). Broadcasting a and b over the pair axis instead lets XLA
    hoist each tanh above its broadcast, and it will not fuse a tanh that would then run twice:
    it stores them in fp32 first, as autodiff of the sliced forward does (module docstring).
    Compiled for an H200 at k3-small's [262,144, 1,024]: 1.3 GB of traffic against 4.3."""
    M, H = gate_up.shape[0], gate_up.shape[1] // 2
    x = gate_up.reshape(M, 2, H).astype(F32)
    partner = jnp.flip(x, axis=1)
    first = jax.lax.broadcasted_iota(jnp.int32, (M, 2, H), 1) == 0
    a, b = jnp.where(first, x, partner), jnp.where(first, partner, x)
    g = jnp.broadcast_to(dh.astype(F32)[:, None, :], (M, 2, H))
    da, db = glu_grads_f32(spec, a, b, g)
    out = jnp.where(first, da, db)
    if valid_rows is not None:  # a select: NaN in a dropped row stays out
        rows = jax.lax.broadcasted_iota(jnp.int32, (M, 2, H), 0)
        out = jnp.where(rows < valid_rows, out, 0.0)
    return out.astype(gate_up.dtype).reshape(M, 2 * H)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def glu_of_gate_up(gate_up, valid_rows, spec: tuple, backward: str = "xla"):
    """gate_up [M, 2H], valid_rows an int32 scalar -> h [M, H] in gate_up's dtype, 0 in rows >=
    valid_rows (module docstring). backward: "xla" (`glu_grad_xla`, one fusion) or "pallas" (the
    `glu_grad` kernel; in the Pallas interpreter off a GPU)."""
    return _masked_forward(gate_up, valid_rows, spec)


def _fwd(gate_up, valid_rows, spec, backward):
    return _masked_forward(gate_up, valid_rows, spec), (gate_up, valid_rows)


def _bwd(spec, backward, res, dh):
    gate_up, valid_rows = res
    dh = dh.astype(gate_up.dtype)
    if backward == "xla":
        return glu_grad_xla(gate_up, dh, spec, valid_rows=valid_rows), None
    return glu_grad(gate_up, dh, spec, valid_rows=valid_rows, interpret=interpret()), None


glu_of_gate_up.defvjp(_fwd, _bwd)


def glu_grad_reference(gate_up, dh, spec: tuple):
    """The plain form: autodiff of the fp32 forward (tests)."""
    _, vjp = jax.vjp(lambda gu: glu_f32(spec, gu[:, :gate_up.shape[1] // 2], gu[:, gate_up.shape[1] // 2:]),
                     gate_up.astype(F32))
    return vjp(dh.astype(F32))[0].astype(gate_up.dtype)
