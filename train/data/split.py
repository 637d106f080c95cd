"""Document-level bookkeeping: the train/eval split, and cutting documents into row-sized pieces."""

from __future__ import annotations

import grain.experimental as gex
import numpy as np

_M64 = (1 << 64) - 1
# The split never depends on data.seed: every run of a corpus evaluates on the same documents.
_SPLIT_SALT = 0x6B336A6178  # "k3jax"


def mix64(*values: int) -> int:
    """A stable 64-bit hash of integers (splitmix64 rounds); Python's hash() is salted per process."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _M64)) * 0xBF58476D1CE4E5B9 & _M64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _M64
        h ^= h >> 31
    return h


def seed32(*values: int) -> int:
    """A seed in [0, 2**32) for grain's shuffles, derived from integers."""
    return mix64(*values) >> 32


class HeldOut:
    """One split of a finite source: position p -> document index, O(1) memory and time.

    Documents are grouped in consecutive blocks of k = round(1 / eval_fraction) (at least 2,
    at most the number of documents); in each block one document, picked by a hash of the
    block number, is held out for "eval" and the others are "train". The held-out share is
    therefore 1/k (e.g. exactly 1/50 for 0.02), spread evenly over the corpus, and at least
    one document whenever there are two or more and eval_fraction > 0.
    """

    def __init__(self, num_docs: int, eval_fraction: float, split: str):
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.num_docs, self.split = num_docs, split
        self.k = max(2, min(round(1 / eval_fraction), num_docs)) if eval_fraction > 0 and num_docs >= 2 else 0
        if self.k:
            blocks, tail = divmod(num_docs, self.k)
            num_eval = blocks + (tail > self._slot(blocks))
        else:
            num_eval = 0
        self._len = num_eval if split == "eval" else num_docs - num_eval

    def _slot(self, block: int) -> int:
        return mix64(_SPLIT_SALT, block) % self.k

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, position: int) -> int:
        position = int(position)
        if not 0 <= position < self._len:
            raise IndexError(position)
        if not self.k:
            return position
        if self.split == "eval":
            return position * self.k + self._slot(position)
        block, j = divmod(position, self.k - 1)
        slot = self._slot(block)
        held = block * self.k + slot < self.num_docs  # a last, partial block may hold none out
        return block * self.k + j + (held and j >= slot)


class SplitIntoPieces(gex.FlatMapTransform):
    """Cuts a document into pieces of at most `max_len` tokens (max_len = seq_len + 1).

    Consecutive pieces overlap by one token (piece j starts at token j * (max_len - 1)), so
    each (token, next token) pair of the document is a target exactly once and packing never
    has to drop anything. A piece of one token has no target and is skipped, which also
    skips empty documents (just an EOS).
    """

    max_fan_out = 1 << 30  # unused by the iterator form of flat_map; no real bound

    def __init__(self, max_len: int):
        self.max_len = max_len

    def flat_map(self, doc: dict) -> list[dict]:
        n = len(doc["tokens"])
        if n <= self.max_len:
            return [doc] if n >= 2 else []
        step = self.max_len - 1
        return [{k: v[s:s + self.max_len] for k, v in doc.items()} for s in range(0, n - 1, step)]


def piece_tokens(num_tokens: np.ndarray | int, max_len: int) -> np.ndarray:
    """Tokens that reach the packer for documents of `num_tokens` tokens (pieces share a token)."""
    n = np.asarray(num_tokens, np.int64)
    pieces = np.where(n >= 2, -(-(n - 1) // (max_len - 1)), 0)
    return np.where(n >= 2, n + np.maximum(pieces - 1, 0), 0)
