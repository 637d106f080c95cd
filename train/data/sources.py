"""Random-access document sources and the factory that builds one from `data.sources.i`.

Every source has `name`, `__len__` and `__getitem__(i) -> dict(tokens=np.int32[n],
loss_mask=np.int32[n])`, a pure function of i (any thread, any process, any order).
loss_mask marks the tokens worth predicting (all of them for text).
"""

from __future__ import annotations

from k3jax.config.schema import Config
from train.data.mqar import MQARSource
from train.data.shards import ArrayRecordSource
from train.data.split import mix64
from train.data.text import StdlibSource, TextSource
from train.data.tokenizers import Tokenizer

# MQAR's eval examples come from a seed of their own, fixed across data.seed, so every run
# evaluates recall on the same examples and never on its training ones.
_MQAR_TRAIN_SALT, _MQAR_EVAL_SALT = 0x74726E, 0x65766C


def build_source(cfg: Config, index: int, split: str, tokenizer: Tokenizer):
    """The source `cfg.data.sources[index]`; only MQAR depends on the split (its seed)."""
    s = cfg.data.sources[index]
    where = f"data.sources.{index}"
    if s.type == "mqar":
        seed = mix64(_MQAR_TRAIN_SALT, cfg.data.seed, index) if split == "train" else mix64(_MQAR_EVAL_SALT, index)
        return MQARSource(s.mqar_pairs, s.mqar_queries, cfg.model.vocab_size, seed,
                          seq_len=cfg.data.seq_len, where=where, overwrites=s.mqar_overwrites,
                          example_length=s.mqar_length)
    if s.type == "text":
        return TextSource(s.paths, tokenizer, text_key=s.text_key, where=where)
    if s.type == "stdlib":
        return StdlibSource(tokenizer, where=where)
    if s.type == "arrayrecord":
        return ArrayRecordSource(s.paths, tokenizer, where=where)
    raise ValueError(f"unknown source type {s.type!r}")  # schema's Literal makes this unreachable


__all__ = ["ArrayRecordSource", "MQARSource", "StdlibSource", "TextSource", "build_source"]
