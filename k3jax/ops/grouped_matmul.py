"""Grouped matmul for dropless MoE: rows sorted by group, each group times its own weight.

    x [M,D] (rows of group g contiguous, groups in order), w [G,D,F], group_sizes [G] int
    -> y [M,F];  y[r] = x[r] @ w[g(r)], and 0 for rows past sum(group_sizes).

Three fast forms of the same function:

* `kernel`: tokamax's grouped-GEMM kernels (`tokamax.ragged_dot`: Pallas Mosaic-GPU on
  Hopper, Triton elsewhere on GPU), the GPU extra (`pip install -e '.[gpu]'`). The default
  on GPU when tokamax imports; measured 1.8x the blocked form at k3-small's shape (BENCHMARKS.md).
  On an H100/H200 with k3jax's launch configs (`k3jax.ops.grouped_matmul_configs`: tokamax's
  own fallback computes a wrong weight gradient there), each kernel call its own jit.
* `ragged`: `jax.lax.ragged_dot`. Native grouped GEMM on TPU.
* `blocked`: every group is padded up to a multiple of `block` rows, so each block of
  `block` rows belongs to one group and the product is one batched matmul
  [nb,block,D] x [nb,D,F] over blocks, with the block's weight gathered. The default on
  GPU and CPU, where XLA (as of jax 0.10/0.11) rewrites ragged_dot into a dense dot over
  *all* groups: G times the FLOPs and a [G, M, F]-sized buffer (k3-small, 64 experts:
  98 GB vs 9 GB on an H200 at 32k tokens; 132 vs 44 GiB of XLA:CPU temporaries per
  4096-token sequence). Padding costs at most G*(block-1) rows, and the weight
  gather nb*D*F elements; block 512 was the fastest at k3-small's shapes on an H200 (BENCHMARKS.md).
  The GPU fallback when tokamax is not installed.

`grouped_matmul_reference` is the naive per-row form the tests compare both against.
`grouped_glu_mlp` optionally fake-quantizes its GEMMs for QAT (`k3jax.ops.mx`).
"""

from __future__ import annotations

import functools
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from k3jax.ops import glu_grad as glu_grad_op
from k3jax.ops import grouped_dw
from k3jax.ops.decode_kernels.common import interpret, resolve_for_shape
from k3jax.ops.glu_grad import glu_of_gate_up
from k3jax.ops.gpu_extra import tokamax_unavailable
from k3jax.ops.planning import planning_target, target_backend
from k3jax.ops.remat_names import EXPERT_HIDDEN
from k3jax.ops.mx import ExpertQuant

Impl = Literal["auto", "kernel", "ragged", "blocked"]


def kernel_unavailable() -> str | None:
    """Why the `kernel` form cannot run here (None when it can)."""
    return tokamax_unavailable()


def default_impl() -> str:
    """This backend's form. k3jax-plan planning for a GPU plans the kernel (a GPU run has the
    [gpu] extra), through a stand-in (`_planning_stand_in`)."""
    backend = target_backend()
    if backend == "tpu":
        return "ragged"
    if backend == "gpu" and (planning_target() == "gpu" or kernel_unavailable() is None):
        return "kernel"
    return "blocked"


def resolve_impl(impl: str) -> str:
    """auto -> this backend's form; `kernel` where it cannot run is an error that says why."""
    if impl == "auto":
        return default_impl()
    if impl == "kernel" and planning_target() != "gpu" and (why := kernel_unavailable()):
        raise ValueError(f"grouped matmul impl 'kernel' cannot run: {why}")
    return impl


class BlockLayout(NamedTuple):
    """Where the M sorted rows sit in the padded block buffer [nb*block]; derived from the
    group sizes once and shared by every matmul over the same rows."""
    src: jax.Array  # [nb*block] source row of each padded slot (0 where empty)
    valid: jax.Array  # [nb*block] slot holds a row
    block_group: jax.Array  # [nb] the group each block belongs to
    dest: jax.Array  # [M] padded slot of each row
    in_a_group: jax.Array  # [M] row < sum(group_sizes)
    block: int


