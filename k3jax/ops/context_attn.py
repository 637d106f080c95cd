"""Blocked causal softmax attention of some queries over a longer key sequence, with segment
ids and global token indices: the context-parallel form (a shard's queries against the
gathered keys of the whole row), never a [Tq, Tk] score or mask matrix.

    o = blocked_attention(q, k, v, q_index, k_index, q_seg, k_seg, scale=...)

q [B,Tq,H,D], k [B,Tk,Hkv,D], v [B,Tk,Hkv,Dv] (H a multiple of Hkv: query head h reads kv head
h // (H/Hkv)); q_index [Tq] / k_index [Tk] int32: each token's index in the row (k_index
ascending); q_seg [B,Tq] / k_seg [B,Tk]: segment ids. Query t sees key s iff
k_index[s] <= q_index[t] and k_seg[s] == q_seg[t]. A query that sees nothing gets 0.

Online softmax (flash style) over [block_q, block_k] tiles in fp32; key blocks that lie wholly
after a query block are skipped. The custom VJP keeps q, k, v, o and the log-sum-exp and
recomputes the tiles in the backward pass, so memory stays linear in Tq + Tk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_NEG = -1e30  # a finite "minus infinity": a fully masked tile never produces inf - inf


def blocked_attention(q, k, v, q_index, k_index, q_seg, k_seg, *, scale: float, block_q: int = 512,
                      block_k: int = 512):
    """See the module docstring. Returns o [B,Tq,H,Dv] in v's dtype."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if k.shape != (B, Tk, Hkv, D) or v.shape[:3] != (B, Tk, Hkv) or H % Hkv:
        raise ValueError(f"blocked_attention: shapes disagree: q {q.shape}, k {k.shape}, v {v.shape}")
    bq, bk = min(block_q, Tq), min(block_k, Tk)
    pq, pk = (-Tq) % bq, (-Tk) % bk
    def pad(x, n):
        return jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2))

    # padded queries have index -1 (see nothing); padded keys an index past every query
    qi = jnp.pad(q_index.astype(jnp.int32), (0, pq), constant_values=-1)
    ki = jnp.pad(k_index.astype(jnp.int32), (0, pk), constant_values=jnp.iinfo(jnp.int32).max)
    o = _attend(pad(q, pq), pad(k, pk), pad(v, pk), qi, ki, pad(q_seg, pq), pad(k_seg, pk),
                _Static(float(scale), bq, bk))
    return o[:, :Tq]


class _Static(tuple):
    """(scale, block_q, block_k): hashable static arguments of the custom VJP."""

    def __new__(cls, scale, bq, bk):
        return super().__new__(cls, (scale, bq, bk))


def _tiles(q, k, v, qi, ki, qs, ks, st):
    """Reshape into blocks: q [nq,B,bq,Hkv,R,D], k/v [nk,B,bk,Hkv,*], indices and ids per block."""
    _, bq, bk = st
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    R = H // Hkv
    nq, nk = Tq // bq, Tk // bk
    qb = jnp.moveaxis(q.reshape(B, nq, bq, Hkv, R, D), 1, 0)
    kb = jnp.moveaxis(k.reshape(B, nk, bk, Hkv, D), 1, 0)
    vb = jnp.moveaxis(v.reshape(B, nk, bk, Hkv, v.shape[-1]), 1, 0)
    return (qb, kb, vb, qi.reshape(nq, bq), ki.reshape(nk, bk), jnp.moveaxis(qs.reshape(B, nq, bq), 1, 0),
            jnp.moveaxis(ks.reshape(B, nk, bk), 1, 0))


