"""KDA operator: chunk and recurrent forms against a float64 loop written in tests/reference.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from k3jax.ops import chunk_kda, recurrent_kda
from k3jax.ops.kda_inputs import kda_inputs
from reference import delta_rule_loop, rel_err


@functools.partial(jax.jit, static_argnames=("chunk_size", "form"))
def run(q, k, v, g, beta, s0, seg, *, chunk_size, form="chunk"):
    fn = chunk_kda if form == "chunk" else recurrent_kda
    return fn(q, k, v, g, beta, initial_state=s0, segment_ids=seg, chunk_size=chunk_size)


f32 = functools.partial(jnp.asarray, dtype=jnp.float32)


@pytest.mark.parametrize("B,T,H,K,V,C,with_state", [
    (1, 64, 1, 16, 16, 64, False),   # one full chunk
    (2, 77, 2, 16, 8, 32, True),     # T % C != 0, K != V
    (1, 100, 2, 32, 16, 64, True),   # several sub-blocks, padding
    (2, 40, 3, 8, 24, 16, False),    # V > K, chunk = one sub-block
])
def test_chunk_matches_float64_loop(B, T, H, K, V, C, with_state):
    q, k, v, g, beta, s0 = kda_inputs(B * T + C, B, T, H, K, V)
    s0 = s0 if with_state else None
    o, S = run(*map(f32, (q, k, v, g, beta)), None if s0 is None else f32(s0), None, chunk_size=C)
    ref_o, ref_S = delta_rule_loop(q, k, v, g, beta, initial_state=s0)
    assert o.dtype == jnp.float32 and S.dtype == jnp.float32
    assert rel_err(o, ref_o) < 2e-6, rel_err(o, ref_o)
    assert rel_err(S, ref_S) < 2e-6, rel_err(S, ref_S)


def test_recurrent_matches_float64_loop():
    q, k, v, g, beta, s0 = kda_inputs(3, 2, 33, 2, 8, 12)
    o, S = run(*map(f32, (q, k, v, g, beta, s0)), None, chunk_size=64, form="recurrent")
    ref_o, ref_S = delta_rule_loop(q, k, v, g, beta, initial_state=s0)
    assert rel_err(o, ref_o) < 1e-6 and rel_err(S, ref_S) < 1e-6


def test_float64_chunk_is_exact():
    """In x64 mode the chunk form agrees with the loop to ~1e-12: its algebra is exact, only
    the rounding differs."""
    q, k, v, g, beta, s0 = kda_inputs(4, 1, 50, 2, 8, 8, lower_bound=-12.0)
    with jax.enable_x64(True):
        o, S = chunk_kda(*map(jnp.asarray, (q, k, v, g, beta)), initial_state=jnp.asarray(s0), chunk_size=32)
        assert o.dtype == jnp.float64
    ref_o, ref_S = delta_rule_loop(q, k, v, g, beta, initial_state=s0)
    assert rel_err(o, ref_o) < 1e-11 and rel_err(S, ref_S) < 1e-11


def test_bf16_inputs_against_float64_truth():
    """bf16 q/k/v, fp32 gates: the state stays fp32; o is rounded once to bf16."""
    B, T, H, K, V = 2, 96, 2, 32, 32
    q, k, v, g, beta, s0 = kda_inputs(5, B, T, H, K, V)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    o, S = run(*bf, f32(g), f32(beta), f32(s0), None, chunk_size=64)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    # truth on the same (rounded) inputs isolates the operator's own error ...
    qr, kr, vr = (np.asarray(x.astype(jnp.float32), np.float64) for x in bf)
    ref_o, ref_S = delta_rule_loop(qr, kr, vr, g, beta, initial_state=s0)
    assert rel_err(o, ref_o) < 5e-3  # one bf16 rounding of the output (2^-8 relative)
    assert rel_err(S, ref_S) < 1e-5  # fp32 state
    # ... and against the unrounded fp64 truth the input rounding is included
    ref_o64, _ = delta_rule_loop(q, k, v, g, beta, initial_state=s0)
    assert rel_err(o, ref_o64) < 2e-2


def test_prefill_then_continue_equals_one_call():
    q, k, v, g, beta, s0 = kda_inputs(6, 1, 90, 2, 16, 16)
    args = list(map(f32, (q, k, v, g, beta)))
    o_full, S_full = run(*args, f32(s0), None, chunk_size=32)
    T1 = 37
    first = [a[:, :T1] for a in args]
    rest = [a[:, T1:] for a in args]
    o1, S1 = run(*first, f32(s0), None, chunk_size=32)
    o2, S2 = run(*rest, S1, None, chunk_size=32)
    np.testing.assert_allclose(np.concatenate([o1, o2], 1), o_full, atol=2e-6)
    np.testing.assert_allclose(S2, S_full, atol=2e-6)
    # decode-style continuation: the token recurrence from the prefill state
    o2r, S2r = run(*rest, S1, None, chunk_size=32, form="recurrent")
    np.testing.assert_allclose(o2r, o2, atol=2e-6)
    np.testing.assert_allclose(S2r, S2, atol=2e-6)


def test_packed_segments_equal_separate_calls():
    """Three documents packed in one row (boundaries inside chunks and on a chunk edge)."""
    lengths = [21, 32 - 21 + 32, 30]  # second document starts mid-chunk, third on a chunk edge
    T = sum(lengths)
    q, k, v, g, beta, s0 = kda_inputs(7, 1, T, 2, 8, 8)
    seg = np.repeat(np.arange(len(lengths)), lengths)[None]
    args = list(map(f32, (q, k, v, g, beta)))
    o, S = run(*args, f32(s0), jnp.asarray(seg), chunk_size=32)
    start = 0
    for i, n in enumerate(lengths):
        part = [a[:, start:start + n] for a in args]
        oi, Si = run(*part, f32(s0) if i == 0 else None, None, chunk_size=32)
        np.testing.assert_allclose(o[:, start:start + n], oi, atol=2e-6)
        start += n
    np.testing.assert_allclose(S, Si, atol=2e-6)  # final state = the last document's
    ref_o, _ = delta_rule_loop(q, k, v, g, beta, initial_state=s0, segment_ids=seg)
    assert rel_err(o, ref_o) < 2e-6
    o_rec, _ = run(*args, f32(s0), jnp.asarray(seg), chunk_size=32, form="recurrent")
    assert rel_err(o_rec, ref_o) < 2e-6


def test_infinite_decay_clears_state_and_beta_zero_reads_state():
    B, T, H, K, V = 1, 24, 2, 8, 8
    q, k, v, g, beta, s0 = kda_inputs(8, B, T, H, K, V)
    # g = -inf at t = 10 forgets everything before it, including the initial state
    g_inf = g.copy()
    g_inf[:, 10] = -np.inf
    for form in ("chunk", "recurrent"):
        o, S = run(*map(f32, (q, k, v, g_inf, beta)), f32(s0), None, chunk_size=16, form=form)
        o_tail, S_tail = run(*[f32(a[:, 10:]) for a in (q, k, v, g_inf, beta)], None, None,
                             chunk_size=16, form=form)
        assert np.isfinite(np.asarray(o)).all()
        np.testing.assert_allclose(o[:, 10:], o_tail, atol=2e-6)
        np.testing.assert_allclose(S, S_tail, atol=2e-6)
    # beta = 0 and g = 0: nothing is written or forgotten, o_t = S0^T (scale q_t)
    zeros_h = np.zeros((B, T, H))
    zeros_k = np.zeros((B, T, H, K))
    for form in ("chunk", "recurrent"):
        o, S = run(*map(f32, (q, k, v, zeros_k, zeros_h, s0)), None, chunk_size=16, form=form)
        expect = np.einsum("bhkv,bthk->bthv", s0, q * K ** -0.5)
        np.testing.assert_allclose(o, expect, atol=2e-6)
        np.testing.assert_allclose(S, s0, atol=1e-6)


def _loss(form, q, k, v, g, beta, s0, w_o, w_s):
    fn = chunk_kda if form == "chunk" else recurrent_kda
    o, S = fn(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    return jnp.sum(o * w_o) + jnp.sum(S * w_s)


def test_gradients_chunk_equal_recurrent():
    B, T, H, K, V = 1, 40, 2, 8, 8
    q, k, v, g, beta, s0 = kda_inputs(9, B, T, H, K, V)
    rng = np.random.default_rng(10)
    w_o, w_s = rng.standard_normal((B, T, H, V)), rng.standard_normal((B, H, K, V))
    args = list(map(f32, (q, k, v, g, beta, s0, w_o, w_s)))
    grad = jax.jit(jax.grad(_loss, argnums=(1, 2, 3, 4, 5, 6)), static_argnums=0)
    gc = grad("chunk", *args)
    gr = grad("recurrent", *args)
    for name, a, b in zip("q k v g beta s0".split(), gc, gr):
        assert np.isfinite(np.asarray(a)).all(), name
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


@pytest.mark.parametrize("lower_bound,T,chunk", [(-5.0, 6, 4), (-40.0, 20, 16)])  # factored / pairwise branch
def test_check_grads_tiny_float64(lower_bound, T, chunk):
    """Autodiff of the chunk form against finite differences (x64 so the check is sharp), in
    both regimes of the runtime score branch (it has a hand-written VJP)."""
    q, k, v, g, beta, s0 = kda_inputs(11, 1, T, 1, 4, 3, lower_bound=lower_bound)
    with jax.enable_x64(True):
        f = lambda q, k, v, g, beta, s0: chunk_kda(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
        check_grads(f, tuple(map(jnp.asarray, (q, k, v, g, beta, s0))), order=1, modes=["rev"],
                    atol=1e-6, rtol=1e-6)


def test_bad_shapes_name_the_argument():
    q, k, v, g, beta, _ = kda_inputs(12, 1, 8, 2, 4, 4)
    with pytest.raises(ValueError, match="beta must be"):
        chunk_kda(*map(f32, (q, k, v, g)), f32(beta[..., :1]))
    with pytest.raises(ValueError, match="g must be the per-channel"):
        chunk_kda(*map(f32, (q, k, v)), f32(g[..., 0]), f32(beta))
    with pytest.raises(ValueError, match="initial_state must be"):
        chunk_kda(*map(f32, (q, k, v, g, beta)), initial_state=jnp.zeros((1, 2, 4, 5)))


@pytest.mark.parametrize("lower_bound", [-5.0, -40.0])  # factored scores / pairwise diagonal blocks
def test_associative_state_pass_and_both_score_paths(lower_bound):
    """The log-depth state pass and the sequential scan agree with the float64 loop; a gate
    bound of -5 keeps every 16-token decay span under 80 (two matmuls), -40 forces the exact
    pairwise diagonal blocks."""
    q, k, v, g, beta, s0 = kda_inputs(13, 1, 150, 2, 8, 8, lower_bound=lower_bound)
    seg = np.repeat([0, 1, 2], [40, 70, 40])[None]
    ref_o, ref_S = delta_rule_loop(q, k, v, g, beta, initial_state=s0, segment_ids=seg)
    for state_pass in ("scan", "associative"):
        o, S = chunk_kda(*map(f32, (q, k, v, g, beta)), initial_state=f32(s0), segment_ids=jnp.asarray(seg),
                         chunk_size=16, state_pass=state_pass)
        assert rel_err(o, ref_o) < 2e-6 and rel_err(S, ref_S) < 2e-6, state_pass
    # the caller's bound selects the two-matmul form statically; exact when g respects it
    o, S = chunk_kda(*map(f32, (q, k, v, g, beta)), initial_state=f32(s0), segment_ids=jnp.asarray(seg),
                     chunk_size=32, decay_bound=lower_bound)
    assert rel_err(o, ref_o) < 2e-6 and rel_err(S, ref_S) < 2e-6, "decay_bound"
    jaxpr = str(jax.make_jaxpr(lambda *a: chunk_kda(*a, chunk_size=32, decay_bound=lower_bound))(
        *map(f32, (q, k, v, g, beta))))
    assert ("cond[" in jaxpr) == (lower_bound == -40.0)  # -5: no runtime branch at all
    # a broken promise: both forms compute the gate clamped at the bound, like the loop does
    g_low = 3.0 * g
    want_o, want_S = delta_rule_loop(q, k, v, np.maximum(g_low, lower_bound), beta, initial_state=s0, segment_ids=seg)
    for fn in (chunk_kda, recurrent_kda):
        o, S = fn(*map(f32, (q, k, v, g_low, beta)), initial_state=f32(s0), segment_ids=jnp.asarray(seg),
                  chunk_size=32, decay_bound=lower_bound)
        assert rel_err(o, want_o) < 2e-6 and rel_err(S, want_S) < 2e-6, fn.__name__
