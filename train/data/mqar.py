"""Multi-query associative recall (Zoology): a synthetic retrieval task generated from (seed, index).

A document is `k1 v1 k2 v2 ... kP vP  q1 a1 ... qQ aQ`: P distinct keys each followed by its
value, then Q of those keys again, each followed by the value it was paired with. Keys come
from [1, V/2) and values from [V/2, V), V = model.vocab_size, so a key is never confused with
a value. loss_mask marks only the answers a_j: the loss and the accuracy measure recall alone.

Two options turn it into the ladder's harder variants (`k3jax-ladder`):

* overwrites R > 0 (MQAR overwrite): R of the P keys are written a second time with a new
  value, somewhere after their first write (the P + R writes come in a random order), and
  the Q queries ask only those R keys: the answer is always the *latest* value, so accuracy
  measures editing a memory, the delta rule's reason to exist. An additive memory (linear
  attention) holds both values and can at best guess between them.
* length L > 0: the example is L tokens. The writes stay at the front and the queries sit at
  random even offsets of the rest, the gaps filled with token 0 (Zoology's layout): the
  same number of pairs at a longer distance, e.g. longer than the model was trained on.

With neither (the defaults) the documents are exactly those of earlier versions.
"""

from __future__ import annotations

import numpy as np

from k3jax.config.errors import ConfigError

# Synthetic, so "length" only bounds the index space; epochs never wrap in practice.
MQAR_LENGTH = 10**8
FILLER = 0  # never a key (keys start at 1) nor a value (values start at V/2)


def latest_values(write_keys, write_values, asked) -> np.ndarray:
    """The value each asked key was paired with last in the write stream (the overwrite
    task's answers; with distinct keys simply the paired value)."""
    table = {}
    for k, v in zip(np.asarray(write_keys).tolist(), np.asarray(write_values).tolist()):
        table[k] = v
    return np.array([table[k] for k in np.asarray(asked).tolist()], np.int32)


def example_tokens(num_pairs: int, num_queries: int, overwrites: int = 0) -> int:
    """Tokens of a compact example (length 0): two per write, two per query."""
    return 2 * (num_pairs + overwrites + num_queries)


class MQARSource:
    """`__getitem__(i)` -> dict(tokens=int32[n], loss_mask=int32[n]), a pure function of (seed, i);
    n = length, or 2 (P + R + Q) when length is 0."""

    def __init__(self, num_pairs: int, num_queries: int, vocab_size: int, seed: int, *,
                 seq_len: int | None = None, where: str = "data.sources.0", length: int = MQAR_LENGTH,
                 overwrites: int = 0, example_length: int = 0):
        half = vocab_size // 2
        if half - 1 < num_pairs:
            raise ConfigError(f"{num_pairs} distinct keys need model.vocab_size >= {2 * num_pairs + 2} "
                              f"(keys come from [1, V/2), values from [V/2, V)); model.vocab_size is {vocab_size}",
                              f"{where}.mqar_pairs")
        if not 0 <= overwrites <= num_pairs:
            raise ConfigError(f"mqar_overwrites={overwrites} must be in [0, mqar_pairs={num_pairs}] "
                              "(each overwritten key is one of the pairs, written twice)", f"{where}.mqar_overwrites")
        if overwrites and vocab_size - half < 2:
            raise ConfigError("overwriting a value needs at least two values: raise model.vocab_size",
                              f"{where}.mqar_overwrites")
        compact = example_tokens(num_pairs, num_queries, overwrites)
        if example_length and example_length < compact:
            raise ConfigError(f"mqar_length={example_length} is shorter than the {compact} tokens its "
                              f"{num_pairs + overwrites} writes and {num_queries} queries take", f"{where}.mqar_length")
        n = example_length or compact
        if seq_len is not None and n > seq_len + 1:
            raise ConfigError(f"an MQAR example of {num_pairs} pairs, {overwrites} overwrites and {num_queries} "
                              f"queries is {n} tokens, longer than data.seq_len + 1 = {seq_len + 1}",
                              f"{where}.mqar_length" if example_length else f"{where}.mqar_pairs")
        self.name = f"{where} (mqar)"
        self.num_pairs, self.num_queries, self.overwrites = num_pairs, num_queries, overwrites
        self.example_length = n
        self.key_range = (1, half)
        self.value_range = (half, vocab_size)
        self.seed, self.length = seed, length
        writes = 2 * (num_pairs + overwrites)
        self._query_slots = (n - writes) // 2  # query slots of 2 tokens after the writes

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        rng = np.random.default_rng((self.seed, int(index)))
        p, q, r = self.num_pairs, self.num_queries, self.overwrites
        keys = self.key_range[0] + rng.choice(self.key_range[1] - self.key_range[0], size=p, replace=False)
        values = rng.integers(*self.value_range, size=p)
        if r:
            write_keys, write_values, asked_keys = self._overwritten(rng, keys, values)
        else:
            asked = rng.choice(p, size=q, replace=q > p)
            write_keys, write_values, asked_keys = keys, values, keys[asked]
        answers = latest_values(write_keys, write_values, asked_keys)
        w = 2 * len(write_keys)
        tokens = np.full(self.example_length, FILLER, np.int32)
        tokens[0:w:2], tokens[1:w:2] = write_keys, write_values
        if self._query_slots == q:  # compact: the queries follow the writes
            starts = w + 2 * np.arange(q)
        else:  # queries at random slots of the gap, in slot order
            starts = w + 2 * np.sort(rng.choice(self._query_slots, size=q, replace=False))
        tokens[starts], tokens[starts + 1] = asked_keys, answers
        mask = np.zeros(self.example_length, np.int32)
        mask[starts + 1] = 1
        return {"tokens": tokens, "loss_mask": mask}

    def _overwritten(self, rng, keys, values):
        """P + R writes in a random order: R keys appear twice, the later write with a new
        value; the queries ask those R keys (each once while Q <= R)."""
        p, q, r = self.num_pairs, self.num_queries, self.overwrites
        edited = rng.choice(p, size=r, replace=False)
        slots = rng.permutation(np.concatenate([np.arange(p), edited]))  # key index per write
        lo, hi = self.value_range
        # a value different from the first: shift by 1..(hi-lo-1) within [lo, hi)
        shifted = lo + (values[edited] - lo + rng.integers(1, hi - lo, size=r)) % (hi - lo)
        new_value = dict(zip(edited.tolist(), shifted.tolist()))
        seen: set[int] = set()
        write_values = np.empty(p + r, np.int64)
        for j, s in enumerate(slots.tolist()):
            write_values[j] = new_value[s] if s in seen else values[s]
            seen.add(s)
        asked = edited[rng.choice(r, size=q, replace=q > r)]
        return keys[slots], write_values, keys[asked]
