"""Block AttnRes: the operator by hand on three sources, and the model's block bookkeeping
against the K3 release's per-layer loop run with plain Python lists."""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.config import load_config
from k3jax.layers.attnres import AttnResSite, attn_res_mix, attn_res_mix_reference
from k3jax.model import create_model
from reference import rel_err

TINY = Path(__file__).resolve().parents[1] / "configs" / "k3-tiny.yaml"


def mix_by_hand(sources, gamma, w, eps=1e-5):
    """The AttnRes operator, one token at a time, float64: softmax over sources of
    <rmsnorm(source), gamma * w>, mixing the raw sources."""
    S = np.stack([np.asarray(s, np.float64) for s in sources])  # [N, B, T, d]
    out = np.zeros(S.shape[1:])
    for b in range(S.shape[1]):
        for t in range(S.shape[2]):
            logits = []
            for i in range(S.shape[0]):
                v = S[i, b, t]
                khat = v / np.sqrt(np.mean(v * v) + eps)
                logits.append(np.sum(khat * gamma * w))
            a = np.exp(np.array(logits) - max(logits))
            a /= a.sum()
            out[b, t] = sum(a[i] * S[i, b, t] for i in range(S.shape[0]))
    return out


def test_three_sources_by_hand():
    rng = np.random.default_rng(0)
    b0, b1, p = (rng.standard_normal((2, 3, 8)) * s for s in (1.0, 3.0, 0.5))
    gamma, w = rng.standard_normal(8), rng.standard_normal(8)
    blocks = jnp.asarray(np.stack([b0, b1, np.full_like(b0, 99.0)]), jnp.float32)  # slot 2 unused
    got = attn_res_mix(blocks, jnp.int32(2), jnp.asarray(p, jnp.float32), jnp.asarray(gamma * w), 1e-5)
    assert rel_err(got, mix_by_hand([b0, b1, p], gamma, w)) < 1e-6
    site = AttnResSite(8, eps=1e-5)
    site.norm["weight"][...] = jnp.asarray(gamma, jnp.float32)
    site.proj["kernel"][...] = jnp.asarray(w[:, None], jnp.float32)
    assert rel_err(site(blocks, jnp.int32(2), jnp.asarray(p, jnp.float32)), mix_by_hand([b0, b1, p], gamma, w)) < 1e-6
    # zero pseudo-query (the init): a uniform average of the sources
    zero = AttnResSite(8, eps=1e-5)
    np.testing.assert_allclose(zero(blocks, jnp.int32(2), jnp.asarray(p, jnp.float32)), (b0 + b1 + p) / 3, atol=1e-6)
    # no blocks yet: the prefix itself, exactly
    np.testing.assert_array_equal(site(blocks, jnp.int32(0), jnp.asarray(p, jnp.float32)), jnp.asarray(p, jnp.float32))


def _site_float64(blocks, n, prefix, query, cot, eps=1e-5):
    """The site's loss sum(out * cot) and its gradients (blocks, prefix, query), float64 jax
    autodiff of the operator written out here: concatenated sources, an explicit RMS norm, a
    masked softmax (shares no code with k3jax)."""
    with jax.enable_x64(True):
        def loss(b, p, q):
            S = jnp.concatenate([b, p[None]], 0)
            k = S / jnp.sqrt(jnp.mean(S * S, -1, keepdims=True) + eps)
            valid = (jnp.arange(S.shape[0]) < n) | (jnp.arange(S.shape[0]) == S.shape[0] - 1)
            a = jax.nn.softmax(jnp.where(valid[:, None, None], jnp.sum(k * q, -1), -jnp.inf), axis=0)
            return jnp.sum(jnp.sum(a[..., None] * S, 0) * jnp.asarray(cot, jnp.float64))

        args = tuple(jnp.asarray(np.asarray(x, np.float64)) for x in (blocks, prefix, query))
        v, g = jax.value_and_grad(loss, argnums=(0, 1, 2))(*args)
        return float(v), [np.asarray(x) for x in g]


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


