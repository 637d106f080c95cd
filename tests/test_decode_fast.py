"""Decoding's fast paths against the plain ones, on CPU (the Pallas kernels in the interpreter).

- each kernel of k3jax/ops/decode_kernels against a float64 loop written here (the projections'
  gemv with and without its RMSNorm, several weights in one launch);
- the MoE's gathered experts against every expert on every token, weighted densely;
- the whole k3-tiny model: chunked prefill + the on-device decode loop with every kernel
  (model.decode_impl=pallas) against the plain path (xla, one jitted step per token): the same
  greedy tokens, logits within tolerance.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import decode
from k3jax.config import load_config
from k3jax.layers.activations import glu_spec
from k3jax.layers.moe import routed_experts_dense_reference
from k3jax.layers.moe_gather import routed_experts_gathered, use_gathered
from k3jax.model import create_model
from k3jax.ops.decode_kernels import (attnres_norm, gemv, kda_layer, kda_step, mla_decode, mla_layer, mla_prefill,
                                      moe_experts)
from reference import pallas_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _attend_np(scores, values, visible):
    """Softmax over the visible entries of scores [..., S] (float64) applied to values [S, D]."""
    s = np.where(visible, scores, -np.inf)
    if not visible.any():
        return np.zeros(values.shape[-1])
    p = np.exp(s - s.max())
    return (p / p.sum()) @ values


def test_latent_decode_kernel_matches_loop():
    """Three rows: two documents in the cache (the query in the second, starting at lo),
    a row whose query's document is cut short by empty slots, and one that sees nothing;
    several split counts (more splits than blocks too)."""
    L, B, S, H, R, r = 2, 3, 96, 3, 32, 16
    rng = np.random.default_rng(0)
    ql, qr = rng.standard_normal((B, H, R)), rng.standard_normal((B, H, r))
    lat, kr = rng.standard_normal((L, B, S, R)), rng.standard_normal((L, B, S, r))
    seg = np.full((B, S), -1)
    seg[0, :70] = np.where(np.arange(70) < 37, 1, 2)
    seg[1, :50] = 4
    seg[2, :70] = 5
    q_seg, index, layer, scale = np.array([2, 4, 6]), 69, 1, 0.3
    lo = np.array([37, 0, 0])
    want = np.zeros((B, H, R))
    for b in range(B):
        visible = (np.arange(S) <= index) & (seg[b] == q_seg[b])
        for h in range(H):
            s = scale * (lat[layer, b] @ ql[b, h] + kr[layer, b] @ qr[b, h])
            want[b, h] = _attend_np(s, lat[layer, b], visible)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    for splits in (1, 4, 16):
        got = mla_decode.latent_decode_attention(
            f32(ql), f32(qr), f32(lat), f32(kr), jnp.asarray(seg, jnp.int32), jnp.asarray(q_seg, jnp.int32), index,
            layer, scale=scale, lo=jnp.asarray(lo, jnp.int32), splits=splits, block=16, interpret=True)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_expanded_prefill_kernel_matches_loop():
    """A chunk of 20 queries at slots 44-63, the cache's last (two blocks of 16: the padding lies
    past the cache's end), row 0 switching documents inside the chunk, row 1 continuing one
    document from the cache."""
    B, C, S, H, n, r, dv, index, scale = 2, 20, 64, 2, 16, 16, 32, 44, 0.2
    rng = np.random.default_rng(1)
    qn, qr = rng.standard_normal((B, C, H, n)), rng.standard_normal((B, C, H, r))
    kn, v, kr = rng.standard_normal((B, S, H, n)), rng.standard_normal((B, S, H, dv)), rng.standard_normal((B, S, r))
    seg = np.full((B, S), -1)
    seg[0, :index + C] = np.where(np.arange(index + C) < 50, 1, 2)
    seg[1, :index + C] = 3
    q_seg = seg[:, index:index + C]
    want = np.zeros((B, C, H, dv))
    for b in range(B):
        for t in range(C):
            visible = (np.arange(S) <= index + t) & (seg[b] == q_seg[b, t])
            for h in range(H):
                s = scale * (kn[b, :, h] @ qn[b, t, h] + kr[b] @ qr[b, t, h])
                want[b, t, h] = _attend_np(s, v[b, :, h], visible)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    got = mla_prefill.expanded_prefill_attention(
        f32(qn), f32(qr), f32(kn), f32(v), f32(kr), jnp.asarray(seg, jnp.int32), jnp.asarray(q_seg, jnp.int32), index,
        jnp.zeros((B,), jnp.int32), scale=scale, block_q=16, block_k=16, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_kda_step_kernel_matches_loop_and_writes_only_its_layer():
    L, B, H, K, V, layer, scale = 3, 2, 2, 16, 32, 2, 0.25
    rng = np.random.default_rng(2)
    state = rng.standard_normal((L, B, H, K, V))
    q, k = rng.standard_normal((B, H, K)), 0.3 * rng.standard_normal((B, H, K))
    v, g = rng.standard_normal((B, H, V)), -rng.uniform(0, 2, (B, H, K))
    beta, fresh = rng.uniform(size=(B, H)), np.array([False, True])
    want_state, want_o = state.copy(), np.zeros((B, H, V))
    for b in range(B):
        for h in range(H):
            S = np.zeros((K, V)) if fresh[b] else state[layer, b, h].copy()
            S *= np.exp(g[b, h])[:, None]
            u = beta[b, h] * (v[b, h] - S.T @ k[b, h])
            S += np.outer(k[b, h], u)
            want_o[b, h] = S.T @ (scale * q[b, h])
            want_state[layer, b, h] = S
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    o, new = jax.jit(lambda *a: kda_step.kda_decode_step(*a, scale=scale, interpret=True))(
        f32(state), layer, f32(q), f32(k), f32(v), f32(g), f32(beta), jnp.asarray(fresh))
    np.testing.assert_allclose(np.asarray(o), want_o, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new), want_state, atol=1e-5, rtol=1e-5)


def test_gemv_kernel_matches_float64():
    """Three weights of different widths in one launch (the second fp32, as the router's), one
    and three rows, with and without the RMSNorm folded in; a stacked weight; a GLU of two inputs
    and residual adds; the operands in fp32, so the only difference from float64 is the order
    of the fp32 sums."""
    K, eps = 96, 1e-6
    rng = np.random.default_rng(4)
    ws = [rng.standard_normal((K, n)) for n in (48, 16, 64)]
    gamma = rng.uniform(0.5, 1.5, K)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    for M in (1, 3):
        x = rng.standard_normal((M, K)) * 3.0
        for norm in (None, gamma):
            xn = x if norm is None else x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * norm
            got = gemv.fused_gemv(f32(x), [f32(w) for w in ws], dtypes=(jnp.float32,) * 3,
                                  norm=None if norm is None else f32(norm), eps=eps, return_normed=True,
                                  interpret=True)
            for y, w in zip(got[:3], ws):
                np.testing.assert_allclose(np.asarray(y), xn @ w, atol=2e-4, rtol=2e-5)
            np.testing.assert_allclose(np.asarray(got[3]), xn, atol=1e-5, rtol=1e-5)
    stacked = gemv.fused_gemv(f32(x[:1]), [f32(np.stack([ws[2], 2 * ws[2]]))], dtypes=(jnp.float32,), layers=[1],
                              interpret=True)[0]  # a stacked weight, read at its layer
    np.testing.assert_allclose(np.asarray(stacked), 2 * x[:1] @ ws[2], atol=4e-4, rtol=2e-5)
    # a gated MLP's down projection: SiTU-GLU of two inputs first, two residual adds after
    a, b, r1, r2 = (rng.standard_normal((2, n)) for n in (K, K, 64, 64))
    spec = ("situ", 4.0, 25.0)
    hid = 4.0 * np.tanh(a / 4.0) / (1 + np.exp(-a)) * 25.0 * np.tanh(b / 25.0)
    got = gemv.fused_gemv(f32(a), [f32(ws[2])], dtypes=(jnp.float32,), glu=spec, x2=f32(b), addends=[f32(r1), f32(r2)],
                          interpret=True)[0]
    np.testing.assert_allclose(np.asarray(got), hid @ ws[2] + r1 + r2, atol=2e-4, rtol=2e-5)
    assert gemv.unsupported_reason(jnp.zeros((1, K)), [jnp.zeros((K, 12))])  # 12 columns: not a block
    assert gemv.unsupported_reason(jnp.zeros((gemv.MAX_ROWS + 1, K)), [jnp.zeros((K, 16))])


def test_attnres_norm_kernel_matches_float64():
    """Two tokens, three block slots of which two are filled, the site's vectors and the norm's
    gamma stacked over two layers (the kernel reads layer 1): softmax over depth, the mix, the
    RMSNorm, against float64 (fp32 operands)."""
    NB, N, d, n, ea, en = 3, 2, 48, 2, 1e-6, 1e-5
    rng = np.random.default_rng(5)
    blocks, prefix = rng.standard_normal((NB, N, d)), rng.standard_normal((N, d))
    ga, wa, g = rng.uniform(0.5, 1.5, (2, d)), rng.standard_normal((2, d)) * 0.3, rng.uniform(0.5, 1.5, (2, d))
    q = ga[1] * wa[1]
    src = np.concatenate([prefix[None], blocks[:n]])  # [1 + n, N, d]
    logit = (src @ q) / np.sqrt(np.mean(src * src, axis=-1) + ea)
    p = np.exp(logit - logit.max(0))
    mix = np.einsum("sn,snd->nd", p / p.sum(0), src)
    want = mix / np.sqrt(np.mean(mix * mix, axis=-1, keepdims=True) + en) * g[1]
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    got = attnres_norm.attnres_norm(f32(blocks), jnp.int32(n), f32(prefix), (f32(ga), f32(wa)), f32(g), eps_attn=ea,
                                    eps_norm=en, layers=(1, 1, 1), interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_kda_layer_kernel_matches_its_reference():
    """KDA's whole decode step in one kernel against its plain form (fp32: no rounding between
    them): two rows (the second starting a new document: state and windows zeroed), two heads,
    the state, windows and every parameter stacked over two layers, the kernel at layer 1; both
    gate forms. The plain form's pieces are the layer's own (test_fast_decode_matches_plain_decode
    checks the layer end to end)."""
    L, B, H, K, W, R, d = 2, 2, 2, 16, 4, 16, 32
    P = H * K
    rng = np.random.default_rng(6)
    f32 = lambda *shape, s=1.0: jnp.asarray(s * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    proj = {"q": f32(B, P), "k": f32(B, P), "v": f32(B, P), "f_a": f32(B, R), "g": f32(B, P)}
    params = {"conv_q": f32(L, W, P, s=0.5), "conv_k": f32(L, W, P, s=0.5), "conv_v": f32(L, W, P, s=0.5),
              "f_b": f32(L, R, P, s=0.3), "dt_bias": f32(L, P), "A_log": f32(L, H, s=0.3), "b": f32(L, d, H, s=0.3),
              "o_norm": f32(L, K, s=0.2) + 1.0}
    params = {n: (a, 1) for n, a in params.items()}
    x, seg, prev = f32(B, d), jnp.array([3, 4], jnp.int32), jnp.array([3, 1], jnp.int32)  # row 1: a new document
    state, windows = f32(L, B, H, K, K), tuple(f32(L, B, W - 1, P) for _ in range(3))
    for gate in ("lower_bound", "softplus"):
        kw = dict(layer=1, gate=gate, lower_bound=-5.0, eps=1e-5, dtype=jnp.float32)
        got = kda_layer.kda_decode_layer(proj, x, seg, prev, state, windows, params, interpret=True, **kw)
        want = kda_layer.kda_decode_layer_reference(proj, x, seg, prev, state, windows, params, **kw)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


def test_mla_prep_and_finish_kernels_match_their_references():
    """The kernels around MLA's latent attention against their plain forms (fp32): prep (W_UK
    into the query, padded heads, the latent's norm and k^p written into the cache at the
    step's slot, the meta) with W_kvb and gamma stacked over two layers and the cache's layer 1;
    finish (the merge of 32 splits, some empty, W_UV, the gate) with and without the gate."""
    L, B, S, H, R, r, n, v, eps = 2, 2, 64, 3, 32, 16, 16, 16, 1e-6
    ks = jax.random.split(jax.random.PRNGKey(8), 10)
    nrm = lambda i, *shape: jax.random.normal(ks[i], shape, jnp.float32)  # noqa: E731
    q, kv_a, w, gamma = nrm(0, B, H, n + r), nrm(1, B, R + r), 0.3 * nrm(2, L, R, H, n + v), 1 + 0.1 * nrm(3, L, R)
    lat, kr = nrm(4, L, B, S, R), nrm(5, L, B, S, r)
    kw = dict(index=jnp.int32(37), layer=jnp.int32(1), lo=jnp.array([0, 5], jnp.int32),
              q_seg=jnp.array([1, 2], jnp.int32), eps=eps, dtype=jnp.float32, layers=(1, 1))
    got = mla_layer.mla_decode_prep(q, kv_a, w, gamma, lat, kr, interpret=True, **kw)
    want = mla_layer.mla_decode_prep_reference(q, kv_a, w, gamma, lat, kr, **kw)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)
    NS, Hp = 32, 4
    o, m, l = nrm(6, B, NS, Hp, R), nrm(7, B, NS, Hp), jnp.abs(nrm(8, B, NS, Hp))
    l = l.at[:, 5:9].set(0.0)  # splits that saw nothing
    m = jnp.where(l > 0, m, mla_decode.NEG)
    for g in (None, nrm(9, B, H * v)):
        got = mla_layer.mla_decode_finish(o, m, l, w, g, nope=n, dtype=jnp.float32, layer=1, interpret=True)
        want = mla_layer.mla_decode_finish_reference(o, m, l, w, g, nope=n, dtype=jnp.float32, layer=1)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_gathered_experts_match_grouped_dispatch():
    N, k, E, l, Hd = 2, 3, 16, 32, 24
    ks = jax.random.split(jax.random.PRNGKey(3), 6)
    z = jax.random.normal(ks[0], (N, l))
    idx = jax.random.randint(ks[1], (N, k), 0, E)
    idx = idx.at[1, 0].set(idx[0, 0])  # two tokens on one expert
    w = jax.nn.softmax(jax.random.normal(ks[2], (N, k)), -1)
    w1, w3 = 0.2 * jax.random.normal(ks[3], (E, l, Hd)), 0.2 * jax.random.normal(ks[4], (E, l, Hd))
    w2 = 0.2 * jax.random.normal(ks[5], (E, Hd, l))
    cfg = load_config(os.path.join(ROOT, "configs", "k3-tiny.yaml")).model
    glu = glu_spec(cfg)
    got = routed_experts_gathered(z, idx, w, w1, w3, w2, glu)
    want = routed_experts_dense_reference(z, idx, w, w1, w3, w2, glu)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert use_gathered(1, 8, 64) and use_gathered(4, 8, 64) and not use_gathered(5, 8, 64)


def test_moe_experts_kernels_match_dense_reference():
    """Routing (sigmoid scores, top-k of scores + bias, normalised weights) and the routed
    experts in two kernels, against every expert on every token weighted densely
    (routed_experts_dense_reference) with lax.top_k's selection: two tokens, a bias that moves
    the selection, the weights stacked over two layers (the kernels read layer 1), fp32."""
    N, k, E, l, Hd, scaling = 2, 3, 16, 32, 48, 2.5
    ks = jax.random.split(jax.random.PRNGKey(7), 6)
    logits, z = jax.random.normal(ks[0], (N, E)), jax.random.normal(ks[1], (N, l))
    bias = 0.3 * jax.random.normal(ks[2], (E,))
    w1, w3 = 0.2 * jax.random.normal(ks[3], (2, E, l, Hd)), 0.2 * jax.random.normal(ks[4], (2, E, l, Hd))
    w2 = 0.2 * jax.random.normal(ks[5], (2, E, Hd, l))
    cfg = load_config(os.path.join(ROOT, "configs", "k3-tiny.yaml")).model
    glu = glu_spec(cfg)
    got = moe_experts.routed_experts_decode(logits, jnp.stack([bias, -bias]), z, w1, w3, w2, top_k=k, scaling=scaling,
                                            glu=glu, dtype=jnp.float32, layers=(1, 1, 1, 0), interpret=True)
    scores = jax.nn.sigmoid(logits)
    _, idx = jax.lax.top_k(scores + bias, k)
    picked = jnp.take_along_axis(scores, idx, -1)
    want = routed_experts_dense_reference(z, idx, picked / picked.sum(-1, keepdims=True) * scaling, w1[1], w3[1],
                                          w2[1], glu)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


# k3-tiny's structure at six layers (KDA with the dense FFN, MLA with the MoE, then twice KDA and MLA
# with the MoE: a stage of two repeats, whose parameters the decode kernels read in place from their
# stacked arrays; AttnRes): every kernel at each kind of call site, few compiles
SMALL = ["model.layer_pattern=3*(kda,mla)", "model.attn_res_block_size=2", "model.d_model=64", "model.vocab_size=128",
         "model.kda.num_heads=2", "model.kda.head_dim=16", "model.mla.num_heads=2", "model.mla.q_lora_rank=32",
         "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16", "model.mla.v_head_dim=16",
         "model.moe.num_experts=16", "model.moe.top_k=2", "model.moe.expert_hidden=32", "model.moe.latent_dim=32"]


@pytest.fixture(scope="module")
def tiny_pair():
    """One small model twice with the same weights: decode kernels (interpreted) and plain XLA."""
    path = os.path.join(ROOT, "configs", "k3-tiny.yaml")
    cfg = load_config(path, SMALL + ["model.decode_impl=xla"]).model
    fast = create_model(load_config(path, SMALL + ["model.decode_impl=pallas"]).model, seed=0)
    plain = create_model(cfg, seed=0)
    bias = 0.1 * jax.random.normal(jax.random.PRNGKey(1), fast.router_bias[...].shape)
    fast.router_bias[...] = bias
    plain.router_bias[...] = bias
    return cfg, fast, plain


def _run(model, prompt, seg, chunks, steps, on_device: bool, max_len: int):
    """Chunked prefill, then `steps` greedy steps: (prefill logits of the last token, step logits
    [steps,B,V], tokens [steps,B])."""
    graphdef, state = nnx.split(model)
    pre = jax.jit(lambda s, t, c, g: decode.prefill(nnx.merge(graphdef, s), t, c, segment_ids=g, last_only=True))
    cache = decode.init_cache(model, prompt.shape[0], max_len)
    start = 0
    for size in chunks:
        logits, cache = pre(state, prompt[:, start:start + size], cache, seg[:, start:start + size])
        start += size
    first = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    if on_device:
        loop = jax.jit(lambda s, t, c: decode.decode_loop(nnx.merge(graphdef, s), t, c, steps=steps,
                                                          return_logits=True))
        tokens, _, step_logits = loop(state, first, cache)
        return logits[:, -1], step_logits, tokens
    step = jax.jit(lambda s, t, c: decode.decode_step(nnx.merge(graphdef, s), t, c))
    token, outs, toks = first, [], []
    for _ in range(steps):
        lg, cache = step(state, token, cache)
        token = jnp.argmax(lg, -1).astype(jnp.int32)
        outs.append(lg)
        toks.append(token)
    return logits[:, -1], jnp.stack(outs), jnp.stack(toks)


def test_fast_decode_matches_plain_decode(tiny_pair):
    """Row 0 packs two documents (the second starts inside the second prefill chunk), row 1
    holds one; prefill in two chunks of 40 tokens, then 6 greedy steps. The cache has 320 slots,
    so the chunks expand different prefixes of it (64 slots, then all 320: `prefix_sizes`)."""
    cfg, fast, plain = tiny_pair
    B, T, steps = 2, 80, 6
    prompt = jax.random.randint(jax.random.PRNGKey(0), (B, T), 0, cfg.vocab_size)
    seg = jnp.array([[1] * 50 + [2] * 30, [1] * T], jnp.int32)
    f_pre, f_steps, f_tok = _run(fast, prompt, seg, (40, 40), steps, on_device=True, max_len=300)
    p_pre, p_steps, p_tok = _run(plain, prompt, seg, (40, 40), steps, on_device=False, max_len=300)
    np.testing.assert_array_equal(np.asarray(f_tok), np.asarray(p_tok))
    scale = float(jnp.abs(p_steps).max())
    assert float(jnp.abs(f_pre - p_pre).max()) < 1e-4 * scale
    assert float(jnp.abs(f_steps - p_steps).max()) < 1e-4 * scale


def test_fast_decode_step_takes_every_kernel(tiny_pair):
    """The fast model's decode step runs its projections through the gemv kernel, not a silent
    XLA fallback. Traced once per layer body: the first stage (KDA with the dense FFN, MLA with
    the MoE) and the repeated one's body (KDA and MLA, both with the MoE). Per KDA: q, k, v, gate
    and f_a in one launch, o_proj, and the rest of the layer in `kda_decode_layer`; dense FFN:
    gate and up in one, down; MLA: q_a, kv_a and gate in one, q_b (its norm folded in), o_proj;
    MoE: router, latent down projection and shared gate and up in one, the latent up projection
    (its norm folded in), the shared down projection; the head: 2 + 2 + 3 + 3 + (2 + 3 + 3 + 3)
    + 1 = 22. Each AttnRes site with its norm: 2 per layer and the output's, 9. MLA's latent
    attention between its prep and finish kernels; the MoE's routed experts in two kernels."""
    _, fast, _ = tiny_pair
    graphdef, state = nnx.split(fast)
    cache = decode.init_cache(fast, 2, 64)
    step = lambda s, t, c: decode.decode_step(nnx.merge(graphdef, s), t, c)  # noqa: E731
    names = pallas_kernels(jax.make_jaxpr(step)(state, jnp.zeros((2,), jnp.int32), cache))
    assert names == {"decode_gemv": 22, "attnres_norm": 9, "kda_decode_layer": 2, "mla_decode_prep": 2,
                     "mla_latent_decode": 2, "mla_decode_finish": 2, "moe_experts_up": 3, "moe_experts_down": 3}, names


