"""Turning packed rows of seq_len + 1 tokens into the model's inputs and next-token targets."""

from __future__ import annotations

import numpy as np

from k3jax.segments import check_segment_ids, not_padding, segment_starts

# What the pipeline yields: name -> dtype; all [rows, seq_len] except the scalar num_tokens.
BATCH_SPEC = {
    "tokens": np.int32,
    "targets": np.int32,
    "segment_ids": np.int32,
    "positions": np.int32,
    "loss_mask": np.float32,
    "num_tokens": np.int32,
}


def finish_batch(packed: dict) -> dict:
    """Packed rows -> a training batch.

    packed: `tokens`, `loss_mask`, `tokens_segment_ids`, `tokens_positions`, each
    [rows, seq_len + 1], as grain's packer emits them (segment id 0 = padding).

    Returns tokens/targets/segment_ids/positions [rows, seq_len] int32, loss_mask
    [rows, seq_len] float32 and num_tokens (int32 scalar, the count of loss_mask > 0).
    Target t is token t + 1; it is trained on only if it belongs to the same document
    piece as token t (never across a boundary, never padding) and the source marked it.
    """
    tokens = packed["tokens"].astype(np.int32, copy=False)
    seg = packed["tokens_segment_ids"].astype(np.int32, copy=False)
    check_segment_ids(seg, "data (packed segment_ids)")  # the segment contract: k3jax/segments.py
    same_doc = ~segment_starts(seg)[:, 1:] & not_padding(seg[:, :-1])
    loss_mask = (same_doc & (packed["loss_mask"][:, 1:] > 0)).astype(np.float32)
    return {
        "tokens": np.ascontiguousarray(tokens[:, :-1]),
        "targets": np.ascontiguousarray(tokens[:, 1:]),
        "segment_ids": np.ascontiguousarray(seg[:, :-1]),
        "positions": np.ascontiguousarray(packed["tokens_positions"][:, :-1].astype(np.int32, copy=False)),
        "loss_mask": loss_mask,
        "num_tokens": np.array(np.count_nonzero(loss_mask), np.int32),
    }
