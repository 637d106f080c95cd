"""k3jax-export writes the run's tokenizer beside the weights and k3jax-import reads it back:
the exported folder's tokenizer, loaded with `tokenizers` (or sentencepiece), gives the ids the
run trained on (bytes, a BPE trained here, sentencepiece) and their text back; config.json and
generation_config.json carry the EOS; a mismatched or swapped tokenizer is refused by name.
(transformers is not in the test venv: its reading of tokenizer_config.json is emulated where
it decides an id, the extra EOS.)

One run directory of random weights (k3jax-import's `save_imported`) is exported with
data.tokenizer overridden per case."""

import json

import pytest
import tokenizers
from interchange_util import micro_config, random_weights
from reference import byte_level_bpe

from k3jax.config import load_config
from k3jax.config.schema import replace
from k3jax.interchange.hf_tokenizer import byte_symbols
from train.data.tokenizers import ByteTokenizer, load_tokenizer
from train.interchange import export as export_mod
from train.interchange import import_ as import_mod
from train.interchange.rundir import save_imported

TEXTS = ["Hello, wörld!\n\tcafé ✓ 🙂 ", "  two  spaces\r\nand a NUL \x00 byte", "the quick brown fox", ""]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, its config.yaml, a BPE tokenizer.json with no EOS token, a sentencepiece model)."""
    root = tmp_path_factory.mktemp("tok")
    cfg = micro_config(vocab_size=320, layer_pattern="kda+mla", attn_res_block_size=1)
    cfg = replace(cfg, run_dir=str(root / "run"), **{"mesh.num_devices": 1})
    params, rest = random_weights(cfg.model, seed=3)
    save_imported(root / "run", cfg, params, rest)
    byte_level_bpe(root / "bpe.json", ["the quick brown fox jumps over the lazy dog"] * 8)
    import sentencepiece as spm

    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    spm.SentencePieceTrainer.train(input=str(root / "corpus.txt"), model_prefix=str(root / "sp"), vocab_size=30,
                                   minloglevel=2)
    return root / "run", root / "run" / "config.yaml", root / "bpe.json", root / "sp.model"


def export(run, out, *overrides) -> dict:
    """k3jax-export RUN --out OUT [overrides]; the folder's JSON files."""
    assert export_mod.main([str(run), "--out", str(out), "--dtype", "float32", *overrides]) == 0
    return {n: json.loads((out / n).read_text()) for n in ("config.json", "tokenizer_config.json",
                                                            "generation_config.json")}


def check_ids(files: dict, eos_id: int):
    """config.json and generation_config.json name the run's EOS (also as BOS and padding)."""
    for name in ("config.json", "generation_config.json"):
        c = files[name]
        assert (c["eos_token_id"], c["bos_token_id"], c["pad_token_id"]) == (eos_id,) * 3, name
    g = files["generation_config.json"]
    assert (g["do_sample"], g["temperature"], g["top_p"], g["max_new_tokens"]) == (True, 0.8, 0.95, 200)


def test_bytes_run_exports_a_byte_tokenizer_that_round_trips_and_imports_as_bytes(run, tmp_path, capsys):
    run_dir, config, _, _ = run
    out = tmp_path / "hf"
    files = export(run_dir, out)
    assert "its tokenizer (bytes, EOS 256) as tokenizer.json" in capsys.readouterr().out
    check_ids(files, 256)
    tc = files["tokenizer_config.json"]
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast" and tc["eos_token"] == "<|endoftext|>"
    assert tc["split_special_tokens"] is True and tc["clean_up_tokenization_spaces"] is False
    assert files["config.json"]["k3jax"]["tokenizer"]["kind"] == "bytes"

    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == 257 and tok.token_to_id(tc["eos_token"]) == 256
    run_tok = ByteTokenizer()
    # every byte valid UTF-8 holds: ASCII, all 2-byte characters, each 3- and 4-byte lead byte
    three = "".join(chr(max(k << 12, 0x800) | 0x100) for k in range(16))  # lead bytes E0..EF, no surrogate
    every_valid_byte = "".join(map(chr, range(0x800))) + three + \
        "".join(chr(c) for c in (0x10000, 0x40000, 0x80000, 0xC0000, 0x100000))
    for text in [*TEXTS, every_valid_byte]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == list(text.encode("utf-8"))  # the bytes themselves
        assert ids + [256] == run_tok.encode_document(text).tolist()  # what the run trained on, EOS appended
        assert tok.decode(ids + [256]) == text  # EOS is special: skipped, as k3jax's decode drops it
    covered = {b for t in [*TEXTS, every_valid_byte] for b in t.encode("utf-8")}
    assert covered == set(range(256)) - {0xC0, 0xC1, *range(0xF5, 0x100)}
    # the rest (never in valid UTF-8) are Latin-1 letters, their own byte-level symbol
    assert all(tok.id_to_token(b) == chr(b) for b in (0xC0, 0xC1, *range(0xF5, 0x100)))
    assert set(byte_symbols()) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    for bad in ([0xE2, 0x82, 65], [0xFF, 0xFE, 0xC0, 0x80, 65], [0xF0, 0x9F, 0x99]):  # invalid UTF-8
        assert tok.decode(bad) == run_tok.decode(bad) == bytes(bad).decode("utf-8", errors="replace")
    # a literal EOS name in text is its bytes to k3jax; split_special_tokens (transformers) and
    # encode_special_tokens (tokenizers) say the same
    text = "a <|endoftext|> b"
    assert tok.encode(text).ids != run_tok.encode(text)
    tok.encode_special_tokens = True
    assert tok.encode(text).ids == run_tok.encode(text)

    back = tmp_path / "back"
    assert import_mod.main([str(out), "--config", str(config), "--out", str(back)]) == 0
    assert "data.tokenizer=bytes;" in capsys.readouterr().out
    assert load_config(back / "config.yaml").data.tokenizer == "bytes"