def _scores(qb, kb, qi, ki, qs, ks, scale):
    """One tile: scores [B,Hkv,R,bq,bk] fp32 and the visibility mask [B,1,1,bq,bk]."""
    s = jnp.einsum("bqgrd,bkgd->bgrqk", qb, kb, preferred_element_type=jnp.float32) * scale
    ok = (ki[None, :] <= qi[:, None])[None] & (qs[:, :, None] == ks[:, None, :])
    return s, ok[:, None, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attend(q, k, v, qi, ki, qs, ks, st):
    return _forward(q, k, v, qi, ki, qs, ks, st)[0]


def _forward(q, k, v, qi, ki, qs, ks, st):
    scale, bq, _ = st
    qb, kb, vb, qib, kib, qsb, ksb = _tiles(q, k, v, qi, ki, qs, ks, st)
    nk = kb.shape[0]
    B, _, Hkv, R, _ = qb.shape[1:]
    Dv = v.shape[-1]

    def query_block(args):
        qt, qit, qst = args
        last = jnp.max(qit)

        def key_block(j, carry):
            def visit(carry):
                m, l, acc = carry
                s, ok = _scores(qt, kb[j], qit, kib[j], qst, ksb[j], scale)
                s = jnp.where(ok, s, _NEG)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
                corr = jnp.exp(m - m_new)
                pv = jnp.einsum("bgrqk,bkgv->bgrqv", p.astype(v.dtype), vb[j], preferred_element_type=jnp.float32)
                return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv
            # causal: a key block that starts after the query block's last index is all masked
            return jax.lax.cond(kib[j][0] <= last, visit, lambda c: c, carry)

        init = (jnp.full((B, Hkv, R, bq), _NEG, jnp.float32), jnp.zeros((B, Hkv, R, bq), jnp.float32),
                jnp.zeros((B, Hkv, R, bq, Dv), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, nk, key_block, init)
        o = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
        lse = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), 0.0)
        return o, lse

    o, lse = jax.lax.map(query_block, (qb, qib, qsb))  # [nq,B,Hkv,R,bq,Dv], [nq,B,Hkv,R,bq]
    Tq, H = q.shape[1], q.shape[2]
    o_out = jnp.moveaxis(o, 4, 2).reshape(o.shape[0], B, bq, H, Dv)  # [nq,B,bq,H,Dv]
    o_out = jnp.moveaxis(o_out, 0, 1).reshape(B, Tq, H, Dv).astype(v.dtype)
    return o_out, lse


def _fwd(q, k, v, qi, ki, qs, ks, st):
    o, lse = _forward(q, k, v, qi, ki, qs, ks, st)
    return o, (q, k, v, qi, ki, qs, ks, o, lse)


def _bwd(st, res, do):
    scale, bq, _ = st
    q, k, v, qi, ki, qs, ks, o, lse = res
    B, Tq, H, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[-1]
    R = H // Hkv
    # delta_t = do_t . o_t: the softmax Jacobian's row term
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B,Tq,H]
    qb, kb, vb, qib, kib, qsb, ksb = _tiles(q, k, v, qi, ki, qs, ks, st)
    nq, nk = qb.shape[0], kb.shape[0]
    dob = jnp.moveaxis(do.reshape(B, nq, bq, Hkv, R, Dv), 1, 0)
    deltab = jnp.moveaxis(jnp.moveaxis(delta.reshape(B, nq, bq, Hkv, R), 1, 0), 2, 4)  # [nq,B,Hkv,R,bq]

    def query_block(i, carry):
        dq, dk, dv = carry
        qt, qit, qst, dot, dlt, lt = qb[i], qib[i], qsb[i], dob[i], deltab[i], lse[i]
        last = jnp.max(qit)

        def key_block(j, inner):
            def visit(inner):
                dq_i, dk, dv = inner
                s, ok = _scores(qt, kb[j], qit, kib[j], qst, ksb[j], scale)
                p = jnp.where(ok, jnp.exp(s - lt[..., None]), 0.0)  # [B,Hkv,R,bq,bk]
                dv = dv.at[j].add(jnp.einsum("bgrqk,bqgrv->bkgv", p, dot.astype(jnp.float32)))
                dp = jnp.einsum("bqgrv,bkgv->bgrqk", dot.astype(jnp.float32), vb[j].astype(jnp.float32))
                ds = p * (dp - dlt[..., None]) * scale
                dq_i = dq_i + jnp.einsum("bgrqk,bkgd->bqgrd", ds, kb[j].astype(jnp.float32))
                dk = dk.at[j].add(jnp.einsum("bgrqk,bqgrd->bkgd", ds, qt.astype(jnp.float32)))
                return dq_i, dk, dv
            return jax.lax.cond(kib[j][0] <= last, visit, lambda c: c, inner)

        dq_i, dk, dv = jax.lax.fori_loop(0, nk, key_block, (jnp.zeros(qt.shape, jnp.float32), dk, dv))
        return dq.at[i].set(dq_i), dk, dv

    init = (jnp.zeros(qb.shape, jnp.float32), jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32))
    dq, dk, dv = jax.lax.fori_loop(0, nq, query_block, init)
    dq = jnp.moveaxis(dq, 0, 1).reshape(B, Tq, H, D).astype(q.dtype)
    dk = jnp.moveaxis(dk, 0, 1).reshape(k.shape).astype(k.dtype)
    dv = jnp.moveaxis(dv, 0, 1).reshape(v.shape).astype(v.dtype)
    return dq, dk, dv, None, None, None, None


_attend.defvjp(_fwd, _bwd)
