"""The router's fp32 logits from bf16 activations, on the tensor cores.

    router_logits(x [N,d] bf16, w [d,E] fp32) -> x @ w [N,E] fp32

K3 routes in fp32 (a routing decision flips on a tiny logit change), which k3jax wrote as a
HIGHEST-precision fp32 matmul. On an H200 XLA runs that on the CUDA cores: k3-small's router
products took 9.1 ms a step against a 1.2 ms memory floor
(benchmarks/results/kernels-2026-12-03/README.md).

Here the same fp32 accuracy comes from bf16 products. x is bf16, so exactly representable;
w is split exactly into three bf16 terms, w = w0 + w1 + w2 (8 significant bits each: 24, an
fp32 significand), and each product x_i w_jk of two bf16 values is exact in fp32. So
x @ w = x @ w0 + x @ w1 + x @ w2 is one bf16 GEMM over [3, d, E] with fp32 accumulation,
whose only rounding is the accumulation's (as an fp32 GEMM's), plus two fp32 additions.

The backward, for the fp32 cotangent g [N,E]:
  dw = x^T g  in fp32, the same way: g split exactly into three bf16 terms, exact products;
  dx = g w^T  is rounded to bf16 (x's dtype) at the end, so two-term splits of g and w,
              g0 w0 + g0 w1 + g1 w0 (~2^-16 relative, as XLA's bf16x3), are well below that
              rounding (2^-9).

`router_logits_reference` is the plain form (HIGHEST fp32 matmul, plain autodiff). Inputs of
other dtypes (fp32 activations: CPU tests, an fp32 model) take it too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from k3jax.ops.remat_names import MATMUL_F32_OUT

F32, BF16 = jnp.float32, jnp.bfloat16


def router_logits_reference(x, w):
    return jnp.matmul(x.astype(F32), w.astype(F32), precision=jax.lax.Precision.HIGHEST)


def split_bf16(a, terms: int):
    """a fp32 -> [terms, *a.shape] bf16 whose fp32 sum is a (exactly, for terms = 3; to ~2^-16
    relative for 2): each term the bf16 rounding of what the previous terms left."""
    out, rest = [], a.astype(F32)
    for _ in range(terms):
        t = rest.astype(BF16)
        out.append(t)
        rest = rest - t.astype(F32)  # exact: t is rest's leading bits
    return jnp.stack(out)


def _sum_terms(p):
    """[terms, ...] fp32 -> their sum, smallest first."""
    acc = p[-1]
    for i in range(p.shape[0] - 2, -1, -1):
        acc = acc + p[i]
    return acc


@jax.custom_vjp
def _logits(x, w):
    return _sum_terms(jnp.einsum("nd,jde->jne", x, split_bf16(w, 3), preferred_element_type=F32))


def _fwd(x, w):
    return _logits(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    g = g.astype(F32)
    dw = _sum_terms(jnp.einsum("nd,jne->jde", x, split_bf16(g, 3), preferred_element_type=F32))
    g0, g1 = split_bf16(g, 2)
    w0, w1 = split_bf16(w, 2)
    # g0 w0 + g0 w1 + g1 w0 as one GEMM: the three pairs stacked along the contraction
    dx = jnp.einsum("jne,jde->nd", jnp.stack([g0, g0, g1]), jnp.stack([w0, w1, w0]), preferred_element_type=F32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_logits.defvjp(_fwd, _bwd)


def router_logits(x, w):
    """x [N,d], w [d,E] -> x @ w [N,E] fp32, as accurate as an fp32 matmul (module docstring).
    bf16 x and fp32 w take the split bf16 GEMMs; anything else the HIGHEST fp32 matmul. Named as
    `k3jax.ops.matmul_f32`'s outputs are: a custom VJP hides its GEMM from remat=save_dots' dot
    rule, and the name keeps the logits ([N,E] fp32) rather than recomputing them."""
    if x.dtype == BF16 and w.dtype == F32:
        return checkpoint_name(_logits(x, w), MATMUL_F32_OUT)
    return router_logits_reference(x, w)