def test_site_forms_against_float64_with_gradients_and_pass_through():
    """k3jax.ops.attnres_mix.attn_res_site, both forms (XLA; the Pallas kernels in the
    interpreter), against float64 autodiff of the operator: the output, the gradients of the
    sources and the query, with 0, 3 and 4 of 4 slots valid. The block buffer passes through:
    the cotangent given to the passed-through buffer comes back plus the site's share, and the
    slots >= n come back untouched, bit for bit (the kernel neither reads nor writes them).
    fp32 sources for the kernels, fp32 and bf16 for XLA (bf16 against float64 of the
    bf16-rounded inputs). d = 128: one kernel chunk; 10 tokens pad to one 32-token program."""
    from k3jax.ops.attnres_mix import attn_res_site

    rng = np.random.default_rng(7)
    d = 128
    blocks = rng.standard_normal((4, 2, 5, d)) * np.array([1.0, 3.0, 0.5, 2.0])[:, None, None, None]
    prefix, query = rng.standard_normal((2, 5, d)), 0.3 * rng.standard_normal(d)
    cot, cot_blocks = rng.standard_normal((2, 5, d)), rng.standard_normal(blocks.shape)
    for impl, dtype, tol in (("xla", jnp.float32, 2e-5), ("xla", jnp.bfloat16, 2e-2),
                             ("interpret", jnp.float32, 2e-5)):
        b, p = jnp.asarray(blocks, dtype), jnp.asarray(prefix, dtype)
        q, cb = jnp.asarray(query, jnp.float32), jnp.asarray(cot_blocks, dtype)
        for n in (0, 3, 4):
            want_v, (want_b, want_p, want_q) = _site_float64(b.astype(jnp.float32), n, p.astype(jnp.float32), q, cot)

            def f(b, p, q):
                out, passed = attn_res_site(b, jnp.int32(n), p, q, 1e-5, impl)
                return jnp.sum(out.astype(jnp.float32) * jnp.asarray(cot, jnp.float32)), passed

            (v, passed), vjp = jax.vjp(f, b, p, q)
            assert passed is b or np.array_equal(np.asarray(passed), np.asarray(b))
            gb, gp, gq = vjp((jnp.float32(1.0), cb))
            assert gb.dtype == dtype and gp.dtype == dtype and gq.dtype == jnp.float32
            assert abs(float(v) - want_v) <= tol * abs(want_v), (impl, dtype, n)
            share = np.asarray(gb, np.float64) - np.asarray(cb, np.float64)
            slack = 0 if dtype == jnp.float32 else 8e-3 * np.abs(np.asarray(cb, np.float64)).max()
            assert np.abs(share - want_b).max() <= tol * max(np.abs(want_b).max(), 1.0) + slack, (impl, dtype, n)
            np.testing.assert_array_equal(np.asarray(gb)[n:], np.asarray(cb)[n:])  # untouched slots
            for got, want in ((gp, want_p), (gq, want_q)):
                assert np.abs(np.asarray(got, np.float64) - want).max() <= tol * max(np.abs(want).max(), 1.0), \
                    (impl, dtype, n, _rel(got, want))
        # no blocks yet: the prefix itself, exactly
        out, _ = attn_res_site(b, jnp.int32(0), p, q, 1e-5, impl)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(p))


def test_fused_form_against_plain_form_with_gradients():
    """attn_res_mix (reductions and an unrolled sum, one read of each block) against the plain
    einsum form it replaces, outputs and gradients (blocks, prefix, query), fp32 and bf16
    sources; 3 of 4 slots valid."""
    rng = np.random.default_rng(1)
    blocks = rng.standard_normal((4, 2, 5, 16)) * np.array([1.0, 3.0, 0.5, 2.0])[:, None, None, None]
    prefix, query = rng.standard_normal((2, 5, 16)), rng.standard_normal(16)
    cot = rng.standard_normal((2, 5, 16))
    # fp32: the two forms sum in different orders; measured 4.1e-6 on an AVX-512 XLA:CPU, ~1e-6 elsewhere
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
        args = (jnp.asarray(blocks, dtype), jnp.asarray(prefix, dtype), jnp.asarray(query, jnp.float32))

        def loss(fn, b, p, q):
            return jnp.sum(fn(b, jnp.int32(3), p, q, 1e-5).astype(jnp.float32) * cot)

        for fn in (attn_res_mix, attn_res_mix_reference):
            assert fn(args[0], jnp.int32(3), args[1], args[2], 1e-5).dtype == dtype
        got = jax.value_and_grad(lambda *a: loss(attn_res_mix, *a), argnums=(0, 1, 2))(*args)
        want = jax.value_and_grad(lambda *a: loss(attn_res_mix_reference, *a), argnums=(0, 1, 2))(*args)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert rel_err(g, w) < tol, (dtype, rel_err(g, w))
        assert np.all(np.asarray(got[1][0][3], np.float32) == 0)  # the unused slot gets no gradient


def _site_params(site):
    return np.asarray(site.norm["weight"][...], np.float64), np.asarray(site.proj["kernel"][...][:, 0], np.float64)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, *args, **kwargs):
    """A module's call, jitted: the same computation as calling it eagerly, one compile per
    kind of module instead of thousands of op-by-op dispatches (the eager form took ~40 s of CI)."""
    return nnx.merge(graphdef, state)(*args, **kwargs)


def _call(module, *args, **kwargs):
    return _apply(nnx.graphdef(module), nnx.state(module), *args, **kwargs)


