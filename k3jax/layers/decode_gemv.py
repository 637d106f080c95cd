"""A decode step's projections through the gemv kernel (k3jax/ops/decode_kernels/gemv.py).

    with decode_step_scope(model_cfg, rows):            # the model, around one decode step
        y = dense(x)                                     # one kernel launch instead of XLA's two
        q, k, v = dense_group(x, [q_proj, k_proj, v_proj])               # one launch for three
        z, c = dense_group(x, [down, up], norm=rms_norm_module)          # RMSNorm folded in

Inside the scope (set by `K3Model.forward_cached` for a call of one token per row, when the
decode kernels are on: `runs_fused`), every projection of at most `gemv.MAX_ROWS` rows
runs through the kernel: `Dense` and `HeadsOutDense` themselves, and `dense_group` for several
projections of one input (the layers group those that share it). Outside it, or for more
rows, under a mesh, or for shapes the kernel does not take, everything is the plain XLA path.
The result is the same computation (operands in the compute dtype, fp32 accumulation, the
output cast as Dense casts it); tests/test_decode_fast.py checks it against the plain path.

The scope is a context variable read while tracing, like `k3jax.ops.planning`'s: it says
which form a traced call takes, not a setting of the model.

Stacked weights: a decode step's scan over a stage's repeats takes each layer's parameters as a
slice of the stage's stacked ones (`slice_stacked`, in `StackedUnits`). XLA fuses such a slice
into the XLA ops that read it, but copies it before a custom call: every weight a kernel reads
would be read, written and read again. So the scan remembers which stacked array and index
each slice came from (`stacked_scope`), and the kernels read the stacked array in place at that
index (`stacked`), as the KDA and MLA kernels read their stacked caches (LayerCache).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp

from k3jax.ops.decode_kernels import gemv
from k3jax.ops.decode_kernels.common import interpret, resolve_impl
from k3jax.ops.mesh_axes import active_mesh

F32 = jnp.float32
_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("k3jax_decode_gemv", default=False)
_SLICES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("k3jax_stacked_slices", default=None)


@contextlib.contextmanager
def stacked_scope():
    """Inside, `slice_stacked` remembers where its slices come from (for `stacked`)."""
    token = _SLICES.set({})
    try:
        yield
    finally:
        _SLICES.reset(token)


def slice_stacked(tree, index):
    """Every leaf's slice `index` (int32 scalar) along its first axis: one repeat's parameters of
    a stage's stacked ones. Inside `stacked_scope` each slice is remembered with its source."""
    reg = _SLICES.get()

    def one(a):
        s = jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False)
        if reg is not None:
            reg[id(s)] = (s, a, index)
        return s

    return jax.tree.map(one, tree)


def stacked(w):
    """(array [L, *w.shape], index) holding w at `index`: the stacked parameter w was sliced
    from by `slice_stacked`, or (w[None], 0) for any other array."""
    reg = _SLICES.get()
    hit = None if reg is None else reg.get(id(w))
    if hit is not None and hit[0] is w:
        return hit[1], hit[2]
    return w[None], jnp.zeros((), jnp.int32)


def runs_fused(cfg, rows: int) -> bool:
    """Whether a decode step of `rows` sequences runs the fused kernels (model config `cfg`):
    model.decode_fused, rows <= model.decode_fused_max_batch, and model.decode_impl resolving to
    the kernels on this backend. The one rule: the model's decode step and the benchmarks'
    labels both ask it."""
    return bool(cfg.decode_fused and rows <= cfg.decode_fused_max_batch and resolve_impl(cfg.decode_impl) == "pallas")


@contextlib.contextmanager
def decode_step_scope(cfg, rows: int):
    """Inside, a decode step of `rows` sequences runs its fused kernels (projections of a few
    rows through the gemv kernel, and the layers' other decode kernels) when `runs_fused` says so."""
    token = _ON.set(runs_fused(cfg, rows))
    try:
        yield
    finally:
        _ON.reset(token)


def active() -> bool:
    return _ON.get() and active_mesh() is None


def project(x, weights, dtypes, *, norm=None, eps: float = 1e-6, x_dtype=None, glu=None, x2=None, addends=(),
            round_dtype=None, out_dtypes=None, contract: int = 1):
    """x [..., K]; weights [K, *out_i] (or [*in, *out_i] with `contract` input axes, K their
    product) -> [x @ w_i [..., *out_i] fp32] in one kernel launch, with
    x RMS-normalised first when `norm` (gamma [K]) is given; None when the kernel does not apply
    here (outside the scope, too many rows, shapes it does not take). Weights (and gamma) sliced
    from a stage's stacked parameters are read in place (`stacked`). x_dtype, glu / x2,
    addends / round_dtype, out_dtypes: see gemv.fused_gemv (the input rounded first; a GLU of
    two inputs; residual adds after the output, which then is in the addends' dtype; the
    outputs' dtypes, written by the kernel)."""
    if not active():
        return None
    lead, K = x.shape[:-1], x.shape[-1]
    M = math.prod(lead)
    x2d = x.reshape(M, K)
    srcs = [stacked(w) for w in weights]  # before any reshape: the lookup is by identity
    flat = [s.reshape(s.shape[0], K, -1) for s, _ in srcs]
    if gemv.unsupported_reason(x2d, flat) is not None:
        return None
    g, g_layer = (None, None) if norm is None else stacked(norm)
    ys = gemv.fused_gemv(x2d, flat, dtypes=dtypes, layers=[i for _, i in srcs], norm=g, norm_layer=g_layer, eps=eps,
                         x_dtype=x_dtype, glu=glu, x2=None if x2 is None else x2.reshape(M, K),
                         addends=[a.reshape(M, -1) for a in addends], round_dtype=round_dtype, out_dtypes=out_dtypes,
                         interpret=interpret())
    return [y.reshape(lead + w.shape[contract:]) for y, w in zip(ys, weights)]


def dense_group(x, denses, *, out_dtypes=None, norm=None):
    """[dense(norm(x), out_dtype) for each dense] (norm: an RMSNorm module, or None): one kernel
    launch inside the decode scope, the plain calls otherwise."""
    out_dtypes = list(out_dtypes or [None] * len(denses))
    if active():
        ys = project(x, [d.kernel[...] for d in denses], [d.compute for d in denses],
                     norm=None if norm is None else norm.weight[...], eps=1e-6 if norm is None else norm.eps,
                     out_dtypes=[o if o is not None else d.compute for d, o in zip(denses, out_dtypes)])
        if ys is not None:
            return ys
    h = x if norm is None else norm(x)
    return [d(h, out_dtype=o) for d, o in zip(denses, out_dtypes)]
