"""Packed-document attention: the document-start rule, its agreement with running each
document alone, the kernel selection's errors, and the planning stand-in's memory shape.
(The fused GPU kernel itself is checked against the naive reference in
benchmarks/ops/attention.py, whose output is in BENCHMARKS.md.)"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import largest_array_in_jaxpr

from k3jax.config import ConfigError, load_config
from k3jax.kernel_paths import attention_path, expert_matmul_path
from k3jax.ops.flash_attention import document_start
from k3jax.ops.planning import planning_for
from k3jax.ops.softmax_attn import (
    causal_softmax_attention,
    naive_causal_softmax_attention,
)

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "k3-tiny.yaml")


def test_document_start_against_a_loop():
    seg = np.array([[3, 3, 1, 1, 1, 3, 3, 0], [5, 5, 5, 5, 5, 5, 5, 5]], np.int32)
    want = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        start = 0
        for t in range(seg.shape[1]):
            if t and seg[b, t] != seg[b, t - 1]:
                start = t
            want[b, t] = start
    np.testing.assert_array_equal(document_start(jnp.asarray(seg)), want)


@pytest.mark.parametrize("impl", ["xla", "naive"])
def test_packed_row_equals_each_document_alone(impl):
    """ids [1,1,1,2,2,1,1,1,1]: the third run reuses id 1 but is its own document (as for the
    linear-attention recurrences), so each run's output equals attention over that run alone."""
    rng = np.random.default_rng(0)
    T, H, D, Dv = 9, 2, 8, 4
    q, k = (jnp.asarray(rng.normal(size=(1, T, H, D)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(1, T, H, Dv)), jnp.float32)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 1, 1, 1, 1]], jnp.int32)
    fn = naive_causal_softmax_attention if impl == "naive" else causal_softmax_attention
    kw = {} if impl == "naive" else {"impl": "xla"}
    packed = fn(q, k, v, segment_ids=seg, **kw)
    for a, b in ((0, 3), (3, 5), (5, 9)):
        # float64 reference of one document alone
        qs, ks, vs = (np.asarray(x[0, a:b], np.float64) for x in (q, k, v))
        s = np.einsum("thd,shd->hts", qs, ks) / np.sqrt(D)
        s = np.where(np.tril(np.ones((b - a, b - a), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(packed[0, a:b], np.einsum("hts,shd->thd", p, vs), rtol=1e-5, atol=1e-6)


def test_kernel_requests_off_gpu_are_config_errors():
    tiny = TINY
    cfg = load_config(tiny, [])
    assert attention_path(cfg.model) == "xla (dense mask)"
    assert expert_matmul_path(cfg.model) == "blocked"
    with pytest.raises(ConfigError, match="model.mla.impl"):
        attention_path(load_config(tiny, ["model.mla.impl=kernel"]).model)
    with pytest.raises(ConfigError, match="model.moe.grouped_matmul"):
        expert_matmul_path(load_config(tiny, ["model.moe.grouped_matmul=kernel"]).model)
    assert attention_path(load_config(tiny, ["model.layer_pattern=4*kda"]).model) is None


def test_expert_kernel_line_names_the_weight_gradient_kernel(monkeypatch):
    """The launch line says which kernel computes the experts' weight gradient: k3jax's Pallas
    kernel by default, and that tokamax's was found wrong when it is chosen."""
    import k3jax.ops.grouped_matmul as gm

    monkeypatch.setattr(gm, "kernel_unavailable", lambda: None)  # as on a GPU with the [gpu] extra
    on = ["model.moe.grouped_matmul=kernel"]
    assert expert_matmul_path(load_config(TINY, on).model) == \
        "kernel (tokamax grouped GEMM; weight gradient: k3jax's Pallas kernel)"
    line = expert_matmul_path(load_config(TINY, on + ["model.moe.gmm_weight_grad=tokamax"]).model)
    assert "weight gradient: tokamax's (wrong on an H200 at times" in line


def test_planning_for_gpu_traces_no_score_matrix():
    """k3jax-plan for a GPU target compiles the kernel's stand-in: nothing of T*T size in the
    forward or backward, while the XLA form has [B,H,T,T] scores; the stand-in's gradients
    have the inputs' shapes and dtypes."""
    B, T, H, D, Dv = 1, 64, 2, 8, 4
    q, k = jnp.ones((B, T, H, D), jnp.bfloat16), jnp.ones((B, T, H, D), jnp.bfloat16)
    v = jnp.ones((B, T, H, Dv), jnp.bfloat16)
    seg = jnp.ones((B, T), jnp.int32)

    def biggest():
        f = jax.grad(lambda q, k, v: jnp.sum(causal_softmax_attention(q, k, v, segment_ids=seg)
                                             .astype(jnp.float32)), argnums=(0, 1, 2))
        return largest_array_in_jaxpr(f, q, k, v), f(q, k, v)

    cpu_max, _ = biggest()
    assert cpu_max >= B * H * T * T
    with planning_for("gpu"):
        gpu_max, grads = biggest()
    assert gpu_max < T * T
    assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, k, v)]


def _fake_tokamax_attention(monkeypatch) -> list:
    """tokamax's modules replaced by a fake kernel that attends with exactly the mask it is
    given (tokamax's `k_start` per query, causal) and the scale, and records the q shape of
    each trace (returned)."""
    import sys
    import types

    traces = []

    class Mask:
        def __init__(self, k_start, is_causal):
            self.k_start, self.is_causal = k_start, is_causal

    def fake_kernel(q, k, v, *, mask, logits_scale):
        traces.append(q.shape)
        assert mask.is_causal and mask.k_start.shape == (q.shape[0], 1, q.shape[1])
        T = q.shape[1]
        s = jnp.einsum("bthd,bshd->bhts", q, k) * logits_scale
        key = jnp.arange(T)[None, None, None, :]
        allowed = (key >= mask.k_start[:, :, :, None]) & (key <= jnp.arange(T)[None, None, :, None])
        p = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1)
        return jnp.einsum("bhts,bshd->bthd", p, v)

    mods = {"tokamax": types.ModuleType("tokamax"), "tokamax._src": types.ModuleType("tokamax._src"),
            "tokamax._src.ops": types.ModuleType("tokamax._src.ops"),
            "tokamax._src.ops.attention": types.ModuleType("tokamax._src.ops.attention"),
            "tokamax._src.ops.attention.base": types.ModuleType("tokamax._src.ops.attention.base"),
            "tokamax._src.ops.attention.api": types.ModuleType("tokamax._src.ops.attention.api")}
    mods["tokamax._src.ops.attention.base"].Mask = Mask
    mods["tokamax._src.ops.attention.api"].IMPLEMENTATIONS = {"mosaic_gpu": fake_kernel}
    mods["tokamax._src.ops.attention"].base = mods["tokamax._src.ops.attention.base"]
    mods["tokamax._src.ops.attention"].api = mods["tokamax._src.ops.attention.api"]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    jax.clear_caches()
    return traces


