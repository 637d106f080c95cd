"""Topology-independent input: the global batch from `data.num_shards` reader shards.

Shard s of S is a `DataPipeline` over its own slice of the documents (host slicing with
process_index=s, process_count=S) yielding batch_size / S rows. A host reads the shards
s = process_index, process_index + P, ... So the set of rows in every global batch depends
only on S, never on how many hosts read them: a run checkpointed on 2 hosts resumes on 1 (or 8)
with the same data. The row order inside a batch may differ, which the loss does not see.
"""

from __future__ import annotations

import json

import jax
import numpy as np

from k3jax.config.errors import ConfigError
from train.data.pipeline import build_pipeline


class ShardedData:
    def __init__(self, cfg, *, split: str, process_index: int = 0, process_count: int = 1):
        S = cfg.data.num_shards or process_count
        if S % process_count:
            raise ConfigError(f"data.num_shards={S} is not a multiple of the {process_count} processes",
                              "data.num_shards")
        if cfg.train.batch_size % S:
            raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not divisible by data.num_shards={S}",
                              "train.batch_size")
        self.num_shards = S
        self.shards = {s: build_pipeline(cfg, split=split, process_index=s, process_count=S,
                                         rows=cfg.train.batch_size // S)
                       for s in range(process_index, S, process_count)}
        self.tokenizer = next(iter(self.shards.values())).tokenizer

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(p) for p in self.shards.values()]
        return {k: (np.concatenate([p[k] for p in parts]) if parts[0][k].ndim else sum(p[k] for p in parts))
                for k in parts[0]}

    def get_state(self) -> dict:
        """This host's shards' states, gathered from every host (the checkpoint holds them all)."""
        local = {str(s): p.get_state() for s, p in self.shards.items()}
        return {"num_shards": self.num_shards, "shards": _gather_json(local)}

    def set_state(self, state: dict) -> None:
        if state.get("num_shards") != self.num_shards:
            raise ConfigError(f"the checkpoint's data was read in {state.get('num_shards')} shards, this run uses "
                              f"{self.num_shards}; set data.num_shards={state.get('num_shards')} to resume it",
                              "data.num_shards")
        for s, p in self.shards.items():
            p.set_state(state["shards"][str(s)])

    @property
    def pieces_per_pass(self) -> float:
        """Pieces (at most one row each) in one pass over this host's documents (an estimate)."""
        return sum(p.pieces_per_pass for p in self.shards.values())

    @property
    def documents(self) -> int:
        """Documents of this split in the finite sources, all hosts."""
        first = next(iter(self.shards.values()))
        return sum(s.documents for s in first.sources if s.finite)

    def describe(self) -> str:
        """What the run reads: the sources of this host's first reader shard."""
        first = next(iter(self.shards.values()))
        return f"{first.describe()} (shard {next(iter(self.shards))} of {self.num_shards})"

    def close(self) -> None:
        for p in self.shards.values():
            p.close()


def _gather_json(local: dict) -> dict:
    """Merge a JSON-able dict from every process (identity on one process)."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(local).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([raw.size], np.int32))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:raw.size] = raw
    every = multihost_utils.process_allgather(padded)
    merged: dict = {}
    for row, n in zip(np.asarray(every).reshape(len(sizes), -1), np.asarray(sizes).reshape(-1)):
        merged.update(json.loads(row[:n].tobytes().decode()))
    return merged