def test_model_bookkeeping_matches_pseudocode():
    """5 layers, block size 2: blocks close at layers 0, 2, 4; the output site mixes
    [embedding, layers 0-1, layers 2-3] + prefix(layer 4), a block left open. The model and each
    sub-module of the per-layer loop run jitted (`_call`); the block bookkeeping and every
    AttnRes mix of the loop are float64 NumPy (`mix_by_hand`). (10 layers in blocks of 4 made
    the same bookkeeping, the unrolled model's compile twice as long.)"""
    cfg = load_config(TINY, ["model.layer_pattern=(kda,kda,kda,mla) + kda", "model.attn_res_block_size=2",
                             "model.d_model=64", "model.scan_layers=false"]).model
    assert cfg.num_layers == 5 and cfg.ffn_kind(0) == "dense" and cfg.ffn_kind(4) == "moe"
    model = create_model(cfg, seed=1)
    rng = np.random.default_rng(3)
    # non-zero pseudo-queries everywhere, so a wrong source set changes the output
    for st in model.stages:
        for layer in st.units.layers:
            for site in (layer.self_attention_res, layer.mlp_res):
                site.proj["kernel"][...] = jnp.asarray(rng.standard_normal(site.proj["kernel"][...].shape), jnp.float32)
    model.output_attn_res.proj["kernel"][...] = jnp.asarray(rng.standard_normal((64, 1)), jnp.float32)
    model.router_bias[...] = jnp.asarray(rng.standard_normal(model.router_bias[...].shape) * 0.1, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)))
    seg = jnp.zeros((2, 12), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    logits, _ = _call(model, tokens)

    # the per-layer loop with Python lists, calling each layer's sub-modules directly
    # unscanned: one stage whose single repetition holds every layer (a leading [1] axis)
    assert [(st.start, st.repeat) for st in model.plan] == [(0, 1)]
    units = model.stages[0].units
    layers = nnx.state(units)["layers"]
    states = [jax.tree.map(lambda a: a[0], layers[ell]) for ell in range(cfg.num_layers)]
    moe_row = 0
    prefix = model.embed_tokens[...][tokens]
    blocks = []
    for ell in range(cfg.num_layers):
        layer = nnx.merge(nnx.graphdef(units.layers[ell]), states[ell])
        h = mix_by_hand(blocks + [prefix], *_site_params(layer.self_attention_res)) if blocks else prefix
        if ell % cfg.attn_res_block_size == 0:
            blocks.append(prefix)
            prefix = None
        a, _ = _call(layer.self_attn, _call(layer.input_layernorm, jnp.asarray(h, jnp.float32)), segment_ids=seg,
                     positions=pos)
        prefix = a if prefix is None else prefix + a
        h = mix_by_hand(blocks + [prefix], *_site_params(layer.mlp_res))
        x = _call(layer.post_attention_layernorm, jnp.asarray(h, jnp.float32))
        if cfg.ffn_kind(ell) == "moe":
            f, _ = _call(layer.block_sparse_moe, x, model.router_bias[...][moe_row])
            moe_row += 1
        else:
            f = _call(layer.mlp, x)
        prefix = prefix + f
    assert len(blocks) == 3
    h = mix_by_hand(blocks + [prefix], *_site_params(model.output_attn_res))
    ref = model.lm_head(_call(model.norm, jnp.asarray(h, jnp.float32)), out_dtype=jnp.float32)  # a dtype: eager
    assert rel_err(logits, ref) < 2e-4  # fp32 model vs a float64 mix over 5 layers


def test_impl_setting_is_checked_and_reported():
    """model.attn_res_impl: the start-of-run line names the path; the kernels asked for where the
    width does not fit are refused naming the key (k3-tiny's d_model 128 fits, 96 does not)."""
    import pytest

    from k3jax.config import ConfigError
    from k3jax.kernel_paths import kernel_lines
    from k3jax.ops.attnres_mix import resolve_impl

    lines = kernel_lines(load_config(TINY, []).model)
    assert "AttnRes depth mix: xla" in lines  # on the CPU
    assert "AttnRes depth mix: kernel (Pallas interpreter: no GPU)" in kernel_lines(
        load_config(TINY, ["model.attn_res_impl=kernel"]).model)
    with pytest.raises(ConfigError, match="not a multiple of 128"):
        kernel_lines(load_config(TINY, ["model.attn_res_impl=kernel", "model.d_model=96"]).model)
    b, p = jnp.zeros((2, 1, 4, 96)), jnp.zeros((1, 4, 96))
    assert resolve_impl("auto", b, p) == "xla" and resolve_impl("xla", b, p) == "xla"
    with pytest.raises(ValueError, match="model.attn_res_impl=kernel"):
        resolve_impl("kernel", b, p)