def test_bpe_run_exports_its_file_and_import_reads_it_back(run, tmp_path, capsys):
    """A 280-entry BPE without an EOS token: k3jax's EOS is the extra id 280."""
    run_dir, config, bpe_path, _ = run
    run_tok = load_tokenizer(str(bpe_path))
    assert (run_tok.vocab_size, run_tok.eos_id) == (281, 280)
    out = tmp_path / "hf"
    files = export(run_dir, out, f"data.tokenizer={bpe_path}")
    assert (out / "tokenizer.json").read_bytes() == bpe_path.read_bytes()  # the file itself: shards still match
    check_ids(files, 280)
    tc = files["tokenizer_config.json"]
    assert tc["eos_token"] == "<|endoftext|>" and tc["split_special_tokens"] is False
    assert tc["added_tokens_decoder"] == {"280": {"content": "<|endoftext|>", "lstrip": False, "normalized": False,
                                                  "rstrip": False, "single_word": False, "special": True}}

    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids + [280] == run_tok.encode_document(text).tolist()
        assert tok.decode(ids) == text == run_tok.decode(ids)
    # transformers adds the config's added_tokens_decoder entries missing from the file, in id
    # order, each at the next id: the EOS lands on 280, and a document then encodes with its EOS
    tok.add_special_tokens([tokenizers.AddedToken(v["content"], special=True, normalized=False)
                            for _, v in sorted(tc["added_tokens_decoder"].items(), key=lambda kv: int(kv[0]))])
    assert tok.token_to_id("<|endoftext|>") == 280
    for text in TEXTS:
        assert tok.encode(text + "<|endoftext|>").ids == run_tok.encode_document(text).tolist()

    back = tmp_path / "back"
    assert import_mod.main([str(out), "--config", str(config), f"data.tokenizer={bpe_path}",
                            "--out", str(back)]) == 0
    spec = load_config(back / "config.yaml").data.tokenizer
    assert spec == str(back.absolute() / "tokenizer.json") and load_tokenizer(spec).fingerprint == run_tok.fingerprint
    capsys.readouterr()
    # the config's tokenizer must be the checkpoint's
    assert import_mod.main([str(out), "--config", str(config), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3jax-import: data.tokenizer: 'bytes' (257 ids, EOS 256) is not the checkpoint's tokenizer")
    assert f"(281 ids, EOS 280), whose ids the weights were trained on; set data.tokenizer={out}/tokenizer.json" in err
    assert not (tmp_path / "x").exists()
    # a tokenizer.json swapped in after the export is not the one the weights were written with
    tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(out / "tokenizer.json"))
    assert import_mod.main([str(out), "--config", str(config), f"data.tokenizer={out}/tokenizer.json",
                            "--out", str(tmp_path / "y")]) == 2
    assert "tokenizer.json: not the tokenizer these weights were exported with" in capsys.readouterr().err


def test_sentencepiece_run_exports_its_model(run, tmp_path, capsys):
    import sentencepiece as spm

    run_dir, config, _, sp_path = run
    run_tok = load_tokenizer(str(sp_path))
    out = tmp_path / "hf"
    files = export(run_dir, out, f"data.tokenizer={sp_path}")
    assert (out / "tokenizer.model").read_bytes() == sp_path.read_bytes()
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    check_ids(files, sp.eos_id())
    tc = files["tokenizer_config.json"]
    assert (tc["tokenizer_class"], tc["eos_token"], tc["unk_token"]) == ("LlamaTokenizer", "</s>", "<unk>")
    assert tc["add_bos_token"] is False and tc["add_eos_token"] is False
    for text in ("the lazy fox", "over the dog"):
        assert sp.encode(text) + [sp.eos_id()] == run_tok.encode_document(text).tolist()
    back = tmp_path / "back"
    assert import_mod.main([str(out), "--config", str(config), f"data.tokenizer={sp_path}",
                            "--out", str(back)]) == 0
    assert load_config(back / "config.yaml").data.tokenizer == str(back.absolute() / "tokenizer.model")


def test_export_without_the_tokenizer_file_stops_before_the_weights(run, tmp_path, capsys):
    run_dir, _, _, _ = run
    assert export_mod.main([str(run_dir), "--out", str(tmp_path / "hf"), "data.tokenizer=gone/tokenizer.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3jax-export: data.tokenizer: tokenizer file gone/tokenizer.json not found")
    assert "point to the file with data.tokenizer=PATH" in err and not (tmp_path / "hf").exists()
