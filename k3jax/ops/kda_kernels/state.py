"""Kernels 2 and 3, sequential over chunks: the state pass forward and its transpose.

One program per (batch, head) and block of BV value columns walks the chunks with the
fp32 state h [K,BV] held in registers (the state's columns are independent, so splitting V
gives more programs for few sequences). Per chunk t, with the kernel-1 outputs:

    forward                                   backward (t = NT-1 ... 0, dh = dL/dh_{t+1})
    v_new = u - w h                           dv_new = Aqk^T do + kg dh
    o     = qg h + Aqk v_new                  dh    <- gamma * dh + qg^T do - w^T dv_new
    h     <- gamma * h + kg^T v_new

The forward can also write every chunk's incoming state and v_new (the backward's inputs);
the backward writes dh for every chunk and dv_new, and returns the gradient of the initial
state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from k3jax.ops.kda_kernels.common import F32, Numerics, Specs, dot, kernel_jit


def block_v(V: int, programs_per_block: int, requested=None) -> int:
    """Value columns per program: all of V while that gives enough programs for the GPU's
    132 SMs, halved down to 32 (16 for very few sequences) otherwise."""
    if requested:
        if V % requested:
            raise ValueError(f"state block {requested} must divide the value dim {V}")
        return requested
    bv = V
    while bv > 32 and programs_per_block * (V // bv) < 256:
        bv //= 2
    if bv > 16 and programs_per_block * (V // bv) < 128:
        bv //= 2
    return bv


def _fwd_kernel(*refs, C, NT, has_h0, want_o, want_states, num: Numerics):
    it = iter(refs)
    w_ref, u_ref, kg_ref, qg_ref, aqk_ref, gam_ref = (next(it) for _ in range(6))
    h0_ref = next(it) if has_h0 else None
    o_ref = next(it) if want_o else None
    s_ref = next(it)
    if want_states:
        h_ref, vn_ref = next(it), next(it)
    K, BV = s_ref.shape
    cd = num.cd

    def step(t, h):
        span = pl.ds(pl.multiple_of(t * C, C), C)
        hc = h.astype(cd)
        if want_states:
            h_ref[t] = hc.astype(h_ref.dtype)
        v_new = u_ref[span, :].astype(F32) - dot(w_ref[span, :], hc, num.mm)
        vc = v_new.astype(cd)
        if want_states:
            vn_ref[span, :] = vc.astype(vn_ref.dtype)
        if want_o:
            o = dot(qg_ref[span, :], hc, num.mm) + dot(aqk_ref[span, :], vc, num.mm)
            o_ref[span, :] = o.astype(o_ref.dtype)
        return gam_ref[t, :][:, None] * h + dot(kg_ref[span, :], vc, num.mm, ta=True)

    h = h0_ref[...].astype(F32) if has_h0 else jnp.zeros((K, BV), F32)
    s_ref[...] = jax.lax.fori_loop(0, NT, step, h)


@kernel_jit
def state_forward(w, u, kg, qg, aqk, gam, h0, *, chunk, num: Numerics, out_dtype, want_o: bool,
                  want_states: bool, block, warps: int, stages: int, interpret: bool):
    """Kernel-1 outputs ([B,T,H,*]), h0 [B,H,K,V] fp32 or None.

    Returns ([o [B,T,H,V]] if want_o, S [B,H,K,V] fp32, [h [B,NT,H,K,V], v_new [B,T,H,V]] if want_states)."""
    B, T, H, K = w.shape
    V = u.shape[-1]
    C, NT = chunk, T // chunk
    BV = block_v(V, B * H, block)
    sp = Specs(H, C)
    in_specs = [sp.seq(T, K), sp.seq(T, V, BV), sp.seq(T, K), sp.seq(T, K), sp.seq(T, C), sp.seq_gate(NT, K)]
    args = [w, u, kg, qg, aqk, gam]
    if h0 is not None:
        in_specs.append(sp.state(K, BV))
        args.append(h0)
    out_shape, out_specs = [], []
    if want_o:
        out_shape.append(jax.ShapeDtypeStruct((B, T, H, V), out_dtype))
        out_specs.append(sp.seq(T, V, BV))
    out_shape.append(jax.ShapeDtypeStruct((B, H, K, V), F32))
    out_specs.append(sp.state(K, BV))
    if want_states:
        out_shape += [jax.ShapeDtypeStruct((B, NT, H, K, V), num.cd), jax.ShapeDtypeStruct((B, T, H, V), num.cd)]
        out_specs += [sp.seq_states(NT, K, BV), sp.seq(T, V, BV)]
    kernel = functools.partial(_fwd_kernel, C=C, NT=NT, has_h0=h0 is not None, want_o=want_o,
                               want_states=want_states, num=num)
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B * H, V // BV), in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=stages), interpret=interpret,
        name="kda_state_forward")(*args)


def _bwd_kernel(*refs, C, NT, has_ds, num: Numerics):
    it = iter(refs)
    w_ref, kg_ref, qg_ref, aqk_ref, gam_ref, do_ref = (next(it) for _ in range(6))
    ds_ref = next(it) if has_ds else None
    dh_ref, dvn_ref, dh0_ref = next(it), next(it), next(it)
    K, BV = dh0_ref.shape
    cd = num.cd

    def step(i, dh):
        t = NT - 1 - i
        span = pl.ds(pl.multiple_of(t * C, C), C)
        dhc = dh.astype(cd)
        dh_ref[t] = dhc.astype(dh_ref.dtype)
        do = do_ref[span, :].astype(cd)
        dvn = dot(aqk_ref[span, :], do, num.mm, ta=True) + dot(kg_ref[span, :], dhc, num.mm)
        dvc = dvn.astype(cd)
        dvn_ref[span, :] = dvc.astype(dvn_ref.dtype)
        return (gam_ref[t, :][:, None] * dh + dot(qg_ref[span, :], do, num.mm, ta=True)
                - dot(w_ref[span, :], dvc, num.mm, ta=True))

    dh = ds_ref[...].astype(F32) if has_ds else jnp.zeros((K, BV), F32)
    dh0_ref[...] = jax.lax.fori_loop(0, NT, step, dh)


@kernel_jit
def state_backward(w, kg, qg, aqk, gam, do, dS, *, chunk, num: Numerics, block, warps: int, stages: int,
                   interpret: bool):
    """Returns dh [B,NT,H,K,V] (gradient of the state leaving each chunk, num.cd),
    dv_new [B,T,H,V] (num.cd) and dh0 [B,H,K,V] fp32."""
    B, T, H, K = w.shape
    V = do.shape[-1]
    C, NT = chunk, T // chunk
    BV = block_v(V, B * H, block)
    sp = Specs(H, C)
    in_specs = [sp.seq(T, K), sp.seq(T, K), sp.seq(T, K), sp.seq(T, C), sp.seq_gate(NT, K), sp.seq(T, V, BV)]
    args = [w, kg, qg, aqk, gam, do]
    if dS is not None:
        in_specs.append(sp.state(K, BV))
        args.append(dS)
    out_shape = [jax.ShapeDtypeStruct((B, NT, H, K, V), num.cd), jax.ShapeDtypeStruct((B, T, H, V), num.cd),
                 jax.ShapeDtypeStruct((B, H, K, V), F32)]
    out_specs = [sp.seq_states(NT, K, BV), sp.seq(T, V, BV), sp.state(K, BV)]
    kernel = functools.partial(_bwd_kernel, C=C, NT=NT, has_ds=dS is not None, num=num)
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B * H, V // BV), in_specs=in_specs, out_specs=out_specs,
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=stages), interpret=interpret,
        name="kda_state_backward")(*args)


def _output_kernel(qg_ref, aqk_ref, h_ref, vn_ref, o_ref, *, num: Numerics, BV: int):
    V = vn_ref.shape[-1]
    for vb in range(V // BV):
        vs = pl.ds(vb * BV, BV)
        o = dot(qg_ref[...], h_ref[:, vs], num.mm) + dot(aqk_ref[...], vn_ref[:, vs], num.mm)
        o_ref[:, vs] = o.astype(o_ref.dtype)


@kernel_jit
def chunk_output(qg, aqk, h, v_new, *, chunk, num: Numerics, out_dtype, warps: int, interpret: bool,
                 block_v: int = 64):
    """o = qg h_t + Aqk v_new per chunk, chunk-parallel: the output off the state pass's serial
    path (long sequences have few programs there). Returns o [B,T,H,V]."""
    B, T, H, K = qg.shape
    V = v_new.shape[-1]
    sp = Specs(H, chunk)
    kernel = functools.partial(_output_kernel, num=num, BV=min(V, block_v))
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((B, T, H, V), out_dtype), grid=(T // chunk, B * H),
        in_specs=[sp.chunk(K), sp.chunk(chunk), sp.chunk_state(K, V), sp.chunk(V)], out_specs=sp.chunk(V),
        compiler_params=pltr.CompilerParams(num_warps=warps, num_stages=1), interpret=interpret,
        name="kda_chunk_output")(qg, aqk, h, v_new)
