"""KDA's decode step for one token per row, from its projections to the gated output, in one kernel.

    o, state, windows = kda_decode_layer(proj, x, fresh, state, windows, params, layer=..., ...)

Everything KDA computes between its input projections and o_proj (k3jax/layers/kda.py,
k3-architecture.md §2.3), per (row b, head h), for the head's K channels:

    c_n     = SiLU(sum_i w_n[i] * [window_n ; x_n]_i)        causal short conv, n in q, k, v
    q, k    = l2norm(c_q), l2norm(c_k);  v = c_v
    g       = lb * sigmoid(exp(A_log[h]) * (f_a f_b[:, head] + dt_bias))   (or -exp(A_log) softplus(.))
    beta    = sigmoid(x . b[:, h])
    S       = 0 if fresh;  S = Diag(exp g) S;  S += k (beta (v - S^T k))^T;  o = S^T (scale q)
    out     = rmsnorm(o) * o_norm * sigmoid(G)                 (the output gate's logits G)

and the conv windows move on by one token. XLA ran this as about 20 kernels per layer at batch 1
(the windows' selects and copies, the conv, the l2 norms, the gate, beta, the step's operands,
the output norm): here one program per (row, head) reads its head's state once and writes it
once, with the whole [K, V] state in registers (8 warps), and writes the next windows and the
gated output. Grid (B*H,).

Rounding as the plain path: the projections and the conv's output in the compute dtype `dtype`,
q and k after their l2 norm in `dtype`, o in `dtype` before its norm; the gate, beta, the state
and the norms in fp32.

Shapes: proj q, k, v [B, P] and f_a [B, R] (fp32 or `dtype`: the projections before rounding),
G [B, P] fp32, P = H*K; x [B, d]; seg, prev [B] int32 (fresh: seg != prev); state [L, B, H, K, K] fp32 and windows
(q, k, v) [L, B, W-1, P] in `dtype`, stacked over a stage's repeats, `layer` picking the slice,
overwritten in place; params name -> ([Lp, ...] stacked parameter, its layer): conv_q / conv_k /
conv_v [W, P] fp32, f_b [R, P], dt_bias [P], A_log [H], b [d, H], o_norm [K]. K a power of two
>= 16, d and R multiples of 16. -> (out [B, P] in `dtype`, state, windows).

`kda_decode_layer_reference` is the plain form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from k3jax.ops.decode_kernels.common import block_dividing, index_operands

F32 = jnp.float32
PARAMS = ("conv_q", "conv_k", "conv_v", "f_b", "dt_bias", "A_log", "b", "o_norm")
TUNING = {"warps": 8}


def unsupported_reason(state, x, f_a, windows) -> str | None:
    K, V = state.shape[-2:]
    if K != V or K < 16 or K & (K - 1):
        return f"head dims K={K}, V={V}: not one power of two >= 16"
    if state.dtype != F32:
        return f"the state is {state.dtype}, not float32"
    for name, n in (("d_model", x.shape[-1]), ("gate rank", f_a.shape[-1])):
        if block_dividing(n) is None:
            return f"{name}={n} is not a multiple of 16"
    if windows[0].shape[2] < 1:
        return "no conv window"
    return None


def _kernel(*refs, n_idx, pos, H, K, Wm1, R, d, BD, scale, gate, lower_bound, eps, dtype):
    """Grid (b*H + h,). refs: n_idx index operands [1] (at `pos`: the state's / windows' layer,
    then each parameter's, PARAMS order); seg_ref, prev_ref [1] (the token's and the previous
    slot's segment ids); q/k/v/g_ref [P], fa_ref [R], x_ref [d]
    (row b); c*_ref [Lp, W, P], fb_ref [Lp, R, P], dtb_ref [Lp, P], alog_ref [Lp, H], b_ref
    [Lp, d, H], on_ref [Lp, K]; state_ref / state_out [L, K, K] (row b, head h); w*_ref / w*_out
    [L, Wm1, P] (row b); out_ref [P]."""
    idx_refs = refs[:n_idx]
    (seg_ref, prev_ref, q_ref, k_ref, v_ref, fa_ref, g_ref, x_ref, cq_ref, ck_ref, cv_ref, fb_ref, dtb_ref, alog_ref,
     b_ref, on_ref, state_ref, wq_ref, wk_ref, wv_ref, out_ref, state_out, wq_out, wk_out, wv_out) = refs[n_idx:]
    h = pl.program_id(0) % H
    layer = idx_refs[pos[0]][0]
    li = {name: idx_refs[pos[1 + i]][0] for i, name in enumerate(PARAMS)}
    fresh = seg_ref[0] != prev_ref[0]  # this token starts a new document
    cols = pl.ds(pl.multiple_of(h * K, K), K)
    rnd = lambda a: a.astype(dtype).astype(F32)  # noqa: E731  the plain path's rounding to dtype

    def conv(proj_ref, win_ref, win_out, cw_ref, lw):
        """SiLU(conv) [K] fp32 (rounded to dtype) of this head's channels; writes the next window."""
        rows = [jnp.where(fresh, 0.0, win_ref[layer, i, cols].astype(F32)) for i in range(Wm1)]
        cur = rnd(proj_ref[cols])
        acc = jnp.zeros((K,), F32)
        for i, src in enumerate(rows + [cur]):  # tap i reads [window ; x]_i, in _conv_acc's order
            acc = acc + src * cw_ref[lw, i, cols]
        for i, src in enumerate(rows[1:] + [cur]):
            win_out[layer, i, cols] = src.astype(win_out.dtype)
        return rnd(acc * jax.nn.sigmoid(acc))

    def l2(a):
        return rnd(a * jax.lax.rsqrt(jnp.sum(a * a) + 1e-6))

    q = l2(conv(q_ref, wq_ref, wq_out, cq_ref, li["conv_q"])) * scale
    k = l2(conv(k_ref, wk_ref, wk_out, ck_ref, li["conv_k"]))
    v = conv(v_ref, wv_ref, wv_out, cv_ref, li["conv_v"])

    # decay gate: f_a [R] (rounded to dtype) times this head's columns of f_b, in R-chunks
    z = jnp.zeros((K,), F32)
    BR = block_dividing(R, (64, 32, 16))
    for c in range(R // BR):
        rows = pl.ds(c * BR, BR)
        z = z + jnp.sum(rnd(fa_ref[rows])[:, None] * rnd(fb_ref[li["f_b"], rows, cols]), axis=0)
    z = z + dtb_ref[li["dt_bias"], cols]
    A = jnp.exp(alog_ref[li["A_log"], h])
    if gate == "lower_bound":
        g = jnp.maximum(lower_bound * jax.nn.sigmoid(A * z), lower_bound)
    else:
        g = -A * jax.nn.softplus(z)
    # beta: x . b[:, h] in fp32 over rounded operands
    bsum = jnp.zeros((), F32)
    for c in range(d // BD):
        rows = pl.ds(c * BD, BD)
        bsum = bsum + jnp.sum(rnd(x_ref[rows]) * rnd(b_ref[li["b"], rows, h]))
    beta = jax.nn.sigmoid(bsum)

    S = jnp.where(fresh, 0.0, state_ref[layer])  # [K, V]
    S = jnp.exp(g)[:, None] * S
    u = beta * (v - jnp.sum(S * k[:, None], axis=0))
    S = S + k[:, None] * u[None, :]
    state_out[layer] = S
    o = rnd(jnp.sum(S * q[:, None], axis=0))  # [V], the plain path keeps o in dtype
    o = o * jax.lax.rsqrt(jnp.mean(o * o) + eps) * on_ref[li["o_norm"], :] * jax.nn.sigmoid(g_ref[cols])
    out_ref[cols] = o.astype(out_ref.dtype)


def kda_decode_layer(proj, x, seg, prev, state, windows, params, *, layer, gate: str, lower_bound: float,
                     eps: float, dtype, interpret: bool = False):
    """The kernel (module docstring). proj: dict q, k, v, f_a, g; seg, prev [B] int32: the
    token's segment id and the previous slot's (another id starts a document: fresh state and
    windows); windows: (q, k, v); params: dict name -> (array, layer). -> (out [B, P] dtype,
    state, (windows q, k, v))."""
    why = unsupported_reason(state, x, proj["f_a"], windows)
    if why:
        raise ValueError(f"kda_decode_layer: {why}")
    L, B, H, K, _ = state.shape
    P, Wm1, R, d = H * K, windows[0].shape[2], proj["f_a"].shape[-1], x.shape[-1]
    BD = block_dividing(d, (512, 256, 128, 64, 32, 16))
    arrays = {name: params[name][0] for name in PARAMS}
    arrays["dt_bias"] = arrays["dt_bias"].reshape(-1, P)
    arrays["A_log"] = arrays["A_log"].reshape(-1, H)
    arrays["o_norm"] = arrays["o_norm"].reshape(-1, K)
    idx, pos = index_operands([layer] + [params[n][1] for n in PARAMS])
    row = lambda n: pl.BlockSpec((None, n), lambda p: (p // H, 0))  # noqa: E731
    full = lambda a: pl.BlockSpec(a.shape, lambda p: (0,) * a.ndim)  # noqa: E731
    state_spec = pl.BlockSpec((L, None, None, K, K), lambda p: (0, p // H, p % H, 0, 0))
    win_spec = pl.BlockSpec((L, None, Wm1, P), lambda p: (0, p // H, 0, 0))
    kernel = functools.partial(_kernel, n_idx=len(idx), pos=tuple(pos), H=H, K=K, Wm1=Wm1, R=R, d=d, BD=BD,
                               scale=K ** -0.5, gate=gate,
                               lower_bound=float(lower_bound), eps=float(eps), dtype=jnp.dtype(dtype))
    out, state, wq, wk, wv = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((B, P), dtype), jax.ShapeDtypeStruct(state.shape, F32)]
        + [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in windows],
        grid=(B * H,),
        in_specs=[full(i) for i in idx] + [pl.BlockSpec((None, 1), lambda p: (p // H, 0))] * 2
        + [row(P), row(P), row(P), row(R), row(P), row(d)]
        + [full(arrays[n]) for n in PARAMS] + [state_spec, win_spec, win_spec, win_spec],
        out_specs=[row(P), state_spec, win_spec, win_spec, win_spec],
        input_output_aliases={len(idx) + 16 + i: 1 + i for i in range(4)},
        compiler_params=pltr.CompilerParams(num_warps=TUNING["warps"], num_stages=1),
        interpret=interpret, name="kda_decode_layer",
    )(*idx, seg.astype(jnp.int32)[:, None], prev.astype(jnp.int32)[:, None], proj["q"], proj["k"], proj["v"],
      proj["f_a"], proj["g"], x,
      *[arrays[n] for n in PARAMS], state, *windows)
    return out, state, (wq, wk, wv)


def kda_decode_layer_reference(proj, x, seg, prev, state, windows, params, *, layer, gate: str, lower_bound: float,
                               eps: float, dtype):
    """The plain form: the module docstring's formulas on the layer's slices, in XLA."""
    fresh = seg != prev
    L, B, H, K, _ = state.shape
    rnd = lambda a: a.astype(dtype).astype(F32)  # noqa: E731
    p = {n: params[n][0][params[n][1]] for n in PARAMS}
    win = [jnp.where(fresh[:, None, None], 0.0, w[layer].astype(F32)) for w in windows]
    feats, new_w = [], []
    for name, w in zip(("q", "k", "v"), win):
        cur = rnd(proj[name])
        xp = jnp.concatenate([w, cur[:, None]], axis=1)  # [B, W, P]
        acc = jnp.zeros_like(cur)
        for i in range(xp.shape[1]):
            acc = acc + xp[:, i] * p[f"conv_{name}"][i]
        feats.append(rnd(jax.nn.silu(acc)).reshape(B, H, K))
        new_w.append(xp[:, 1:].astype(windows[0].dtype))
    l2 = lambda a: rnd(a * jax.lax.rsqrt(jnp.sum(a * a, -1, keepdims=True) + 1e-6))  # noqa: E731
    q, k, v = l2(feats[0]) * K ** -0.5, l2(feats[1]), feats[2]
    hp = jax.lax.Precision.HIGHEST
    z = jnp.dot(rnd(proj["f_a"]), rnd(p["f_b"]), precision=hp).reshape(B, H, K) + p["dt_bias"].reshape(H, K)
    A = jnp.exp(p["A_log"].reshape(H))[:, None]
    g = (jnp.maximum(lower_bound * jax.nn.sigmoid(A * z), lower_bound) if gate == "lower_bound"
         else -A * jax.nn.softplus(z))
    beta = jax.nn.sigmoid(jnp.dot(rnd(x), rnd(p["b"]), precision=hp))  # [B, H]
    S = jnp.where(fresh[:, None, None, None], 0.0, state[layer])
    S = jnp.exp(g)[..., None] * S
    u = beta[..., None] * (v - jnp.einsum("bhkv,bhk->bhv", S, k, precision=hp))
    S = S + k[..., :, None] * u[..., None, :]
    o = rnd(jnp.einsum("bhkv,bhk->bhv", S, q, precision=hp))
    o = o * jax.lax.rsqrt(jnp.mean(o * o, -1, keepdims=True) + eps) * p["o_norm"].reshape(K) \
        * jax.nn.sigmoid(proj["g"].reshape(B, H, K))
    state = state.at[layer].set(S)
    windows = tuple(w.at[layer].set(n) for w, n in zip(windows, new_w))
    return o.reshape(B, H * K).astype(dtype), state, windows
