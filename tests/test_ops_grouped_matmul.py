"""grouped_matmul: both fast forms against a float64 per-row product written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.grouped_matmul import grouped_glu_mlp, grouped_matmul, grouped_matmul_reference


def _np_grouped(x, w, sizes):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = np.zeros((x.shape[0], w.shape[2]))
    r = 0
    for g, s in enumerate(np.asarray(sizes)):
        y[r:r + s] = x[r:r + s] @ w[g]
        r += s
    return y  # rows past sum(sizes) stay zero


def _case(seed, sizes, m, d=5, f=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d)).astype(np.float32)
    w = rng.standard_normal((len(sizes), d, f)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(np.asarray(sizes, np.int32))


# empty first / middle / last groups, a group bigger than a block, rows past the last group
SIZES = [0, 7, 0, 1, 4, 0]


@pytest.mark.parametrize("impl,block", [("ragged", 0), ("blocked", 1), ("blocked", 3), ("blocked", 4),
                                        ("blocked", 64)])
def test_grouped_matmul_forms_equal_float64(impl, block):
    x, w, sizes = _case(0, SIZES, m=14)
    fn = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, impl=impl, block=block or 256))
    want = _np_grouped(x, w, sizes)
    np.testing.assert_allclose(np.asarray(fn(x, w, sizes)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grouped_matmul_reference(x, w, sizes)), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(fn(x, w, sizes))[12:] == 0)  # past sum(sizes)=12


def test_blocked_gradients_equal_float64_reference():
    x, w, sizes = _case(1, [3, 0, 5, 2], m=11)
    cot = jax.random.normal(jax.random.key(2), (11, 3))

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w) * cot)

    got = jax.jit(jax.grad(loss(lambda x, w: grouped_matmul(x, w, sizes, impl="blocked", block=2)),
                           argnums=(0, 1)))(x, w)
    # float64 truth: dy = cot on the grouped rows; dx[r] = cot[r] w[g]^T, dw[g] = x_g^T cot_g
    X, W, C = (np.asarray(v, np.float64) for v in (x, w, cot))
    dx, dw = np.zeros_like(X), np.zeros_like(W)
    r = 0
    for g, s in enumerate(np.asarray(sizes)):
        dx[r:r + s] = C[r:r + s] @ W[g].T
        dw[g] = X[r:r + s].T @ C[r:r + s]
        r += s
    np.testing.assert_allclose(np.asarray(got[0]), dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), dw, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got[1])[1] == 0)  # the empty group gets no gradient


def test_blocked_bf16_keeps_fp32_output():
    x, w, sizes = _case(3, [2, 3], m=5)
    y = grouped_matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), sizes, impl="blocked", block=2,
                       preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32
    want = _np_grouped(x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32), sizes)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


def test_unknown_impl_is_named():
    x, w, sizes = _case(4, [1], m=1)
    with pytest.raises(ValueError, match="blocked"):
        grouped_matmul(x, w, sizes, impl="dense")


@pytest.mark.parametrize("impl", ["ragged", "blocked"])
def test_grouped_glu_mlp_equals_float64(impl):
    """The three matmuls sharing one block layout: each group's w2 silu(w1 x) * (w3 x)."""
    x, w1, sizes = _case(5, SIZES, m=14, d=5, f=4)
    rng = np.random.default_rng(6)
    w3 = jnp.asarray(rng.standard_normal(w1.shape).astype(np.float32))
    w2 = jnp.asarray(rng.standard_normal((len(SIZES), 4, 5)).astype(np.float32))
    glu = lambda a, b: jax.nn.silu(a) * b  # noqa: E731
    got = grouped_glu_mlp(x, w1, w3, w2, sizes, glu, compute_dtype=jnp.float32, impl=impl, block=3)
    a, b = _np_grouped(x, w1, sizes), _np_grouped(x, w3, sizes)
    h = a / (1 + np.exp(-a)) * b
    np.testing.assert_allclose(np.asarray(got), _np_grouped(h, w2, sizes), rtol=1e-5, atol=1e-5)
    assert got.dtype == jnp.float32


