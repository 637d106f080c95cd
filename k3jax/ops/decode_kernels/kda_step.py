"""KDA's recurrent step for one token, fused: the state is read once and written once.

    o, state = kda_decode_step(state, layer, q, k, v, g, beta, fresh, scale=...)

The step (k3-architecture.md §2.3, fla `naive_recurrent_kda`), per (batch, head), with the
state S [K,V] fp32:

    S <- 0 if fresh;  S <- Diag(exp g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T (scale q)

Every value column of S is independent of the others, so one program holds a [K, BV] block of
columns in registers and does the whole step on it: one read and one write of the state, the
products as elementwise multiplies and sums over K (no dot: the vectors are single rows).
Grid (B*H, V/BV).

Layout: the state keeps the chunked kernels' [K,V] (K3's inference code stores [V,K],
k3-architecture.md §2.3). A program's [K, 32] column block is K rows of one aligned 128-byte
line each, read and written as efficiently as V-first rows, and the prefill hands its state to
the decode steps without a transpose.

Shapes: state [L,B,H,K,V] fp32, a stage's stacked states; `layer` (int32 scalar) picks the
slice, which the kernel overwrites in place (the output aliases the input: other layers' states
are untouched and nothing is copied); q, k, g [B,H,K] (g the log-decay, already clamped at its
bound); v [B,H,V]; beta [B,H]; fresh [B] bool: this token starts a new document (the state is
zeroed first). -> (o [B,H,V] fp32, state [L,B,H,K,V]).

`kda_decode_step_reference` is the same step in plain XLA on one layer's slice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

F32 = jnp.float32


def _kernel(meta_ref, q_ref, k_ref, g_ref, v_ref, beta_ref, state_ref, o_ref, out_ref):
    """Grid (bh, vb). meta_ref [2] = (layer, fresh of this row); q/k/g_ref [K]; v_ref, o_ref [BV];
    beta_ref [1]; state_ref / out_ref [L, K, V] (the same buffer)."""
    vb = pl.program_id(1)
    BV = v_ref.shape[0]
    layer, fresh = meta_ref[0], meta_ref[1]
    cols = pl.ds(pl.multiple_of(vb * BV, BV), BV)
    S = state_ref[layer, :, cols]  # [K, BV]
    S = jnp.where(fresh != 0, 0.0, S)
    S = jnp.exp(g_ref[...])[:, None] * S
    k = k_ref[...]
    u = beta_ref[0] * (v_ref[...] - jnp.sum(S * k[:, None], axis=0))
    S = S + k[:, None] * u[None, :]
    o_ref[...] = jnp.sum(S * q_ref[...][:, None], axis=0)
    out_ref[layer, :, cols] = S


def unsupported_reason(state) -> str | None:
    K, V = state.shape[-2:]
    for name, n in (("K", K), ("V", V)):
        if n < 16 or n & (n - 1):
            return f"head dim {name}={n} is not a power of two >= 16"
    if state.dtype != F32:
        return f"the state is {state.dtype}, not float32"
    return None


def block_v(V: int) -> int:
    return min(V, 32)


def kda_decode_step(state, layer, q, k, v, g, beta, fresh, *, scale: float, interpret: bool = False):
    """The kernel (module docstring). -> (o [B,H,V] fp32, state [L,B,H,K,V])."""
    why = unsupported_reason(state)
    if why:
        raise ValueError(f"kda_decode_step: {why}")
    L, B, H, K, V = state.shape
    BV = block_v(V)
    meta = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (B,)), fresh.astype(jnp.int32)], axis=1)
    q = q.astype(F32) * scale
    vec = lambda n, blk=None: pl.BlockSpec(  # noqa: E731
        (None, None, blk or n), lambda bh, vb: (bh // H, bh % H, vb if blk else 0))
    state_spec = pl.BlockSpec((L, None, None, K, V), lambda bh, vb: (0, bh // H, bh % H, 0, 0))
    o, state = pl.pallas_call(
        _kernel,
        out_shape=[jax.ShapeDtypeStruct((B, H, V), F32), jax.ShapeDtypeStruct(state.shape, F32)],
        grid=(B * H, V // BV),
        in_specs=[pl.BlockSpec((None, 2), lambda bh, vb: (bh // H, 0)), vec(K), vec(K), vec(K), vec(V, BV),
                  pl.BlockSpec((None, None, 1), lambda bh, vb: (bh // H, bh % H, 0)), state_spec],
        out_specs=[vec(V, BV), state_spec],
        input_output_aliases={6: 1},
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="kda_decode_step",
    )(meta, q, k.astype(F32), g.astype(F32), v.astype(F32), beta.astype(F32)[..., None], state)
    return o, state


def kda_decode_step_reference(state, layer, q, k, v, g, beta, fresh, *, scale: float):
    """The plain step on the layer's slice, written back with a dynamic update (fp32)."""
    S = jax.lax.dynamic_index_in_dim(state, layer, 0, keepdims=False)
    S = jnp.where(fresh[:, None, None, None], 0.0, S)
    S = jnp.exp(g.astype(F32))[..., None] * S
    k, q = k.astype(F32), q.astype(F32) * scale
    prec = jax.lax.Precision.HIGHEST
    u = beta.astype(F32)[..., None] * (v.astype(F32) - jnp.einsum("bhkv,bhk->bhv", S, k, precision=prec))
    S = S + k[..., :, None] * u[..., None, :]
    o = jnp.einsum("bhkv,bhk->bhv", S, q, precision=prec)
    return o, jax.lax.dynamic_update_index_in_dim(state, S, layer, 0)
