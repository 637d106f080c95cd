"""benchmarks/ops/attention.py's check on CPU, with the XLA form in the kernel's place (tokamax's
kernel needs a GPU; the checking is the same): the real form passes its limits against the fp32
HIGHEST reference, and the check fails on seeded faults (a softmax scale for the wrong head dim,
a key block skipped at a document's start, q and k swapped). And the FLOP counts of packed rows
(k3jax.flops) against hand counts."""

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.checks.verdict import Verdicts
from benchmarks.ops import attention as att
from k3jax.flops import attention_block_fraction, attention_pair_fraction
from k3jax.ops.softmax_attn import causal_softmax_attention

TINY = dict(B=1, T=128, H=2, D=24, Dv=16, mean_doc=40.0, dtypes=(jnp.bfloat16,))


def xla(q, k, v, **kw):
    return causal_softmax_attention(q, k, v, impl="xla", **kw)


def _check(attention):
    v = Verdicts("attention", out=lambda line: None)
    (row,) = att.check_rows(v, impl="xla", attention=attention, **TINY)
    return row, v


def test_the_real_form_passes():
    row, v = _check(xla)
    assert v.passed, v.failed()
    assert 0 < row["out"] < att.LIMITS["bfloat16"]["out"][0]


def wrong_head_dim_scale(q, k, v, *, scale, segment_ids):
    """1/sqrt(d_v) where 1/sqrt(d_qk) belongs (MLA's 128 for its 192)."""
    return xla(q, k, v, scale=v.shape[-1] ** -0.5, segment_ids=segment_ids)


def skipped_first_keys(q, k, v, *, scale, segment_ids):
    """A kernel that starts every row's first document one 16-key block late."""
    seg = jnp.where(jnp.arange(q.shape[1])[None] < 16, -1, segment_ids)
    return xla(q, k, v, scale=scale, segment_ids=seg)


@pytest.mark.parametrize("fault", [
    wrong_head_dim_scale,
    skipped_first_keys,
    lambda q, k, v, **kw: xla(k, q, v, **kw),
], ids=["wrong scale", "skipped key block", "q and k swapped"])
def test_a_seeded_fault_fails(fault):
    row, v = _check(fault)
    assert not v.passed and not row["pass"]
    assert row["out"] > 3 * att.LIMITS["bfloat16"]["out"][0]


def test_pair_and_block_fractions_against_hand_counts():
    # one row of 8 tokens: documents [0..2], [3..7]; pairs within documents: 6 + 15 of 36 causal
    start = np.array([[0, 0, 0, 3, 3, 3, 3, 3]])
    assert attention_pair_fraction(start) == pytest.approx(21 / 36)
    # blocks 4 x 2: query block 0 (tokens 0-3, earliest start 0) needs key blocks 0-1;
    # query block 1 (tokens 4-7, earliest start 3) key blocks 1-3: 5 of the dense 2 + 4 = 6
    assert attention_block_fraction(start, 4, 2) == pytest.approx(5 / 6)
    # one document: every causal block
    assert attention_block_fraction(np.zeros((2, 8), int), 4, 2) == 1.0


def test_attention_share_of_the_model_flops():
    from pathlib import Path

    from k3jax.config import load_config
    from k3jax.flops import attention_flops_per_token, attention_flops_share, train_flops_per_token

    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "k3-tiny.yaml"),
                      ["model.layer_pattern=kda+mla", "model.attn_res_block_size=2"]).model
    m = cfg.mla
    # one MLA layer: heads x (q/k nope + rope + v) x seq, forward (2 flops a multiply-add over the causal half)
    assert attention_flops_per_token(cfg, 256) == m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim
                                                                  + m.v_head_dim) * 256
    share = attention_flops_share(cfg, 256)
    assert 0 < share < 1 and share == pytest.approx(3 * attention_flops_per_token(cfg, 256)
                                                    / train_flops_per_token(cfg, 256))
    assert attention_flops_share(cfg, 1024) > share  # grows with the row
