"""Packed-document attention: the document-start rule, its agreement with running each
document alone, the kernel selection's errors, and the planning stand-in's memory shape.
(The fused GPU kernel itself is checked against the naive reference in
benchmarks/attention.py, whose output is in BENCHMARKS.md.)"""

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
