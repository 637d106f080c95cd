"""A matmul in the compute dtype with an fp32 result, whose backward runs in the compute dtype.

    matmul_f32_out(x [..., d], w [d, *out]) -> [..., *out] fp32      (x, w in bf16, say)

The gates and the LM head keep their projections' outputs in fp32 (KDA's decay, beta and
output gate, MLA's output gate, the logits). Under plain autodiff the cotangent of such an
output is fp32 too, so both backward products are fp32 x bf16: XLA:GPU upcasts the bf16
operand and runs a TF32 GEMM (the `sm90_xmma_gemm_f32f32_tf32f32` kernels, about 37 ms of
k3-small's 744 ms step in the 2026-12-01 profile, benchmarks/results/k3-small-2026-12-01/README.md)
after writing and reading the fp32 cotangent. Here the cotangent is rounded to the operands' dtype
first, as the input of any bf16 matmul is (PyTorch's bf16 training rounds it there too), and both
products are bf16 x bf16 with fp32 accumulation. The forward is unchanged.

The output carries the checkpoint name `REMAT_NAME` (k3jax.ops.remat_names): a custom VJP
hides its dot from `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`, so k3jax's
`save_dots` policy saves this name too, and the product is kept, not recomputed, exactly as
the plain dot's would be.

`matmul_f32_out_reference` is the plain form (a tensordot with fp32 accumulation under
ordinary autodiff).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from k3jax.ops.remat_names import MATMUL_F32_OUT as REMAT_NAME


def matmul_f32_out_reference(x, w):
    return jnp.tensordot(x, w, axes=1, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _matmul(x, w):
    return matmul_f32_out_reference(x, w)


def _fwd(x, w):
    return matmul_f32_out_reference(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    g = g.astype(x.dtype)  # the rounding that makes both products run in the operands' dtype
    n_out = w.ndim - 1
    dx = jnp.tensordot(g, w, axes=(tuple(range(g.ndim - n_out, g.ndim)), tuple(range(1, w.ndim))),
                       preferred_element_type=jnp.float32)
    lead = tuple(range(x.ndim - 1))
    dw = jnp.tensordot(x, g, axes=(lead, lead), preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_fwd, _bwd)


def matmul_f32_out(x, w):
    """x [..., d], w [d, *out] of one dtype -> x @ w [..., *out] in fp32 (fp32 accumulation);
    the backward rounds the cotangent to that dtype (module docstring)."""
    if x.dtype != w.dtype:
        raise ValueError(f"matmul_f32_out: operands of one dtype, got {x.dtype} and {w.dtype}")
    if jnp.dtype(x.dtype).itemsize >= 4:  # fp32 operands: nothing to round, the plain form
        return matmul_f32_out_reference(x, w)
    return checkpoint_name(_matmul(x, w), REMAT_NAME)
