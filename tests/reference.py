"""Independent float64 numpy references, written from each operator's per-token definition.

They share no code with k3jax: plain loops over batch, time and head.
"""

from __future__ import annotations

import math

import numpy as np


def delta_rule_loop(q, k, v, g=None, beta=None, *, scale=None, initial_state=None, segment_ids=None,
                    decay="channel", delta=True):
    """o_t = S_t^T (scale q_t) after: reset at segment change; S <- diag(exp g) S;
    u = beta (v - S^T k) (or u = v without delta); S <- S + k u^T. float64 throughout."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    S = np.zeros((B, H, K, V)) if initial_state is None else np.array(initial_state, np.float64)
    o = np.zeros((B, T, H, V))
    for b in range(B):
        for t in range(T):
            if segment_ids is not None and t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                S[b] = 0.0
            for h in range(H):
                if decay == "channel":
                    S[b, h] *= np.exp(np.float64(g[b, t, h]))[:, None]
                elif decay == "scalar":
                    S[b, h] *= np.exp(np.float64(g[b, t, h]))
                if delta:
                    u = np.float64(beta[b, t, h]) * (v[b, t, h] - S[b, h].T @ k[b, t, h])
                else:
                    u = v[b, t, h]
                S[b, h] += np.outer(k[b, t, h], u)
                o[b, t, h] = S[b, h].T @ (scale * q[b, t, h])
    return o, S


def softmax_attention_loop(q, k, v, *, scale=None, segment_ids=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, D = q.shape
    rep = H // k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    o = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, :, h // rep], v[b, :, h // rep]
            for t in range(T):
                ok = [s for s in range(t + 1) if segment_ids is None or segment_ids[b, s] == segment_ids[b, t]]
                s = np.array([q[b, t, h] @ kh[j] * scale for j in ok])
                p = np.exp(s - s.max())
                p /= p.sum()
                o[b, t, h] = p @ vh[ok]
    return o


def rel_err(x, ref):
    x, ref = np.asarray(x).astype(np.float64), np.asarray(ref).astype(np.float64)  # bf16 arrays too
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300))


def rope_np(x, pos, theta):
    """Rotation of (x_i, x_{i+D/2}) as the complex number x_i + i x_{i+D/2} times e^{i pos θ^(-2i/D)}.
    x [B,T,H,D] or [B,T,D]; pos [B,T]."""
    D = x.shape[-1]
    z = x[..., : D // 2] + 1j * x[..., D // 2:]
    ang = pos.astype(np.float64)[..., None] * theta ** (-2.0 * np.arange(D // 2) / D)
    z = z * np.exp(1j * (ang[:, :, None, :] if x.ndim == 4 else ang))
    return np.concatenate([z.real, z.imag], axis=-1)


def doc_positions(seg):
    """[B,T] position of each token inside its document (restarts where segment_ids change)."""
    pos = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        for t in range(1, seg.shape[1]):
            pos[b, t] = 0 if seg[b, t] != seg[b, t - 1] else pos[b, t - 1] + 1
    return pos


def mla_logits_np(p, mla, x, seg, pos, eps):
    """Gated MLA's scaled pre-softmax logits [B,H,T,T] in float64, -inf where query t may not
    attend key s (s > t or another document). p: the layer's parameters as a dict of arrays
    ({"q_a_proj": {"kernel": ...}, ...}, as nnx.to_pure_dict gives them); mla: its MLAConfig;
    x [B,T,d] the layer input (after input_layernorm). Per head: q = [q^n_h ; q^p_h] from
    q_b_proj (or q_proj), k = [k^n_h ; k^p] with k^n_h from kv_b_proj's first n columns of the
    head and the shared k^p from kv_a_proj_with_mqa's last r columns."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    H, n, r, R = mla.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
    x = f(x)
    Bx, Tx, d = x.shape

    def rms(a, w):
        return a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + eps) * f(w)

    if mla.q_lora_rank:
        cq = rms(x @ f(p["q_a_proj"]["kernel"]), p["q_a_layernorm"]["weight"])
        q = cq @ f(p["q_b_proj"]["kernel"]).reshape(mla.q_lora_rank, H * (n + r))
    else:
        q = x @ f(p["q_proj"]["kernel"]).reshape(d, H * (n + r))
    q = q.reshape(Bx, Tx, H, n + r)
    ckv = x @ f(p["kv_a_proj_with_mqa"]["kernel"])
    lat, kp = rms(ckv[..., :R], p["kv_a_layernorm"]["weight"]), ckv[..., R:]
    w_uk = f(p["kv_b_proj"]["kernel"])[:, :, :n]  # [R, H, n]
    kn = np.einsum("btr,rhn->bthn", lat, w_uk)
    qn, qp = q[..., :n], q[..., n:]
    if mla.use_rope:
        qp, kp = rope_np(qp, pos, mla.rope_theta), rope_np(kp, pos, mla.rope_theta)
    s = (np.einsum("bthn,bshn->bhts", qn, kn) + np.einsum("bthp,bsp->bhts", qp, kp)) / np.sqrt(n + r)
    t_idx = np.arange(Tx)
    ok = (t_idx[:, None] >= t_idx[None, :])[None] & (seg[:, :, None] == seg[:, None, :])  # [B,T,S]
    return np.where(ok[:, None], s, -np.inf)


