"""The sequence-chunked LM head + loss against a float64 NumPy loss, and the property it
exists for: no [B,T,V] array anywhere in its forward or backward."""

import jax
import jax.numpy as jnp
import numpy as np
from reference import largest_array_in_jaxpr

from k3jax.ops.chunked_loss import chunked_token_losses


def numpy_losses(h, w, targets, mask, z):
    """float64: logits = h @ w, ce / z-loss / correct sums over masked tokens."""
    logits = h.astype(np.float64) @ w.astype(np.float64)
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    tgt = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return (((lse - tgt) * mask).sum(), z * (lse ** 2 * mask).sum(),
            ((logits.argmax(-1) == targets) * mask).sum(), mask.sum())


def test_chunked_loss_values_and_gradients_match_float64():
    rng = np.random.default_rng(0)
    B, T, d, V, z = 2, 37, 16, 50, 1e-3  # T not a multiple of the chunk: the last chunk is padded
    h = rng.normal(size=(B, T, d)).astype(np.float32)
    w = (rng.normal(size=(d, V)) * 0.5).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    mask = (rng.random((B, T)) > 0.2).astype(np.float32)
    want = numpy_losses(h, w, targets, mask, z)
    for chunk in (8, 0):  # chunked, and the plain form behind the same call
        got = chunked_token_losses(jnp.asarray(h), jnp.asarray(w), jnp.asarray(targets), jnp.asarray(mask), z,
                                   chunk=chunk, compute_dtype=jnp.float32)
        np.testing.assert_allclose([float(x) for x in got], want, rtol=2e-5)

    # gradients of ce + z-loss wrt h and w, against the analytic float64 form:
    # dlogits = mask * (softmax * (1 + 2 z lse) - onehot)
    logits = h.astype(np.float64) @ w.astype(np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    dl = p * (1 + 2 * z * lse)[..., None]
    dl[np.arange(B)[:, None], np.arange(T)[None, :], targets] -= 1
    dl *= mask[..., None]
    dh_ref, dw_ref = dl @ w.T.astype(np.float64), np.einsum("btd,btv->dv", h.astype(np.float64), dl)

    def loss(h, w):
        ce, zl, _, _ = chunked_token_losses(h, w, jnp.asarray(targets), jnp.asarray(mask), z, chunk=8,
                                            compute_dtype=jnp.float32)
        return ce + zl
    dh, dw = jax.grad(loss, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(dh), dh_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), dw_ref, rtol=1e-4, atol=1e-5)


def test_chunked_loss_never_builds_the_whole_logits():
    """Every array in the jaxpr of value_and_grad (forward, scan bodies, backward) is smaller
    than B*T*V elements when chunked; the plain form has [B,T,V] ones."""
    B, T, d, V = 2, 64, 8, 96
    args = (jnp.zeros((B, T, d)), jnp.zeros((d, V)), jnp.zeros((B, T), jnp.int32), jnp.ones((B, T)))

    def biggest(chunk):
        f = jax.value_and_grad(lambda h, w, t, m: sum(chunked_token_losses(h, w, t, m, 1e-4, chunk=chunk,
                                                                           compute_dtype=jnp.float32)[:2]),
                               argnums=(0, 1))
        return largest_array_in_jaxpr(f, *args)

    assert biggest(0) >= B * T * V
    assert biggest(16) <= B * 16 * V


def test_fused_token_losses_equal_the_plain_form():
    """token_losses_fused (one max/argmax pass, its own VJP) against token_losses under
    autodiff: the four sums, argmax ties resolved to the first index as jnp.argmax does, and
    the gradients wrt the logits, the mask and the z-loss weight."""
    from k3jax.ops.chunked_loss import token_losses, token_losses_fused
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 7, 11)).astype(np.float32) * 3
    logits[0, 0, [2, 5]] = 9.0  # a tie: the first index wins
    targets = rng.integers(0, 11, (2, 7)).astype(np.int32)
    targets[0, 0] = 5
    mask = (rng.random((2, 7)) > 0.3).astype(np.float32)
    mask[0, 0] = 1.0
    args = (jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
    got, want = token_losses_fused(*args, 1e-2), token_losses(*args, 1e-2)
    np.testing.assert_allclose([float(x) for x in got], [float(x) for x in want], rtol=1e-6)

    def f(fn, lg, m, z):
        ce, zl, correct, n = fn(lg, args[1], m, z)
        return ce + 3.0 * zl + 0.5 * correct + 0.25 * n

    g = jax.grad(lambda *a: f(token_losses_fused, *a), argnums=(0, 1, 2))(args[0], args[2], 1e-2)
    r = jax.grad(lambda *a: f(token_losses, *a), argnums=(0, 1, 2))(args[0], args[2], 1e-2)
    for a, b in zip(g, r):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