def _fake_tokamax(monkeypatch) -> dict:
    """Replace tokamax's three kernel calls (forward, dx, dw) by plain per-group products that
    count their traces and write garbage (7.0) past sum(group_sizes), as the kernels leave those
    rows unwritten. Returns the trace counts {(kind, lhs shape, rhs shape): n}."""
    import k3jax.ops.grouped_matmul as gm

    traces = {}

    def fake_call(lhs, rhs, sizes, kind, out_dtype):
        traces[(kind, lhs.shape, rhs.shape)] = traces.get((kind, lhs.shape, rhs.shape), 0) + 1
        M = lhs.shape[0]
        group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(M), side="right")
        onehot = (group[:, None] == jnp.arange(sizes.shape[0])[None, :]).astype(jnp.float32)  # [M,G], 0 past sum
        lhs32, rhs32 = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
        if kind == "contract":
            return jnp.einsum("mg,mk,mn->gkn", onehot, lhs32, rhs32).astype(out_dtype)
        w = rhs32 if kind == "dot" else jnp.swapaxes(rhs32, 1, 2)
        y = jnp.einsum("mg,mk,gkn->mn", onehot, lhs32, w)
        return jnp.where((group < sizes.shape[0])[:, None], y, 7.0).astype(out_dtype)  # "unwritten" rows

    monkeypatch.setattr(gm, "_tokamax_call", fake_call)
    monkeypatch.setattr(gm, "kernel_unavailable", lambda: None)
    jax.clear_caches()  # the jitted kernel calls may hold traces of the real call
    return traces


