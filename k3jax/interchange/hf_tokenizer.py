"""The tokenizer files of an exported checkpoint, in the forms `tokenizers` and transformers read
(the choice of files from a run's tokenizer: train/interchange/tokenizer_files.py).

    tokenizer.json           the run's own file, or for byte-level runs `byte_tokenizer_json`
    tokenizer.model          a sentencepiece run's model file
    tokenizer_config.json    `tokenizer_config_json`: the class to load, the special tokens
    generation_config.json   `generation_config_json`: EOS/pad ids and the sampling defaults
    config.json              gains `token_ids` (bos/eos/pad_token_id)

k3jax's byte tokenizer (ids 0-255 the UTF-8 bytes, 256 EOS) as a `tokenizers` model: a BPE
whose vocabulary is the 256 symbols of the byte-level alphabet, each at its byte's id, with no
merges, so every byte stays its own token; the ByteLevel pre-tokenizer maps text's bytes to
those symbols and the ByteLevel decoder maps them back (invalid UTF-8 decodes to U+FFFD, as
Python's errors="replace" does). EOS is a special added token at 256. The ids round-trip
exactly, with one caveat: `tokenizers` (unlike k3jax) reads a literal EOS name in text as the
EOS id unless `encode_special_tokens` is set; tokenizer_config.json sets transformers'
`split_special_tokens` so AutoTokenizer encodes such text as its bytes, as k3jax trained it.
"""

from __future__ import annotations

import json

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"


def byte_symbols() -> list[str]:
    """The byte-level alphabet (GPT-2's): symbol i stands for byte i. Printable Latin-1 bytes
    are their own character; the other 68 take U+0100 onwards in byte order, so no symbol is
    whitespace or a control character."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, spare = [], 0x100
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(spare))
            spare += 1
    return out


def byte_tokenizer_json(eos_token: str) -> str:
    """tokenizer.json of k3jax's byte tokenizer (the module docstring), always the same text, so
    an import recognizes it by content."""
    vocab = {s: i for i, s in enumerate(byte_symbols())}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 256, "content": eos_token, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": byte_level,  # no regex split: the whole text is one word of byte symbols
        "post_processor": None,  # no BOS/EOS added on encode: documents start bare, as k3jax's do
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "vocab": vocab, "merges": []},
    }
    return json.dumps(doc, indent=1) + "\n"


def tokenizer_config_json(kind: str, *, eos_token: str, eos_id: int, eos_is_extra: bool = False,
                          unk_token: str | None = None) -> dict:
    """tokenizer_config.json for `kind` "bytes", "tokenizer.json" or "sentencepiece".

    EOS also serves as BOS (a new document is sampled after an EOS, as k3jax-generate does) and
    as padding (k3jax pads with segment id 0, never with a token it trains on). eos_is_extra: the
    vocabulary file lacks the EOS (k3jax gave it the next id); transformers appends the
    `added_tokens_decoder` entry at that id. Nothing adds special tokens on encode, and decoding
    leaves spaces as they are (clean_up_tokenization_spaces false), so ids and text round-trip."""
    cfg = {
        "tokenizer_class": "LlamaTokenizer" if kind == "sentencepiece" else "PreTrainedTokenizerFast",
        "bos_token": eos_token,
        "eos_token": eos_token,
        "pad_token": eos_token,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": kind == "bytes",  # k3jax's byte tokenizer has no special text
        "model_input_names": ["input_ids", "attention_mask"],
    }
    if kind == "sentencepiece":  # LlamaTokenizer would add a BOS and rewrite leading spaces
        cfg.update(add_bos_token=False, add_eos_token=False, legacy=True, unk_token=unk_token)
    if eos_is_extra:
        cfg["added_tokens_decoder"] = {str(eos_id): {"content": eos_token, "lstrip": False, "normalized": False,
                                                     "rstrip": False, "single_word": False, "special": True}}
    return cfg


def token_ids(eos_id: int) -> dict:
    """config.json's token ids (BOS and padding are the EOS: `tokenizer_config_json`)."""
    return {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id}


def generation_config_json(eos_id: int, *, temperature: float, top_p: float, max_new_tokens: int) -> dict:
    """generation_config.json: stop at EOS, and sample as k3jax-generate does by default."""
    return {**token_ids(eos_id), "do_sample": temperature > 0, "temperature": temperature, "top_p": top_p,
            "max_new_tokens": max_new_tokens}


__all__ = [
    "GENERATION_CONFIG",
    "SENTENCEPIECE_MODEL",
    "TOKENIZER_CONFIG",
    "TOKENIZER_JSON",
    "byte_symbols",
    "byte_tokenizer_json",
    "generation_config_json",
    "token_ids",
    "tokenizer_config_json",
]
