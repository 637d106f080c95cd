"""The in-chunk cumulative sum of the log-decay, G = cumsum over each chunk of g, as one Pallas
kernel, and its transpose (the reverse in-chunk cumsum of dG) as another.

XLA:GPU runs `jnp.cumsum` over [B, NT, C, H, K] as a log-depth scan of slices and adds: 0.32 +
0.08 ms at 8 x 4096 x 16 x 128 on an H200 (`issue23-close-2026-12-03/2-op-compile/op_profiles.tgz`,
loop_add_fusion and loop_slice_fusion), against ~0.11 ms for its bytes at HBM bandwidth. Here
one program per (chunk, batch x head) reads the chunk's [C, K] fp32 block once and writes its
scan (Triton's tt.scan). Pallas-Triton has no reverse scan, so the transpose computes
sum_{j >= i} x_j as total - cumsum_i + x_i: an fp32 rounding of the chunk's total, where a
sequential sum rounds its partial sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from k3jax.ops.kda_kernels.common import F32, Specs, kernel_jit


def _kernel(x_ref, o_ref, *, reverse: bool):
    x = x_ref[...]
    c = jnp.cumsum(x, axis=0)
    if reverse:
        c = jnp.sum(x, axis=0)[None, :] - c + x
    o_ref[...] = c


@kernel_jit
def _launch(x, *, chunk: int, reverse: bool, interpret: bool):
    B, T, H, K = x.shape
    sp = Specs(H, chunk)
    return pl.pallas_call(
        functools.partial(_kernel, reverse=reverse), out_shape=jax.ShapeDtypeStruct(x.shape, F32),
        grid=(T // chunk, B * H), in_specs=[sp.chunk(K)], out_specs=sp.chunk(K),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="kda_reverse_cumsum" if reverse else "kda_chunk_cumsum")(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def chunk_cumsum(g, chunk: int, interpret: bool):
    """g [B,T,H,K] fp32 (T a multiple of `chunk`) -> [B,T,H,K]: the cumsum of g within each chunk
    of `chunk` rows, as `jnp.cumsum(g.reshape(B, T // chunk, chunk, H, K), axis=2)`."""
    return _launch(g, chunk=chunk, reverse=False, interpret=interpret)


def _fwd(g, chunk, interpret):
    return chunk_cumsum(g, chunk, interpret), None


def _bwd(chunk, interpret, _, ct):
    return (_launch(ct, chunk=chunk, reverse=True, interpret=interpret),)


chunk_cumsum.defvjp(_fwd, _bwd)