@pytest.mark.parametrize("weight_grad", ["tokamax", "pallas"])
def test_kernel_path_traces_each_kernel_shape_once_and_keeps_its_gradients(monkeypatch, weight_grad):
    """The `kernel` form's plumbing on CPU: tokamax's three kernel calls (forward, dx, dw)
    replaced by plain per-group products that count their traces and write garbage past
    sum(group_sizes), as the kernels leave those rows unwritten. Each kernel shape must be traced
    once however often it is met (two MoE layers in a Python loop, forward and backward: one
    jit per kernel call), the unrouted rows must come out zero, and the gradients must be the
    float64 per-group ones. weight_grad="pallas": dw by k3jax's kernel (Pallas interpreter)
    instead of tokamax's contracting one, which is then never called."""
    import k3jax.ops.grouped_matmul as gm

    traces = _fake_tokamax(monkeypatch)
    sizes_np = [3, 0, 5, 2]
    x, w1, sizes = _case(7, sizes_np, m=12, d=16, f=16)  # rows 10, 11 are past sum(sizes)
    rng = np.random.default_rng(8)
    w1 = w1 * 0.3
    w3 = jnp.asarray(0.3 * rng.standard_normal(w1.shape).astype(np.float32))
    w2 = jnp.asarray(0.3 * rng.standard_normal((4, 16, 16)).astype(np.float32))
    glu = lambda a, b: a * b  # noqa: E731  (bilinear: the float64 gradients below by hand)
    cot = jnp.asarray(rng.standard_normal((12, 16)).astype(np.float32))

    def loss(x, w1, w3, w2):
        y = x
        for _ in range(2):  # two layers of one shape
            y = gm.grouped_glu_mlp(y, w1, w3, w2, sizes, glu, compute_dtype=jnp.float32, impl="kernel",
                                   weight_grad=weight_grad)
        return jnp.sum(y * cot), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, w1, w3, w2)
    assert traces and all(n == 1 for n in traces.values()), traces
    assert {k[0] for k in traces} == ({"dot", "dot_trans_rhs", "contract"} if weight_grad == "tokamax"
                                      else {"dot", "dot_trans_rhs"})

    # float64: layer f(x) = G2(G1(x) * G3(x)) per group, twice; gradients by the chain rule
    X, W1, W3, W2, C = (np.asarray(v, np.float64) for v in (x, w1, w3, w2, cot))
    n = sum(sizes_np)
    seg = np.repeat(np.arange(4), sizes_np)

    def layer(x):
        a = np.stack([x[r] @ W1[seg[r]] for r in range(n)])
        b = np.stack([x[r] @ W3[seg[r]] for r in range(n)])
        out = np.zeros((12, 16))
        out[:n] = np.stack([(a[r] * b[r]) @ W2[seg[r]] for r in range(n)])
        return out, a, b

    y1, a1, b1 = layer(X)
    y2, a2, b2 = layer(y1)
    np.testing.assert_allclose(np.asarray(y), y2, rtol=1e-4, atol=1e-4)
    assert np.all(np.asarray(y)[n:] == 0)

    def layer_bwd(x, a, b, dy):
        dx, dw1, dw3, dw2 = np.zeros_like(x), np.zeros_like(W1), np.zeros_like(W3), np.zeros_like(W2)
        for r in range(n):
            g = seg[r]
            h = a[r] * b[r]
            dh = W2[g] @ dy[r]
            dw2[g] += np.outer(h, dy[r])
            da, db = dh * b[r], dh * a[r]
            dw1[g] += np.outer(x[r], da)
            dw3[g] += np.outer(x[r], db)
            dx[r] = W1[g] @ da + W3[g] @ db
        return dx, dw1, dw3, dw2

    dy1, g1, g3, g2 = layer_bwd(y1, a2, b2, C)
    dx, h1, h3, h2 = layer_bwd(X, a1, b1, dy1)
    for got, want in zip(grads, (dx, g1 + h1, g3 + h3, g2 + h2)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_sm90_configs_take_the_measured_tile_only_where_it_divides_the_shape():
    """k3jax's measured tile for tokamax's sm90 grouped dot (128 x 128 outputs, block_k 64) at
    k3-small's shapes; tokamax's own choice (None) where the tile does not divide K and N; the
    weight gradient's tile that agreed with an fp32 reference on the GPU; a named error for an
    unknown kind."""
    from k3jax.ops.grouped_matmul_configs import sm90_config

    for k, n, out in ((768, 512, 2), (512, 768, 4), (768, 1024, 2)):
        cfg = sm90_config("dot", k, n, out)
        assert (cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["num_stages"]) == (128, 128, 64, 2)
        assert k % cfg["block_k"] == 0 and n % cfg["block_n"] == 0
    assert sm90_config("dot", 96, 512, 2) is None  # K not a multiple of 64
    assert sm90_config("dot", 768, 192, 2) is None  # N not a multiple of 128
    dw = sm90_config("contract", 768, 512, 2)  # tokamax's fallback (block_k 128) is wrong here on an H200
    assert (dw["block_m"], dw["block_n"], dw["block_k"], dw["num_stages"]) == (64, 64, 64, 2)
    with pytest.raises(ValueError, match="kind"):
        sm90_config("ragged", 768, 512, 2)


@pytest.mark.parametrize("spec", [("situ", 4.0, 25.0), ("swiglu", 4.0, 25.0)])
def test_kernel_path_glu_backwards_equal_the_plain_glu(monkeypatch, spec):
    """model.moe.glu_grad on the kernel path (tokamax faked as above): the GLU of the gate|up
    product runs `k3jax.ops.glu_grad`'s kernel in its backward (pallas, the interpreter) or its
    one-fusion XLA form (xla), and every gradient equals the blocked form's, which runs the plain
    GLU on the two halves under autodiff, within one bf16 rounding, bf16 as in training."""
    import functools

    from k3jax.layers.activations import apply_glu

    _fake_tokamax(monkeypatch)
    rng = np.random.default_rng(5)
    sizes = jnp.asarray([5, 0, 9, 2], jnp.int32)  # rows 16..31 unrouted
    bf = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.5, jnp.bfloat16)  # noqa: E731
    x, w1, w3, w2 = bf(32, 16), bf(4, 16, 32), bf(4, 16, 32), bf(4, 32, 16)
    cot = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)

    def grads(impl, glu_grad):
        def loss(*p):
            y = grouped_glu_mlp(*p, sizes, functools.partial(apply_glu, spec), compute_dtype=jnp.bfloat16,
                                impl=impl, block=16, glu_spec=spec, glu_grad=glu_grad)
            return jnp.sum(y * cot)
        f = jax.grad(loss, argnums=(0, 1, 2, 3))
        return f(x, w1, w3, w2), str(jax.make_jaxpr(f)(x, w1, w3, w2))

    (want, _) = grads("blocked", "xla")
    (got_k, jaxpr_k), (got_x, jaxpr_x) = grads("kernel", "pallas"), grads("kernel", "xla")
    assert "name=glu_grad" in jaxpr_k and "name=glu_grad" not in jaxpr_x
    for got in (got_k, got_x):
        for a, b in zip(got, want):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.abs(a - b).max() <= 2 ** -7 * np.abs(b).max(), np.abs(a - b).max()
