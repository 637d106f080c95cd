"""The segment contract (k3jax/segments.py): every mixer run on one packed row equals the same
mixer run on each document alone (a row of its own, no segment ids: only causality keeps the
filler after it out), and ids that break the contract are refused where they enter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference import rel_err

from k3jax import segments
from k3jax.config import AttentionConfig, ConfigError, KDAConfig, MLAConfig, ModelConfig
from k3jax.layers.attention import SoftmaxAttention
from k3jax.layers.conv import ShortConv
from k3jax.layers.kda import DeltaMixer
from k3jax.layers.mla import GatedMLA

D = 24
# documents with ids out of order, one ending exactly at the chunk edge 32, a padding run
# between documents (id 0) and one at the end of the row
DOCS = [(3, 10), (1, 22), (0, 3), (8, 11), (0, 2)]
SEG = np.concatenate([np.full(n, i, np.int32) for i, n in DOCS])[None]  # [1, 48]
T = SEG.shape[1]
CFG = ModelConfig(d_model=D, init_std=0.3, compute_dtype="float32",
                  kda=KDAConfig(num_heads=2, head_dim=8, chunk_size=16),
                  mla=MLAConfig(num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                qk_rope_head_dim=4, v_head_dim=8),
                  attention=AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=8))


def _make(kind):
    rngs = nnx.Rngs(0)
    if kind == "conv":
        return ShortConv(D, 4, rngs=rngs)
    if kind == "mla":
        return GatedMLA(CFG, rngs=rngs)
    if kind == "softmax":
        return SoftmaxAttention(CFG, rngs=rngs)
    return DeltaMixer(CFG, kind, rngs=rngs)


def _run(kind, layer, x, seg, pos):
    if kind == "conv":
        return layer(x, seg)[0]
    return layer(x, segment_ids=seg, positions=pos)[0]


@pytest.mark.parametrize("kind", ["kda", "gated_deltanet", "deltanet", "linear", "mla", "softmax", "conv"])
def test_packed_row_equals_each_document_alone(kind):
    layer = _make(kind)
    graphdef, state = nnx.split(layer)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, T, D), jnp.float32)
    seg = jnp.asarray(SEG)
    # each document alone: its own row, starting at position 0, followed by other tokens
    # (filler), one segment for the whole row
    L = max(n for _, n in DOCS)
    starts = np.cumsum([0] + [n for _, n in DOCS])[:-1]
    rows = jnp.stack([jnp.roll(x[0], -int(s), axis=0)[:L] for s in starts])
    one = jnp.ones((len(DOCS), L), jnp.int32)

    @jax.jit  # one compile for both calls
    def both(st):
        m = nnx.merge(graphdef, st)
        packed = _run(kind, m, x, seg, segments.positions_from_segments(seg))
        alone = _run(kind, m, rows, one, jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (len(DOCS), L)))
        return packed, alone

    packed, alone = both(state)
    for d, ((doc_id, n), s) in enumerate(zip(DOCS, starts)):
        if doc_id == segments.PAD_ID:  # what is computed for padding is not part of the contract
            continue
        got, want = packed[0, s:s + n], alone[d, :n]
        assert rel_err(got, want) < 2e-5, (kind, doc_id, rel_err(got, want))


def test_starts_counter_positions_match_a_loop():
    seg = np.array([[4, 4, 0, 0, 2, 7, 7, 7], [1, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    starts, counter, pos = [], [], []
    for row in seg:
        s = [False] + [bool(row[t] != row[t - 1]) for t in range(1, len(row))]
        starts.append(s)
        counter.append(np.cumsum(s))
        p, run_at = [], 0
        for t in range(len(row)):
            run_at = t if s[t] else run_at
            p.append(t - run_at)
        pos.append(p)
    for xp in (np.asarray, jnp.asarray):  # host pipeline and traced model share one definition
        np.testing.assert_array_equal(segments.segment_starts(xp(seg)), starts)
        np.testing.assert_array_equal(segments.segment_counter(xp(seg)), counter)
        np.testing.assert_array_equal(segments.positions_from_segments(xp(seg)), pos)
    first = np.array([True, False])
    np.testing.assert_array_equal(segments.segment_counter(seg, first)[:, 0], [1, 0])
    np.testing.assert_array_equal(segments.not_padding(seg)[0], [1, 1, 0, 0, 1, 1, 1, 1])


@pytest.mark.parametrize("ids, match", [
    ([[1, 1, 2, 2, 1, 1]], "segment id 1 marks two separate runs"),
    ([[0, 0, 1, 1, 0, 0]], None),  # padding may appear in several runs
    ([[1, 1, -1, 2, 2, 2]], "is negative"),
])
def test_contract_violations_are_named(ids, match):
    seg = np.asarray(ids, np.int32)
    if match is None:
        segments.check_segment_ids(seg, "x")
        return
    with pytest.raises(ConfigError, match=match):
        segments.check_segment_ids(seg, "data")


def test_data_pipeline_and_decode_refuse_broken_ids():
    from k3jax import decode
    from train.data.rows import finish_batch

    bad = np.array([[1, 1, 2, 2, 1, 1, 0]], np.int32)
    packed = {"tokens": bad * 0, "loss_mask": np.ones_like(bad, np.float32), "tokens_segment_ids": bad,
              "tokens_positions": bad * 0}
    with pytest.raises(ConfigError, match="data .*segment id 1 marks two"):
        finish_batch(packed)
    # a cache whose slots hold documents 5 then 6: 5 has ended, so a new token with id 5 would
    # join it in attention but not in the recurrent state (the check runs before the model)
    cache = {"segment_ids": np.array([[5, 5, 6, -1, -1]], np.int32)}
    tok = np.zeros((1,), np.int32)
    with pytest.raises(ConfigError, match="decode_step segment_ids: row 0: segment id 5"):
        decode.decode_step(None, tok, cache, segment_ids=np.array([5]))
    with pytest.raises(ConfigError, match="prefill segment_ids: .* is negative"):
        decode.prefill(None, tok[None], cache, segment_ids=np.array([[-1]]))
    segments.check_segment_ids(np.array([[6, 7]]), "x", previous=cache["segment_ids"])  # continue 6, start 7
