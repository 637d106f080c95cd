"""The LM head and its cross-entropy in sequence chunks: fp32 logits are never whole in memory.

    h [B,T,d] (the final norm's output), w [d,V] (lm_head), targets [B,T] int, loss_mask [B,T]
    -> sums over the masked tokens: (cross-entropy, z-loss, correct argmax predictions, tokens)

The plain form (`token_losses` on `h @ w`) holds the [B,T,V] fp32 logits, and autodiff keeps
them for the backward and builds their gradient alongside: 2 x 4 x T x V bytes per row,
2.7 GB per 4,096-token row at K3's 163,840-token vocabulary. Here the T axis goes in chunks
of about `chunk` positions (strided, see below) through a `lax.scan` whose body is rematerialised: each chunk's logits
are computed, reduced to four sums and dropped; the backward recomputes one chunk's logits,
forms its gradient (softmax - onehot, plus the z-loss term) and folds it into dh and dw
before the next. Peak: one [B,chunk,V] fp32 block and its gradient.

Why chunks of the sequence and not of the vocabulary: every token's log-sum-exp needs all V
logits, so vocabulary chunks need a second pass (or an online max/sum); sequence chunks keep
each chunk's reductions exact and one-pass, and the batch axis stays whole so every data
shard works on every chunk (chunking the flattened B*T would put a chunk on one device).
A vocabulary sharded over `tensor` stays sharded inside a chunk as it is in the plain form.

`token_losses` is the plain form and the reference; the two agree to fp32 rounding (tests).
Inside the chunks the loss is `token_losses_fused` (same sums, its own VJP): the row max and
argmax in one pass over the logits (the plain form reads them once for each), and a backward
that writes d(logits) = mask * (softmax (1 + 2 z lse) - onehot) in one elementwise pass, the
one-hot from an iota compare (autodiff scattered into a zeroed fp32 [B,chunk,V] buffer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.matmul_f32 import matmul_f32_out

F32 = jnp.float32


def token_losses(logits, targets, loss_mask, z_loss: float):
    """Plain form. logits [B,T,V] -> sums over valid tokens: (ce, z-loss, correct, tokens)."""
    logits = logits.astype(F32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = jnp.sum((lse - target_logit) * loss_mask)
    zl = z_loss * jnp.sum(jnp.square(lse) * loss_mask)
    correct = jnp.sum((jnp.argmax(logits, -1) == targets) * loss_mask)
    return ce, zl, correct, jnp.sum(loss_mask)


def _max_argmax(logits):
    """Row max and its first index over the last axis, in one variadic reduction."""
    idx = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)

    def pick(a, b):
        (va, ia), (vb, ib) = a, b
        take_b = (vb > va) | ((vb == va) & (ib < ia)) | jnp.isnan(vb)
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)

    init = (jnp.array(-jnp.inf, logits.dtype), jnp.array(jnp.iinfo(jnp.int32).max, jnp.int32))
    return jax.lax.reduce((logits, idx), init, pick, (logits.ndim - 1,))


def _fused_parts(logits, targets, loss_mask):
    logits = logits.astype(F32)
    m, am = _max_argmax(logits)
    lse = m + jnp.log(jnp.sum(jnp.exp(logits - m[..., None]), axis=-1))
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return lse, target_logit, (am == targets).astype(F32)


@jax.custom_vjp
def _token_sums(logits, targets, loss_mask, z_loss):
    lse, tl, hit = _fused_parts(logits, targets, loss_mask)
    return (jnp.sum((lse - tl) * loss_mask), z_loss * jnp.sum(jnp.square(lse) * loss_mask),
            jnp.sum(hit * loss_mask), jnp.sum(loss_mask))


def _token_sums_fwd(logits, targets, loss_mask, z_loss):
    lse, tl, hit = _fused_parts(logits, targets, loss_mask)
    out = (jnp.sum((lse - tl) * loss_mask), z_loss * jnp.sum(jnp.square(lse) * loss_mask),
           jnp.sum(hit * loss_mask), jnp.sum(loss_mask))
    return out, (logits, targets, loss_mask, z_loss, lse, tl, hit)


def _token_sums_bwd(res, g):
    logits, targets, loss_mask, z_loss, lse, tl, hit = res
    g_ce, g_zl, g_hit, g_n = g
    p = jnp.exp(logits.astype(F32) - lse[..., None])
    onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
    scale = loss_mask * (g_ce + 2.0 * z_loss * g_zl * lse)
    d_logits = scale[..., None] * p - jnp.where(onehot, (loss_mask * g_ce)[..., None], 0.0)
    d_mask = g_ce * (lse - tl) + g_zl * z_loss * jnp.square(lse) + g_hit * hit + g_n
    d_z = g_zl * jnp.sum(jnp.square(lse) * loss_mask)
    return d_logits.astype(logits.dtype), None, d_mask.astype(loss_mask.dtype), d_z


_token_sums.defvjp(_token_sums_fwd, _token_sums_bwd)


def token_losses_fused(logits, targets, loss_mask, z_loss: float):
    """`token_losses` (same sums) with one pass less over the logits and its own VJP (module
    docstring); the accuracy count and the token count carry no gradient into the logits."""
    return _token_sums(logits, targets, loss_mask.astype(F32), jnp.asarray(z_loss, F32))


def head_logits(h, w, compute_dtype):
    """[B,T,d] x [d,V] -> fp32 logits, the lm_head's numerics (operands in the compute dtype,
    fp32 accumulation; the backward in the compute dtype: `k3jax.ops.matmul_f32`)."""
    return matmul_f32_out(h.astype(compute_dtype), w.astype(compute_dtype))


def chunked_token_losses(h, w, targets, loss_mask, z_loss: float, *, chunk: int, compute_dtype=jnp.bfloat16):
    """Sequence-chunked form (module docstring). chunk <= 0 or >= T: the plain form."""
    B, T, _ = h.shape
    if chunk <= 0 or chunk >= T:
        return token_losses_fused(head_logits(h, w, compute_dtype), targets, loss_mask, z_loss)
    n = -(-T // chunk)
    chunk = -(-T // n)  # the same number of chunks, as even as they can be
    pad = n * chunk - T
    if pad:  # padded positions carry loss_mask 0: they add nothing to any sum or gradient
        h = jnp.pad(h, [(0, 0), (0, pad), (0, 0)])
        targets = jnp.pad(targets, [(0, 0), (0, pad)])
        loss_mask = jnp.pad(loss_mask, [(0, 0), (0, pad)])
    # strided chunks: chunk j holds positions j, j + n, j + 2n, ... The loss is a sum over
    # tokens, so any partition will do, and this one keeps every chunk spread over the whole
    # sequence: with T split over a `context` mesh axis, each chunk has positions on every
    # context shard and all of them work on every chunk (contiguous chunks would each sit on
    # one shard, and XLA would move them)
    split = lambda x: jnp.moveaxis(x.reshape(B, chunk, n, *x.shape[2:]), 2, 0)  # noqa: E731  [n,B,chunk,...]

    @jax.checkpoint  # keep only the chunk's inputs: its logits are recomputed in the backward
    def one_chunk(hc, tc, mc):
        return token_losses_fused(head_logits(hc, w, compute_dtype), tc, mc, z_loss)

    def body(acc, xs):
        return jax.tree.map(jnp.add, acc, one_chunk(*xs)), None

    zero = jnp.zeros((), F32)
    (ce, zl, correct, count), _ = jax.lax.scan(body, (zero, zero, zero, zero),
                                               (split(h), split(targets), split(loss_mask.astype(F32))))
    return ce, zl, correct, count