# ------------------------------------------------------------------------------------------
# MX (OCP Microscaling) quantization: E8M0 block scales over E2M1 / E4M3 elements

# every non-negative finite value, ascending; the index is the element's code without its sign
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# E4M3 (bias 7, no inf, S.1111.111 = NaN): subnormals k/8 * 2^-6, normals (1 + k/8) * 2^e up to 448
E4M3_GRID = np.array([k / 8 * 2.0 ** -6 for k in range(8)]
                     + [(1 + k / 8) * 2.0 ** e for e in range(-6, 9) for k in range(8) if (1 + k / 8) * 2.0 ** e <= 448])
GRIDS = {"e2m1": E2M1_GRID, "e4m3": E4M3_GRID}
EMAX = {"e2m1": 2, "e4m3": 8}
FP32_MAX = float(np.finfo(np.float32).max)


def np_scale_exponent(amax: float, fmt: str, rule: str) -> int:
    """E8M0 exponent of a block: ocp = floor(log2 amax) - emax_elem; ceil = the smallest s with
    amax <= max_elem * 2^s. Clamped to [-127, 127]; an all-zero block gets -127."""
    if amax == 0:
        return -127
    top = GRIDS[fmt][-1]
    if rule == "ocp":
        s = math.floor(math.log2(amax)) - EMAX[fmt]
        while 2.0 ** (s + EMAX[fmt]) > amax:  # guard log2 rounding
            s -= 1
        while 2.0 ** (s + EMAX[fmt] + 1) <= amax:
            s += 1
    else:
        s = -200
        while amax > top * 2.0 ** s:
            s += 1
    return min(max(s, -127), 127)


def np_round_to_grid(y: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Nearest grid value to |y| (ties to the even code, above the top: the top), y's sign."""
    a = np.abs(y)
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    q = np.where(a >= grid[-1], grid[-1], grid[pick])
    return np.copysign(q, y)


def np_mx(x, fmt: str, rule: str, axis: int = -1):
    """Fake-quantized x (float64) and the scale exponents, blocks of 32 along `axis`. fp32
    subnormals (below 2^-126), in x or in a result, become signed zeros, and a result beyond fp32's
    range the largest fp32 (the module's contract)."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    x = np.where(np.abs(x) < 2.0 ** -126, 0.0 * x, x)
    xb = x.reshape(*x.shape[:-1], -1, 32)
    out = np.empty_like(xb)
    exps = np.empty(xb.shape[:-1], int)
    for i in np.ndindex(xb.shape[:-1]):
        blk = xb[i]
        if not np.isfinite(blk).all():
            out[i], exps[i] = np.nan, 0
            continue
        s = np_scale_exponent(float(np.abs(blk).max()), fmt, rule)
        q = np_round_to_grid(blk / 2.0 ** s, GRIDS[fmt]) * 2.0 ** s
        q = np.clip(q, -FP32_MAX, FP32_MAX)  # only X * q = 2^128 (ceil rule, amax near fp32's max) clips
        out[i], exps[i] = np.where(np.abs(q) < 2.0 ** -126, 0.0 * q, q), s
    return np.moveaxis(out.reshape(x.shape), -1, axis), exps


def largest_array_in_jaxpr(fn, *args) -> int:
    """Elements of the largest array any equation of fn's jaxpr (sub-jaxprs included: scan,
    remat and custom-VJP bodies) produces: a test that an array of some size never exists."""
    import jax
    import jax.extend

    sizes = [0]

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return max(sizes)


def pallas_kernels(closed) -> dict:
    """The Pallas kernels a traced function (a closed jaxpr) launches, by name, counted through
    every sub-jaxpr (scan, remat and custom-VJP bodies)."""
    import collections

    import jax.extend

    names = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                names[str(eqn.params["name"]).split()[0]] += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return names


def newton_schulz_np(x, steps: int, coeffs=(3.4445, -4.7750, 2.0315)):  # Keller Jordan's quintic
    """float64 Newton-Schulz of one matrix: Frobenius-normalise, then X <- aX + (bA + cA^2)X
    with A = XX^T on the wide orientation (tall matrices transposed there and back)."""
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-8)
    a, b, c = coeffs
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def byte_level_bpe(path, texts, vocab_size: int = 280):
    """A byte-level BPE tokenizer.json with no EOS token, trained on `texts` (the `tokenizers`
    package, as a user would make one) and saved at `path`; returns the tokenizers.Tokenizer."""
    import tokenizers

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bpe.save(str(path))
    return bpe
