"""Tokenizers behind one small interface, loaded from local files only (never the network).

`data.tokenizer` is "bytes" (UTF-8 bytes + EOS, the default), a HuggingFace `tokenizer.json`
(package `tokenizers`) or a sentencepiece `.model` (package `sentencepiece`); both packages
are optional: k3jax's `[text]` extra (`pip install -e '.[text]'` in its checkout) brings them.
"""

from __future__ import annotations

import hashlib
import os
from typing import Sequence

import numpy as np

from k3jax.config.errors import ConfigError

# Names an end-of-document token goes by in common vocabularies, most specific first.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
# The name of an EOS id that a vocabulary lacks (the extra id) and of the byte tokenizer's EOS
# where a name is needed: an exported checkpoint's tokenizer files (train/interchange/tokenizer_files.py).
EXTRA_EOS = _EOS_NAMES[0]


class Tokenizer:
    """text <-> ids. `eos_id` ends every document; ids lie in [0, vocab_size)."""

    spec: str  # what `load_tokenizer` was given; stored next to prepared shards
    vocab_size: int
    eos_id: int
    eos_token: str  # the EOS's name: the vocabulary's token at eos_id, else EXTRA_EOS
    eos_is_extra: bool = False  # eos_id is one past the vocabulary file's ids (the file has no EOS)
    unk_token: str | None = None  # the vocabulary's unknown-token name, where it has one

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_document(self, text: str) -> np.ndarray:
        """A document's ids followed by EOS, int32 [n + 1]."""
        ids = self.encode(text)
        out = np.empty(len(ids) + 1, np.int32)
        out[:-1] = ids
        out[-1] = self.eos_id
        return out

    @property
    def fingerprint(self) -> str:
        """Identifies the vocabulary (not the path), so moved files still match."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class ByteTokenizer(Tokenizer):
    """ids 0..255 are UTF-8 bytes, 256 is EOS: vocab_size 257, no files, no unknown tokens."""

    spec = "bytes"
    vocab_size = 257
    eos_id = 256
    eos_token = EXTRA_EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def encode_document(self, text: str) -> np.ndarray:
        # the hot path for the default corpus: one C-level copy instead of a Python list
        raw = np.frombuffer(text.encode("utf-8"), np.uint8)
        out = np.empty(raw.size + 1, np.int32)
        out[:-1] = raw
        out[-1] = self.eos_id
        return out

    @property
    def fingerprint(self) -> str:
        return "bytes"


class _FileTokenizer(Tokenizer):
    """Shared by file-backed tokenizers: a vocabulary without an EOS token gets one extra id."""

    def __init__(self, spec: str, base_vocab: int, eos_id: int | None):
        self.spec = spec
        self._base_vocab = base_vocab
        self.eos_id = base_vocab if eos_id is None else eos_id
        self.vocab_size = base_vocab + (eos_id is None)
        self.eos_is_extra = eos_id is None
        with open(spec, "rb") as f:
            self._sha = hashlib.sha256(f.read()).hexdigest()

    @property
    def fingerprint(self) -> str:
        return f"sha256:{self._sha}"

    def _known(self, ids: Sequence[int]) -> list[int]:
        return [int(i) for i in ids if 0 <= int(i) < self._base_vocab and int(i) != self.eos_id]


class HFTokenizer(_FileTokenizer):
    """A HuggingFace `tokenizer.json`, through the `tokenizers` package."""

    def __init__(self, path: str, where: str):
        tokenizers = _import("tokenizers", path, where)
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises plain Exceptions for bad files
            raise ConfigError(f"cannot read tokenizer {path}: {e}", where) from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        name = next((n for n in _EOS_NAMES if n in vocab), None)
        super().__init__(path, self._tok.get_vocab_size(with_added_tokens=True), vocab.get(name))
        self.eos_token = name or EXTRA_EOS

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(self._known(ids), skip_special_tokens=False)


class SentencePieceTokenizer(_FileTokenizer):
    """A sentencepiece `.model`, through the `sentencepiece` package."""

    def __init__(self, path: str, where: str):
        spm = _import("sentencepiece", path, where)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as e:
            raise ConfigError(f"cannot read sentencepiece model {path}: {e}", where) from None
        eos, unk = self._sp.eos_id(), self._sp.unk_id()
        super().__init__(path, self._sp.get_piece_size(), eos if eos >= 0 else None)
        self.eos_token = self._sp.id_to_piece(eos) if eos >= 0 else EXTRA_EOS
        self.unk_token = self._sp.id_to_piece(unk) if unk >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(self._known(ids))


def needs_text_extra(package: str, path: str) -> str:
    """The message for an optional package of the [text] extra that is not installed."""
    return (f"reading {path} needs the '{package}' package, part of k3jax's [text] extra: "
            f"pip install -e '.[text]' in the k3jax checkout (or pip install {package})")


def _import(package: str, path: str, where: str):
    try:
        return __import__(package)
    except ImportError:
        raise ConfigError(needs_text_extra(package, path), where) from None


def load_tokenizer(spec: str, where: str = "data.tokenizer") -> Tokenizer:
    """'bytes', a path to a tokenizer.json, or a path to a sentencepiece .model."""
    if spec == "bytes":
        return ByteTokenizer()
    if not spec.endswith((".json", ".model")):
        raise ConfigError(f"unknown tokenizer {spec!r}: use 'bytes', a tokenizer.json or a sentencepiece .model",
                          where)
    path = os.path.expanduser(spec)
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer file {spec} not found", where)
    return HFTokenizer(path, where) if path.endswith(".json") else SentencePieceTokenizer(path, where)
