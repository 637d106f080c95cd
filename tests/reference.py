"""Independent float64 numpy references, written from each operator's per-token definition.

They share no code with k3jax: plain loops over batch, time and head.
"""

from __future__ import annotations

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
