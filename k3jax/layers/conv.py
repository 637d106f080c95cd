"""Causal depthwise short convolution + SiLU (fla ShortConvolution), with segment resets.

y_t[c] = SiLU( sum_{i<W} w[i, c] * x_{t-W+1+i}[c] ), where inputs before the start of
the current segment count as 0. The decode state is the last W-1 pre-conv inputs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from k3jax.layers.common import CONV, HEADS, uniform_param
from k3jax.layers.norms import l2_normalize_reference
from k3jax.ops import short_conv_grad as kernel_grad
from k3jax.ops.decode_kernels.common import interpret, resolve_for_shape
from k3jax.ops.mesh_axes import active_mesh, row_head_axes
from k3jax.ops.norm_vjp import scaled_vjp
from k3jax.segments import segment_counter


class ShortConv(nnx.Module):
    """Depthwise causal conv over the channel axis of x [B,T,P]; weight [W, P] in fp32."""

    def __init__(self, channels: int, size: int, *, rngs: nnx.Rngs, impl: str = "xla"):
        # PyTorch Conv1d's default init (the K3 init is not public): U(-1/sqrt(W), 1/sqrt(W))
        bound = size ** -0.5
        self.weight = uniform_param(rngs, (size, channels), (CONV, HEADS), -bound, bound)
        self.size = size
        self.impl = impl  # the backward's form (model.kda.conv_impl)

    def __call__(self, x, segment_ids, window=None):
        """x [B,T,P]; segment_ids [B,T]; window [B,W-1,P] of earlier inputs of the same
        segment as x's first token (zeros when it starts a new one), or None.

        Returns (SiLU(conv(x)) in x's dtype, the next window [B,W-1,P] in x's dtype).
        """
        return short_conv(self.weight[...], x, segment_ids, window, impl=self.impl)

    def normalized(self, x, segment_ids, window, group: int, eps: float):
        """(l2-normalised SiLU(conv(x)) over each `group` channels, fp32; the next window):
        `short_conv_normalized`."""
        return short_conv_normalized(self.weight[...], x, segment_ids, window, group, eps, impl=self.impl)


def short_conv_reference(weight, x, segment_ids, window=None):
    """The plain form of `short_conv` (autodiff's backward); the tests compare the two."""
    B, T, P = x.shape
    W = weight.shape[0]
    if window is None:
        window = jnp.zeros((B, W - 1, P), x.dtype)
    r = segment_counter(segment_ids)
    y = _conv_silu_reference(weight, x, window, r)
    return y, _next_window(x, window, r, W)


def _conv_silu_reference(weight, x, window, r):
    """SiLU(sum_i w[i] * x_{t-W+1+i}) in fp32 (taps across a segment start count as 0) -> x's dtype."""
    return jax.nn.silu(_conv_acc(weight, x, window, r)).astype(x.dtype)


def _extended(x, window):
    """[window; x] [B, W-1+T, P] in their common dtype, converted to fp32 only where a tap reads it:
    exact (bf16 -> fp32 is), and where XLA writes the concatenation out (the backward reads it
    in two fusions) it writes x's bf16, half the bytes of an fp32 copy."""
    dtype = jnp.result_type(window.dtype, x.dtype)
    return jnp.concatenate([window.astype(dtype), x.astype(dtype)], axis=1)


def _conv_acc(weight, x, window, r):
    B, T, P = x.shape
    W = weight.shape[0]
    w = weight.astype(jnp.float32)
    xp = _extended(x, window)  # [B, W-1+T, P]
    r_ext = jnp.concatenate([jnp.zeros((B, W - 1), r.dtype), r], axis=1)  # window rows: segment 0
    acc = jnp.zeros((B, T, P), jnp.float32)
    for i in range(W):  # tap i reads x_{t-(W-1)+i}
        src = jax.lax.dynamic_slice_in_dim(xp, i, T, axis=1).astype(jnp.float32)
        same = jax.lax.dynamic_slice_in_dim(r_ext, i, T, axis=1) == r
        acc = acc + jnp.where(same[..., None], src, 0.0) * w[i]
    return acc


def _next_window(x, window, r, W):
    """The next call continues x's last segment: keep only that segment's last W-1 inputs."""
    B = x.shape[0]
    xp = _extended(x, window)
    r_ext = jnp.concatenate([jnp.zeros((B, W - 1), r.dtype), r], axis=1)
    tail, tail_r = xp[:, -(W - 1):], r_ext[:, -(W - 1):]
    return jnp.where((tail_r == r[:, -1:])[..., None], tail, jnp.zeros((), tail.dtype)).astype(x.dtype)


# The conv with its own VJP: the backward recomputes the fp32 accumulator from x (4 taps),
# forms d(acc) through SiLU and sends it back along the taps (dx, the window's gradient) and
# into the weight (one [W, P] reduction), in fewer passes than autodiff's pads, slices and
# per-tap reductions (180 small kernels per k3-small backward scan body). The XLA form below
# still took 0.92 ms per conv on an H200; the "pallas" backward (k3jax.ops.short_conv_grad,
# the default on a GPU through model.kda.conv_impl=auto) is one kernel, 0.73 ms (BENCHMARKS.md §4).


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _conv_silu(weight, x, window, r, backward: str):
    return _conv_silu_reference(weight, x, window, r)


def _conv_silu_fwd(weight, x, window, r, backward):
    return _conv_silu_reference(weight, x, window, r), (weight, x, window, r)


def _conv_silu_bwd(backward, res, g):
    weight, x, window, r = res
    if backward == "pallas":
        dw, dx, dwin = _kernel_backward(weight, x, window, r, g)
        return dw, dx, dwin, None
    B, T, P = x.shape
    W = weight.shape[0]
    acc = _conv_acc(weight, x, window, r)
    s = jax.nn.sigmoid(acc)
    dacc = g.astype(jnp.float32) * s * (1.0 + acc * (1.0 - s))
    xp = _extended(x, window)
    r_ext = jnp.concatenate([jnp.zeros((B, W - 1), r.dtype), r], axis=1)
    w = weight.astype(jnp.float32)
    dxp = jnp.zeros((B, W - 1 + T, P), jnp.float32)
    dw = []
    for i in range(W):
        same = jax.lax.dynamic_slice_in_dim(r_ext, i, T, axis=1) == r
        dm = jnp.where(same[..., None], dacc, 0.0)
        dxp = dxp + jnp.pad(dm * w[i], ((0, 0), (i, W - 1 - i), (0, 0)))
        dw.append(jnp.sum(dm * jax.lax.dynamic_slice_in_dim(xp, i, T, axis=1).astype(jnp.float32), axis=(0, 1)))
    return (jnp.stack(dw).astype(weight.dtype), dxp[:, W - 1:].astype(x.dtype),
            dxp[:, :W - 1].astype(window.dtype), None)


_conv_silu.defvjp(_conv_silu_fwd, _conv_silu_bwd)


def _grouped(a, group: int):
    return a.reshape(a.shape[:-1] + (a.shape[-1] // group, group))


def _conv_silu_norm_reference(weight, x, window, r, group: int, eps: float):
    """l2_normalize(SiLU(conv(x)) in x's dtype) over each `group` channels, fp32 [B,T,P]: the
    conv, then `k3jax.layers.norms.l2_normalize` per group, as KDA applied them one after the other."""
    y = _conv_silu_reference(weight, x, window, r)
    return l2_normalize_reference(_grouped(y, group), eps).reshape(x.shape)


# The conv and the l2 norm after it (KDA's q and k, per head) under one VJP: the backward
# takes the norm's backward on the recomputed conv output and goes on through the conv's, in
# the Pallas kernel (one pass over x and the cotangent) or as the two XLA backwards in a row.
# Unfused, the norm's backward was three XLA kernels per q and per k (a row reduction, a
# [B,T,H] product, a [B,T,P] pass) writing the conv's cotangent, which the conv's backward
# then read: 0.5 GB per call at k3-small's [8, 4096, 1536], 24 of them per step. On an H200
# (BENCHMARKS.md §4, kernels-2026-12-02d): k3-small's step 525.0 ms against 552.3 with XLA's
# backwards for every conv (model.kda.conv_impl=xla), one lease; the conv and norm lines of the
# profile 33.6 ms against 50.6 that morning. Alone, forward + backward at that shape, the
# kernel form took 1.14-1.16 ms against XLA's 1.05: in the step XLA fuses the recomputed convs
# of three layers into one slow multi-output fusion, which the kernel form does not have.
# Under context parallelism KDA keeps the two apart (cp.short_conv, then l2_normalize).


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _conv_silu_norm(weight, x, window, r, group: int, eps: float, backward: str):
    return _conv_silu_norm_reference(weight, x, window, r, group, eps)


def _conv_silu_norm_fwd(weight, x, window, r, group, eps, backward):
    return _conv_silu_norm_reference(weight, x, window, r, group, eps), (weight, x, window, r)


def _conv_silu_norm_bwd(group, eps, backward, res, dn):
    weight, x, window, r = res
    if backward == "pallas":
        dw, dx, dwin = _kernel_backward(weight, x, window, r, dn, normalize=(group, eps))
        return dw, dx, dwin, None
    y = _conv_silu_reference(weight, x, window, r)
    dy = scaled_vjp(_grouped(y, group), _grouped(dn.astype(jnp.float32), group), eps, False)[0].reshape(y.shape)
    return _conv_silu_bwd("xla", res, dy)


_conv_silu_norm.defvjp(_conv_silu_norm_fwd, _conv_silu_norm_bwd)


def _shard_shape(x, group: int = 1):
    """x [B,T,P], or its shape on one device when a mesh is active (what the kernel sees; channels
    split in whole groups)."""
    mesh = active_mesh(required_axes=())
    if mesh is None:
        return x
    rows, chans = row_head_axes(mesh, x.shape[0], x.shape[2] // group)
    split = lambda axes: math.prod(mesh.shape[a] for a in axes or ())  # noqa: E731
    return jax.ShapeDtypeStruct((x.shape[0] // split(rows), x.shape[1], x.shape[2] // split(chans)), x.dtype)


def _kernel_backward(weight, x, window, r, g, normalize=None):
    """The Pallas backward, run per shard under an active mesh. A pallas_call is one device's
    program: under XLA's SPMD partitioner every operand would be gathered whole onto each device
    first (k3.yaml's plan on 2,048 H200s: 310 GB of temporaries per device). Rows over the batch
    axes and channels over `tensor` (whole normalisation groups, with normalize = (group, eps));
    the weight gradient is summed over the row shards. Inside a shard_map already (context
    parallelism) there is no active mesh and it runs as it is."""
    run = functools.partial(kernel_grad.short_conv_grad, interpret=interpret(), normalize=normalize)
    mesh = active_mesh(required_axes=())
    if mesh is None:
        return run(weight, x, window, r, g)
    group = 1 if normalize is None else normalize[0]
    rows, chans = row_head_axes(mesh, x.shape[0], x.shape[2] // group)
    x3 = PartitionSpec(rows, None, chans)

    def local(weight, x, window, r, g):
        dw, dx, dwin = run(weight, x, window, r, g)
        return (dw if rows is None else jax.lax.psum(dw, rows)), dx, dwin

    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(None, chans), x3, x3, PartitionSpec(rows, None), x3),
                         out_specs=(PartitionSpec(None, chans), x3, x3), check_vma=False)(weight, x, window, r, g)


def short_conv(weight, x, segment_ids, window=None, impl: str = "xla"):
    """The module's computation as a function of its weight [W,P] (context parallelism runs it
    per shard, with the upstream shard's last inputs as the window). impl: the backward's form,
    as `model.kda.conv_impl` (auto: the Pallas kernel on a GPU where it takes the shape)."""
    B, T, P = x.shape
    W = weight.shape[0]
    if window is None:
        window = jnp.zeros((B, W - 1, P), x.dtype)
    r = segment_counter(segment_ids)
    backward = conv_backward(impl, _shard_shape(x), W)  # the kernel's tile rules apply to one shard
    return _conv_silu(weight, x, window, r, backward), _next_window(x, window, r, W)


def short_conv_normalized(weight, x, segment_ids, window, group: int, eps: float, impl: str = "xla"):
    """(`short_conv`'s output l2-normalised over each `group` consecutive channels, in fp32 [B,T,P];
    the next window): the conv and `k3jax.layers.norms.l2_normalize` one after the other (KDA's
    q and k, a head per group), with one backward for both (`_conv_silu_norm`)."""
    B, T, P = x.shape
    W = weight.shape[0]
    if window is None:
        window = jnp.zeros((B, W - 1, P), x.dtype)
    r = segment_counter(segment_ids)
    backward = conv_backward(impl, _shard_shape(x, group), W, group)
    return _conv_silu_norm(weight, x, window, r, group, eps, backward), _next_window(x, window, r, W)


def conv_backward(impl: str, x, size: int, norm_group: int | None = None) -> str:
    """"pallas" or "xla": the backward that runs for x [B,T,P] and `impl` (auto | pallas | xla),
    with q/k's l2 norm over groups of norm_group channels inside it when given. pallas on a width P
    or group the kernel cannot take (a property of the config) is an error saying why; a length T
    it cannot take (a decode step, an odd prompt) runs XLA's, as auto does."""
    width_fault = kernel_grad.tile(x)[1] is None or (
        norm_group is not None and kernel_grad.group_reason(norm_group, x.shape[2]) is not None)
    return resolve_for_shape(impl, "model.kda.conv_impl", kernel_grad.unsupported_reason(x, size, norm_group),
                             width_fault=width_fault)