def test_fused_step_stops_past_its_batch_limit(tiny_pair):
    """model.decode_fused_max_batch: a batch of 2 with the limit at 1 takes the plain step (only
    the two kernels of decode_fused=false: MLA's latent attention and KDA's recurrent step), and
    its logits equal the XLA model's within the fast-vs-plain tolerance. (The fused step equals
    the XLA model in test_fast_decode_matches_plain_decode; compiling it here again, with every
    kernel interpreted, cost most of this test's 38 s.)"""
    _, fast, xla_model = tiny_pair
    graphdef, state = nnx.split(fast)
    capped = dataclasses.replace(fast.cfg, decode_fused_max_batch=1)
    cache = decode.init_cache(fast, 2, 64)
    token = jnp.array([3, 5], jnp.int32)

    def step(cfg):
        def f(s, t, c):
            model = nnx.merge(graphdef, s)
            model.cfg = cfg
            return decode.decode_step(model, t, c)
        return f

    names = pallas_kernels(jax.make_jaxpr(step(capped))(state, token, cache))
    assert set(names) == {"mla_latent_decode", "kda_decode_step"}, names
    xla_graphdef, xla_state = nnx.split(xla_model)
    full, _ = jax.jit(lambda s, t, c: decode.decode_step(nnx.merge(xla_graphdef, s), t, c))(xla_state, token, cache)
    plain, _ = jax.jit(step(capped))(state, token, cache)
    scale = float(jnp.abs(full).max())
    assert float(jnp.abs(full - plain).max()) < 1e-4 * scale