def block_layout(group_sizes, num_rows: int, block: int) -> BlockLayout:
    G = group_sizes.shape[0]
    block = max(1, min(block, num_rows))
    nb = -(-(num_rows + G * (block - 1)) // block)  # enough blocks for the worst-case padding
    sizes = group_sizes.astype(jnp.int32)
    padded = -(-sizes // block) * block
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    # each padded slot p reads source row starts[g] + (p - padded_starts[g]) when that is
    # inside group g, else zero; a gather (not a scatter) so its transpose has unique indices
    slot = jnp.arange(nb * block, dtype=jnp.int32)
    slot_group = jnp.minimum(jnp.searchsorted(padded_ends, slot, side="right"), G - 1).astype(jnp.int32)
    offset = slot - padded_starts[slot_group]
    valid = (offset < sizes[slot_group]) & (slot < padded_ends[-1])
    src = jnp.where(valid, starts[slot_group] + offset, 0)
    # row r of group g sits at padded slot padded_starts[g] + (r - starts[g])
    row = jnp.arange(num_rows, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, row, side="right"), G - 1).astype(jnp.int32)
    in_a_group = row < ends[-1]
    dest = jnp.where(in_a_group, padded_starts[row_group] + row - starts[row_group], 0)
    return BlockLayout(src, valid, slot_group[::block], dest, in_a_group, block)


def to_blocks(x, layout: BlockLayout):
    """[M,D] sorted rows -> [nb,block,D], zero in the padding."""
    xb = jnp.where(layout.valid[:, None], x[layout.src], jnp.zeros((), x.dtype))
    return xb.reshape(-1, layout.block, x.shape[-1])


def from_blocks(yb, layout: BlockLayout):
    """[nb,block,F] -> [M,F] in row order, zero past sum(group_sizes)."""
    y = yb.reshape(-1, yb.shape[-1])[layout.dest]
    return jnp.where(layout.in_a_group[:, None], y, jnp.zeros((), y.dtype))


def blocks_matmul(xb, w, layout: BlockLayout, preferred_element_type=None):
    """[nb,block,D] x (the block's group's [D,F]) -> [nb,block,F]."""
    return jnp.einsum("nbd,ndf->nbf", xb, w[layout.block_group], preferred_element_type=preferred_element_type)


def grouped_matmul(x, w, group_sizes, *, impl: Impl = "auto", block: int = 512, preferred_element_type=None,
                   weight_grad: str = "pallas"):
    """x [M,D], w [G,D,F], group_sizes [G] int32 (sum <= M) -> [M,F] in preferred_element_type.
    weight_grad: the kernel form's dw kernel, "pallas" (`k3jax.ops.grouped_dw`) or "tokamax"."""
    impl = resolve_impl(impl)
    if impl == "ragged":
        return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=preferred_element_type)
    if impl == "blocked":
        return grouped_matmul_blocked(x, w, group_sizes, block=block, preferred_element_type=preferred_element_type)
    if impl == "kernel":
        return grouped_matmul_kernel(x, w, group_sizes, preferred_element_type=preferred_element_type,
                                     weight_grad=weight_grad)
    raise ValueError(f"grouped_matmul impl must be auto, kernel, ragged or blocked, got {impl!r}")