def test_kernel_call_is_traced_once_per_shape_and_builds_the_document_mask(monkeypatch):
    """`flash_causal_attention`'s tokamax call on CPU, with tokamax's modules replaced by a fake
    kernel (`_fake_tokamax_attention`): two calls of one shape, forward and backward, trace it
    once (its own jit), and the result and its gradients equal the naive reference on the same
    packed documents."""
    from k3jax.ops import flash_attention as fa

    traces = _fake_tokamax_attention(monkeypatch)
    B, T, H, D = 2, 8, 2, 4
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q, k, v = (jax.random.normal(key, (B, T, H, D)) for key in (kq, kk, kv))
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1]])
    scale = D ** -0.5

    def loss(attend, q, k, v):
        return jnp.sum(jnp.sin(attend(q, k, v)))

    kernel = lambda q, k, v: fa.flash_causal_attention(q, k, v, scale=scale, doc_start=document_start(seg))  # noqa: E731
    naive = lambda q, k, v: naive_causal_softmax_attention(q, k, v, scale=scale, segment_ids=seg)  # noqa: E731
    twice = lambda q, k, v: kernel(kernel(q, k, v), k, v)  # noqa: E731
    got = jax.jit(jax.value_and_grad(lambda *a: loss(twice, *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(lambda q, k, v: naive(naive(q, k, v), k, v), *a),
                                      argnums=(0, 1, 2)))(q, k, v)
    assert traces == [(B, T, H, D)], traces
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_kernel_runs_per_shard_on_a_mesh(monkeypatch):
    """Under a mesh (8 CPU devices: data 2 x fsdp 2 x tensor 2) the kernel sees one shard, 1 of
    the 4 rows and 1 of the 2 heads (tokamax's kernel is one device's program: left to XLA's
    partitioner it would get every operand whole), and the result and its gradients still equal
    the naive reference's on the whole arrays."""
    from jax.sharding import AxisType

    from k3jax.ops import flash_attention as fa

    traces = _fake_tokamax_attention(monkeypatch)
    B, T, H, D = 4, 8, 2, 4
    kq, kk, kv = jax.random.split(jax.random.key(4), 3)
    q, k, v = (jax.random.normal(key, (B, T, H, D)) for key in (kq, kk, kv))
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 2], [1] * 8, [1, 2, 2, 2, 3, 3, 3, 3], [1] * 7 + [2]])
    scale = D ** -0.5

    def value_and_grads(attend):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v))), argnums=(0, 1, 2)))(
            q, k, v)

    want = value_and_grads(lambda q, k, v: naive_causal_softmax_attention(q, k, v, scale=scale, segment_ids=seg))
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    with jax.set_mesh(mesh):
        got = value_and_grads(lambda q, k, v: fa.flash_causal_attention(q, k, v, scale=scale,
                                                                          doc_start=document_start(seg)))
    assert traces == [(1, T, 1, D)], traces
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
