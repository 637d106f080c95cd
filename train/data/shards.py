"""Pre-tokenized ArrayRecord shards (written by `k3jax-data`) and their JSON sidecar.

A record is one document: `np.int32[n].tobytes()`, EOS included. The sidecar
(`k3jax-data.json`, next to the shards) records the tokenizer and vocabulary the ids belong
to, so a run whose tokenizer differs is stopped before it trains on meaningless ids.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import grain
import numpy as np

from k3jax.config.errors import ConfigError
from train.data.files import expand_paths
from train.data.tokenizers import Tokenizer

SIDECAR = "k3jax-data.json"
FORMAT = "k3jax-tokens-v1"
SUFFIX = ".array_record"
# one record per chunk, so reading one document never decodes its neighbours
WRITER_OPTIONS = "group_size:1"


def shard_name(index: int, count: int) -> str:
    return f"tokens-{index:05d}-of-{count:05d}{SUFFIX}"


def write_sidecar(directory: str, tokenizer: Tokenizer, shards: dict[str, int], tokens: int) -> str:
    meta = {
        "format": FORMAT,
        "tokenizer": tokenizer.spec,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": "int32",
        "documents": sum(shards.values()),
        "tokens": tokens,
        "shards": shards,  # file name -> number of records
    }
    path = os.path.join(directory, SIDECAR)
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
    return path


def read_sidecar(shard: str, where: str) -> dict:
    path = os.path.join(os.path.dirname(shard) or ".", SIDECAR)
    if not os.path.isfile(path):
        raise ConfigError(f"{shard} has no {SIDECAR} next to it; write shards with k3jax-data", where)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}", where) from None
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a {FORMAT} sidecar (format={meta.get('format')!r})", where)
    if os.path.basename(shard) not in meta.get("shards", {}):
        raise ConfigError(f"{shard} is not listed in {path}: it was written by another k3jax-data run", where)
    return meta


class ArrayRecordSource:
    """Pre-tokenized documents; `__getitem__(i)` -> dict(tokens=int32[n], loss_mask=int32[n]).

    Every shard's sidecar must name the same vocabulary as `tokenizer` (same fingerprint and
    vocab_size): ids written with another tokenizer would silently mean other text.
    """

    def __init__(self, paths: Sequence[str], tokenizer: Tokenizer, *, where: str = "data.sources.0"):
        self.name = f"{where} (arrayrecord)"
        self.files = expand_paths(paths, f"{where}.paths", (SUFFIX,))
        for shard in self.files:
            meta = read_sidecar(shard, f"{where}.paths")
            if (meta.get("tokenizer_fingerprint"), meta.get("vocab_size")) != (tokenizer.fingerprint,
                                                                            tokenizer.vocab_size):
                raise ConfigError(
                    f"{shard} was written with tokenizer {meta.get('tokenizer')!r} (vocab_size "
                    f"{meta.get('vocab_size')}) but data.tokenizer is {tokenizer.spec!r} (vocab_size "
                    f"{tokenizer.vocab_size}); re-run k3jax-data with this tokenizer or change data.tokenizer",
                    "data.tokenizer")
        self._records = grain.sources.ArrayRecordDataSource(self.files)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict:
        tokens = np.frombuffer(self._records[int(index)], np.int32)
        return {"tokens": tokens, "loss_mask": np.ones_like(tokens)}