def grouped_matmul_kernel(x, w, group_sizes, *, preferred_element_type=None, weight_grad: str = "pallas",
                          mask_input: bool = True, mask_output: bool = True):
    """tokamax's grouped GEMM (GPU only; see `kernel_unavailable`). Shapes as `grouped_matmul`.

    The kernels leave rows past sum(group_sizes) unwritten, so those rows are zeroed on the
    way in (their gradient then is exactly zero too) and on the way out. (Masking only y and dx
    instead, which is all the kernels need, measured no faster on an H200, 545.8 against 547.0
    ms per k3-small step: the selects fuse into their neighbours. Masking the inputs keeps a
    non-finite value in an unrouted row out of any kernel that masks by multiplying.) The weights are cast
    to the activations' dtype: the kernels take lhs and rhs of one dtype.

    mask_input=False / mask_output=False: the caller zeroes those rows itself, on the way in (x's
    rows past the sum are 0, and the caller masks the gradient it is handed back for them) or
    on the way out (the caller masks y's rows, and their cotangent). Where that masking runs
    inside the caller's own kernel (`k3jax.ops.glu_grad`), XLA has no separate select to run
    between two custom calls, which it cannot fuse into either."""
    rows = jnp.arange(x.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes)
    if mask_input:
        x = jnp.where(rows[:, None], x, jnp.zeros((), x.dtype))
    if weight_grad not in ("tokamax", "pallas"):
        raise ValueError(f"model.moe.gmm_weight_grad must be tokamax or pallas, got {weight_grad!r}")
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    if planning_target() is not None:
        y = _planning_stand_in(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), out_dtype)
    else:
        y = _kernel_ragged_dot(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), out_dtype, weight_grad)
    return jnp.where(rows[:, None], y, jnp.zeros((), y.dtype)) if mask_output else y


def _tokamax_call(lhs, rhs, group_sizes, kind: str, out_dtype):
    """One tokamax grouped GEMM (`k3jax.ops.tokamax_ragged_dot.call`: kind 'dot',
    'dot_trans_rhs' or 'contract'); imported here, where the kernels run."""
    from k3jax.ops import tokamax_ragged_dot

    return tokamax_ragged_dot.call(lhs, rhs, group_sizes, kind, out_dtype)


# One jit per kernel call. tokamax's Op.__call__ binds its arguments through pydantic, looks up
# its config and lowers a Mosaic-GPU kernel: in k3-small's train step (15 MoE layers, three
# GEMMs each, forward and backward, under remat and a scan) that Python ran at every call site
# the tracer met. As jitted functions, a shape met again is a cache hit: traced and lowered once.
@functools.partial(jax.jit, static_argnums=(3,))
def _kernel_forward(x, w, group_sizes, out_dtype):
    return _tokamax_call(x, w, group_sizes, "dot", out_dtype)


@functools.partial(jax.jit, static_argnums=(4,))
def _kernel_grads(x, w, group_sizes, dy, weight_grad: str):
    """dy [M,F] in x's dtype -> dx = dy w_g^T [M,D] (x's dtype), dw_g = x_g^T dy_g [G,D,F]
    (w's dtype): what tokamax's own VJP computes, each kernel's config chosen like the forward's.
    weight_grad "pallas": dw by `k3jax.ops.grouped_dw` where it takes the shapes (no transposed
    copy of x first; the Pallas interpreter off a GPU)."""
    dx = _tokamax_call(dy, w, group_sizes, "dot_trans_rhs", x.dtype)
    if weight_grad == "pallas" and grouped_dw.unsupported_reason(x, dy) is None:
        dw = grouped_dw.grouped_dw(x, dy, group_sizes, out_dtype=w.dtype, interpret=interpret())
    else:
        dw = _tokamax_call(x, dy, group_sizes, "contract", w.dtype)
    return dx, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _kernel_ragged_dot(x, w, group_sizes, out_dtype, weight_grad):
    """x [M,D] and w [G,D,F] of one dtype -> [M,F] out_dtype. A custom VJP because tokamax's
    backward multiplies the cotangent with the other operand and wants both in one dtype: an
    fp32 output (the experts' down projection) would hand it an fp32 cotangent against bf16
    operands. The cotangent is rounded to the operands' dtype, as a bf16 matmul's inputs are."""
    return _kernel_forward(x, w, group_sizes, out_dtype)


def _kernel_ragged_dot_fwd(x, w, group_sizes, out_dtype, weight_grad):
    return _kernel_forward(x, w, group_sizes, out_dtype), (x, w, group_sizes)


