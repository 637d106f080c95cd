"""A run's tokenizer beside its exported weights, and back into an imported run's data.tokenizer.

Export (`export_tokenizer`, `write_tokenizer`): the run's `data.tokenizer` is written in the
forms of `k3jax.interchange.hf_tokenizer`: byte-level runs get its byte tokenizer.json, a
tokenizer.json run its file unchanged (so its content hash, which shards record, stays the
same), a sentencepiece run its .model as tokenizer.model; then tokenizer_config.json,
generation_config.json, and in config.json the token ids and (K3 layout) the record
`k3jax.tokenizer` {kind, spec, fingerprint, vocab_size, eos_id}.

Import (`imported_tokenizer`): a checkpoint folder that holds a tokenizer k3jax reads (the byte
tokenizer.json, another tokenizer.json, a tokenizer.model) fixes what the weights' ids mean:
--config's data.tokenizer must be that vocabulary (same content, ids and EOS) or the import
stops naming both; the imported run's data.tokenizer becomes "bytes" or a copy of the file in
its run directory. A folder without one (e.g. a tiktoken vocabulary) leaves data.tokenizer as
--config has it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from k3jax.config import ConfigError
from k3jax.interchange.errors import InterchangeError
from k3jax.interchange.hf_tokenizer import (
    GENERATION_CONFIG,
    SENTENCEPIECE_MODEL,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    byte_tokenizer_json,
    generation_config_json,
    token_ids,
    tokenizer_config_json,
)
from train.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def kind(tok: Tokenizer) -> str:
    if isinstance(tok, ByteTokenizer):
        return "bytes"
    return "tokenizer.json" if isinstance(tok, HFTokenizer) else "sentencepiece"


def _identity(tok: Tokenizer) -> tuple:
    return tok.fingerprint, tok.vocab_size, tok.eos_id


def _describe(tok: Tokenizer, name: str) -> str:
    return f"{name} ({tok.vocab_size} ids, EOS {tok.eos_id})"


def export_tokenizer(cfg) -> tuple[Tokenizer | None, str]:
    """(the run's tokenizer, "") or (None, why the export holds none): a tokenizer with more ids
    than model.vocab_size cannot be the one the run trained on (a run on synthetic data only)."""
    spec = cfg.data.tokenizer
    if spec != "bytes" and spec.endswith((".json", ".model")) and not Path(spec).expanduser().is_file():
        raise ConfigError(f"tokenizer file {spec} not found (k3jax-export writes the run's tokenizer beside the "
                          f"weights; a relative path is read from the current directory: point to the file with "
                          f"data.tokenizer=PATH)", "data.tokenizer")
    tok = load_tokenizer(spec)
    if tok.vocab_size > cfg.model.vocab_size:
        return None, (f"no tokenizer written: data.tokenizer {cfg.data.tokenizer!r} has {tok.vocab_size} ids, "
                      f"model.vocab_size {cfg.model.vocab_size}")
    return tok, ""


def config_entries(tok: Tokenizer) -> dict:
    """What config.json gains: the token ids, and under `k3jax` the record the import checks."""
    record = {"kind": kind(tok), "spec": tok.spec, "fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
              "eos_id": tok.eos_id}
    return {**token_ids(tok.eos_id), "k3jax": {"tokenizer": record}}


def write_tokenizer(tok: Tokenizer, out, *, temperature: float, top_p: float, max_new_tokens: int) -> list[str]:
    """Write `tok`'s files into the export folder `out`; returns their names."""
    out = Path(out)
    k = kind(tok)
    if k == "bytes":
        (out / TOKENIZER_JSON).write_text(byte_tokenizer_json(tok.eos_token), encoding="utf-8")
        vocab_file = TOKENIZER_JSON
    else:
        vocab_file = TOKENIZER_JSON if k == "tokenizer.json" else SENTENCEPIECE_MODEL
        shutil.copyfile(Path(tok.spec).expanduser(), out / vocab_file)
    tc = tokenizer_config_json(k, eos_token=tok.eos_token, eos_id=tok.eos_id, eos_is_extra=tok.eos_is_extra,
                               unk_token=tok.unk_token)
    gc = generation_config_json(tok.eos_id, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    (out / TOKENIZER_CONFIG).write_text(json.dumps(tc, indent=1) + "\n")
    (out / GENERATION_CONFIG).write_text(json.dumps(gc, indent=1) + "\n")
    return [vocab_file, TOKENIZER_CONFIG, GENERATION_CONFIG]


def checkpoint_tokenizer(hf_dir, config_json: dict) -> Tokenizer | None:
    """The tokenizer a checkpoint folder carries (None: none k3jax reads), checked against the
    record an export left in config.json."""
    hf_dir = Path(hf_dir)
    as_json, as_spm = hf_dir / TOKENIZER_JSON, hf_dir / SENTENCEPIECE_MODEL
    if as_json.is_file():
        byte_level = as_json.read_bytes() == byte_tokenizer_json(ByteTokenizer.eos_token).encode("utf-8")
        tok = ByteTokenizer() if byte_level else load_tokenizer(str(as_json), where=str(as_json))
    elif as_spm.is_file():
        tok = load_tokenizer(str(as_spm), where=str(as_spm))
    else:
        tok = None
    record = (config_json.get("k3jax") or {}).get("tokenizer")
    if record is not None:
        where = hf_dir / "config.json"
        if tok is None:
            raise InterchangeError(f"{where} records the tokenizer {record.get('spec')!r} (k3jax.tokenizer) but "
                                   f"{hf_dir} holds no {TOKENIZER_JSON} or {SENTENCEPIECE_MODEL}")
        if _identity(tok) != (record.get("fingerprint"), record.get("vocab_size"), record.get("eos_id")):
            raise InterchangeError(f"{tok.spec if kind(tok) != 'bytes' else as_json}: not the tokenizer these weights "
                                   f"were exported with ({where} k3jax.tokenizer: {record.get('spec')!r}, "
                                   f"{record.get('vocab_size')} ids, EOS {record.get('eos_id')})")
    return tok


def imported_tokenizer(cfg, hf_dir, config_json: dict, run_dir) -> tuple[str, Path | None]:
    """(data.tokenizer for the imported run, the file to copy to that path, or None)."""
    ckpt = checkpoint_tokenizer(hf_dir, config_json)
    if ckpt is None:
        return cfg.data.tokenizer, None
    spec = "bytes" if kind(ckpt) == "bytes" else ckpt.spec
    theirs = _describe(ckpt, f"the checkpoint's tokenizer {spec!r}")
    try:
        mine = load_tokenizer(cfg.data.tokenizer)
    except ConfigError as e:
        raise ConfigError(f"{e.message}; {theirs} is what the weights' ids mean: data.tokenizer={spec}",
                          e.where) from None
    if _identity(mine) != _identity(ckpt):
        raise ConfigError(f"{_describe(mine, repr(cfg.data.tokenizer))} is not {theirs}, whose ids the weights "
                          f"were trained on; set data.tokenizer={spec}", "data.tokenizer")
    if spec == "bytes":
        return spec, None
    dst = Path(run_dir).absolute() / Path(ckpt.spec).name
    return str(dst), Path(ckpt.spec)


def copy_tokenizer(src: Path | None, spec: str) -> None:
    """Put the checkpoint's tokenizer file where the imported run's data.tokenizer points."""
    if src is not None:
        shutil.copyfile(src, spec)


__all__ = [
    "checkpoint_tokenizer",
    "config_entries",
    "copy_tokenizer",
    "export_tokenizer",
    "imported_tokenizer",
    "kind",
    "write_tokenizer",
]
