"""Multi-query associative recall (Zoology): a synthetic retrieval task generated from (seed, index).

A document is `k1 v1 k2 v2 ... kP vP  q1 a1 ... qQ aQ`: P distinct keys each followed by its
value, then Q of those keys again, each followed by the value it was paired with. Keys come
from [1, V/2) and values from [V/2, V), V = model.vocab_size, so a key is never confused with
a value. loss_mask marks only the answers a_j: the loss and the accuracy measure recall alone.
"""

from __future__ import annotations

import numpy as np

from k3jax.config.errors import ConfigError

# Synthetic, so "length" only bounds the index space; epochs never wrap in practice.
MQAR_LENGTH = 10**8


class MQARSource:
    """`__getitem__(i)` -> dict(tokens=int32[2(P+Q)], loss_mask=int32[2(P+Q)]), a pure function of (seed, i)."""

    def __init__(self, num_pairs: int, num_queries: int, vocab_size: int, seed: int, *,
                 seq_len: int | None = None, where: str = "data.sources.0", length: int = MQAR_LENGTH):
        half = vocab_size // 2
        if half - 1 < num_pairs:
            raise ConfigError(f"{num_pairs} distinct keys need model.vocab_size >= {2 * num_pairs + 2} "
                              f"(keys come from [1, V/2), values from [V/2, V)); model.vocab_size is {vocab_size}",
                              f"{where}.mqar_pairs")
        n = 2 * (num_pairs + num_queries)
        if seq_len is not None and n > seq_len + 1:
            raise ConfigError(f"an MQAR example of {num_pairs} pairs and {num_queries} queries is {n} tokens, "
                              f"longer than data.seq_len + 1 = {seq_len + 1}", f"{where}.mqar_pairs")
        self.name = f"{where} (mqar)"
        self.num_pairs, self.num_queries = num_pairs, num_queries
        self.key_range = (1, half)
        self.value_range = (half, vocab_size)
        self.seed, self.length = seed, length
        self._mask = np.zeros(n, np.int32)
        self._mask[2 * num_pairs + 1::2] = 1

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng((self.seed, int(index)))
        p, q = self.num_pairs, self.num_queries
        keys = self.key_range[0] + rng.choice(self.key_range[1] - self.key_range[0], size=p, replace=False)
        values = rng.integers(*self.value_range, size=p)
        asked = rng.choice(p, size=q, replace=q > p)
        tokens = np.empty(2 * (p + q), np.int32)
        tokens[0:2 * p:2], tokens[1:2 * p:2] = keys, values
        tokens[2 * p::2], tokens[2 * p + 1::2] = keys[asked], values[asked]
        return {"tokens": tokens, "loss_mask": self._mask.copy()}