def _kernel_ragged_dot_bwd(out_dtype, weight_grad, res, dy):
    x, w, group_sizes = res
    dx, dw = _kernel_grads(x, w, group_sizes, dy.astype(x.dtype), weight_grad)
    return dx, dw, None


_kernel_ragged_dot.defvjp(_kernel_ragged_dot_fwd, _kernel_ragged_dot_bwd)


# k3jax-plan: tokamax's Mosaic-GPU kernels compile only with a GPU attached, so planning for
# one traces this instead: the kernel's output, and what its backward keeps and makes (x, w;
# dx [M,D], dw [G,D,F]), by one dense product with a single group's weight (compiled for its
# memory, never run for results)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _planning_stand_in(x, w, group_sizes, out_dtype):
    return jnp.dot(x, w[0], preferred_element_type=out_dtype)


def _planning_stand_in_fwd(x, w, group_sizes, out_dtype):
    return _planning_stand_in(x, w, group_sizes, out_dtype), (x, w, group_sizes)


def _planning_stand_in_bwd(out_dtype, res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)
    dx = jnp.dot(dy, w[0].T, preferred_element_type=x.dtype)
    dw = jnp.broadcast_to(jnp.dot(x.T, dy, preferred_element_type=w.dtype), w.shape) * (group_sizes[:, None, None] > 0)
    return dx, dw.astype(w.dtype), None


_planning_stand_in.defvjp(_planning_stand_in_fwd, _planning_stand_in_bwd)


def grouped_matmul_blocked(x, w, group_sizes, *, block: int = 512, preferred_element_type=None):
    """The padded-block form (see module docstring). Shapes as `grouped_matmul`."""
    layout = block_layout(group_sizes, x.shape[0], block)
    return from_blocks(blocks_matmul(to_blocks(x, layout), w, layout, preferred_element_type), layout)


def grouped_glu_mlp(x, w1, w3, w2, group_sizes, glu: Callable, *, compute_dtype, impl: Impl = "auto",
                    block: int = 512, qat: ExpertQuant | None = None, input_quantized: bool = False,
                    weights_quantized: bool = False, weight_grad: str = "pallas", glu_spec: tuple | None = None,
                    glu_grad: str = "xla"):
    """Each group's GLU MLP on its rows: w2_g glu(w1_g x, w3_g x). x [M,l] sorted by group,
    w1/w3 [G,l,H], w2 [G,H,l] -> [M,l] fp32 (0 past sum(group_sizes)). The three matmuls
    share one block layout, and the rows enter and leave the padded buffer once.

    qat (`k3jax.ops.mx.ExpertQuant`): fake-quantize the three weights (blocks along l for
    w1/w3, along H for w2) once, before any per-block gather, and both GEMM inputs (x along l;
    the GLU output along H, from its fp32 value), with a straight-through gradient. None = no
    quantization. input_quantized / weights_quantized: x / the weights already hold qat's values
    (the expert-parallel exchange sent x as MXFP8 and quantized the weights before gathering
    them), so they are not quantized again. weight_grad: the kernel form's dw kernel
    (model.moe.gmm_weight_grad: "pallas" for `k3jax.ops.grouped_dw`, the default, or "tokamax").
    glu_spec / glu_grad: `glu`'s spec (`k3jax.layers.activations.glu_spec`) and the kernel form's
    GLU backward (model.moe.glu_grad: auto | pallas | xla; `k3jax.ops.glu_grad`, without qat)."""
    cd = compute_dtype
    if qat is not None:  # from the weights' own dtype (fp32 masters), then cast: exact in bf16
        if not weights_quantized:
            w1, w3, w2 = qat.weight(w1), qat.weight(w3), qat.weight(w2)
        x = x if input_quantized else qat.input(x)
        act = lambda a, b: qat.input(glu(a.astype(jnp.float32), b.astype(jnp.float32))).astype(cd)  # noqa: E731
    else:
        act = glu
    x, w1, w3, w2 = (t.astype(cd) for t in (x, w1, w3, w2))
    impl = resolve_impl(impl)
    if impl == "blocked":
        layout = block_layout(group_sizes, x.shape[0], block)
        xb = to_blocks(x, layout)
        h = act(*(checkpoint_name(blocks_matmul(xb, w, layout, cd), EXPERT_HIDDEN) for w in (w1, w3)))
        return from_blocks(blocks_matmul(h, w2, layout, jnp.float32), layout)
    if impl == "kernel":
        # the gate and up products as one grouped GEMM over w1|w3 [G,l,2H]: one read of the rows, and
        # on an H200 0.73 ms against 2 x 0.40 forward, 0.70 against 2 x 0.42 for dx (gmm_configs.py)
        H = w1.shape[-1]
        w13 = jnp.concatenate([w1, w3], axis=-1)
        gate_up_shape = jax.ShapeDtypeStruct((x.shape[0], 2 * H), cd)
        if glu_spec is not None and qat is None:
            # the GLU op on the packed gate|up (k3jax.ops.glu_grad): its backward is one XLA fusion
            # (glu_grad=xla, the default) or one Pallas kernel (auto/pallas on a GPU), either
            # reading gate_up where it lies and writing d(gate_up) once. It zeroes the unrouted
            # rows of h and of d(gate_up) itself, so neither GEMM masks them: gate_up's are left as
            # the kernel wrote them, and h's are 0 on their way into w2
            gate_up = checkpoint_name(grouped_matmul_kernel(x, w13, group_sizes, preferred_element_type=cd,
                                                            weight_grad=weight_grad, mask_output=False),
                                      EXPERT_HIDDEN)
            h = checkpoint_name(glu_of_gate_up(gate_up, jnp.sum(group_sizes).astype(jnp.int32), tuple(glu_spec),
                                               glu_backward(glu_grad, gate_up_shape)), EXPERT_HIDDEN)
            return grouped_matmul_kernel(h, w2, group_sizes, preferred_element_type=jnp.float32,
                                         weight_grad=weight_grad, mask_input=False)
        # QAT rounds the GLU's output before w2 (act above): the plain GLU on the two halves
        gate_up = checkpoint_name(grouped_matmul(x, w13, group_sizes, impl=impl, preferred_element_type=cd,
                                                 weight_grad=weight_grad), EXPERT_HIDDEN)
        h = act(gate_up[:, :H], gate_up[:, H:])
        return grouped_matmul(h, w2, group_sizes, impl=impl, preferred_element_type=jnp.float32,
                              weight_grad=weight_grad)
    # named: remat=save_dots keeps the gate and up products (k3jax.ops.remat_names)
    h = act(*(checkpoint_name(grouped_matmul(x, w, group_sizes, impl=impl, preferred_element_type=cd), EXPERT_HIDDEN)
              for w in (w1, w3)))
    return grouped_matmul(h, w2, group_sizes, impl=impl, preferred_element_type=jnp.float32)


def glu_backward(impl: str, gate_up) -> str:
    """"pallas" or "xla": the GLU backward that runs for gate_up [M, 2H] and `impl`
    (model.moe.glu_grad). pallas on a width H the kernel cannot take (the config's) is an error
    saying why; a row count M it cannot take (routed rows vary with the batch) runs XLA's."""
    return resolve_for_shape(impl, "model.moe.glu_grad", glu_grad_op.unsupported_reason(gate_up),
                             width_fault=glu_grad_op.tile(gate_up)[1] is None)


def grouped_matmul_reference(x, w, group_sizes, *, preferred_element_type=None):
    """Naive form: gather each row's weight matrix ([M,D,F] in memory; tests only)."""
    M = x.shape[0]
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(M)
    g = jnp.minimum(jnp.searchsorted(ends, row, side="right"), w.shape[0] - 1)
    y = jnp.einsum("md,mdf->mf", x, w[g], preferred_element_type=preferred_element_type)
    return jnp.where((row < ends[-1])[:, None], y, jnp.zeros((), y.dtype))
