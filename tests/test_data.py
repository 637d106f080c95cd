"""The data pipeline against hand-built corpora: packing, resume, sharding, mixing, splits, errors."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from reference import byte_level_bpe

from k3jax.config import ConfigError, load_config
from k3jax.config.schema import Config, DataSourceConfig, replace
from train.data import prepare
from train.data.mqar import MQARSource, latest_values
from train.data.pipeline import build_pipeline
from train.data.shards import SIDECAR, ArrayRecordSource
from train.data.sources import build_source
from train.data.split import HeldOut
from train.data.text import TextSource, stdlib_files
from train.data.tokenizers import ByteTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]

EOS = 256


def write_jsonl(path, texts, key="text"):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return str(path)


def config(sources, *, seq_len=16, eval_fraction=0.0, seed=0, batch_size=4, **more):
    return replace(Config(), **{"model.vocab_size": 512, "data.sources": tuple(sources), "data.seq_len": seq_len,
                                "data.eval_fraction": eval_fraction, "data.seed": seed,
                                "train.batch_size": batch_size, **more})


def text_source(*paths, weight=1.0):
    return DataSourceConfig(type="text", paths=tuple(str(p) for p in paths), weight=weight)


def take(pipeline, n):
    return [next(pipeline) for _ in range(n)]


def segments(batch):
    """(row, input tokens of one segment, its positions, its loss_mask, its targets) per segment."""
    for r in range(batch["tokens"].shape[0]):
        seg = batch["segment_ids"][r]
        for s in np.unique(seg[seg > 0]):
            at = np.flatnonzero(seg == s)
            yield r, at, batch["tokens"][r, at], batch["positions"][r, at], batch["loss_mask"][r, at]


def numbered(i, n_tokens):
    """A document whose first five bytes spell its id, n_tokens long once EOS is added."""
    return f"{i:05d}" + "abcdefghijklmnopqrstuvwxyz"[i % 26] * (n_tokens - 6)


def ids_in(batch):
    """The ids of the numbered documents starting in a batch, in row/segment order."""
    return [int(bytes(toks[:5].tolist())) for _, _, toks, pos, _ in segments(batch) if pos[0] == 0]


# ---------------------------------------------------------------------------------------------
# tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    doc = tok.encode_document(text)
    assert doc.dtype == np.int32 and doc[-1] == tok.eos_id == 256 and tok.vocab_size == 257
    assert tok.decode(doc) == text  # EOS is not text
    assert load_tokenizer("bytes").vocab_size == 257


def test_tokenizer_json_round_trip(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3, "!": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (t.vocab_size, t.eos_id) == (5, 3)  # </s> found in the vocabulary
    assert t.encode("hello world ! hello") == [1, 2, 4, 1]
    assert t.decode(t.encode_document("hello world !")) == "hello world !"

    # a byte-level BPE without an EOS token gets one extra id
    bpe = byte_level_bpe(tmp_path / "bpe.json", ["the quick brown fox jumps"] * 4)
    t = load_tokenizer(str(tmp_path / "bpe.json"))
    base = bpe.get_vocab_size()
    assert (t.vocab_size, t.eos_id) == (base + 1, base)
    text = "the quick wörld!"
    assert t.decode(t.encode_document(text)) == text


def test_sentencepiece_round_trip(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=30, minloglevel=2)
    t = load_tokenizer(str(tmp_path / "sp.model"))
    assert t.decode(t.encode("the lazy fox")) == "the lazy fox" and 0 <= t.eos_id < t.vocab_size


@pytest.mark.parametrize("package, name", [("tokenizers", "tokenizer.json"), ("sentencepiece", "sp.model")])
def test_tokenizer_package_missing_is_a_clear_error(tmp_path, monkeypatch, package, name):
    (tmp_path / name).write_text("{}")
    monkeypatch.setitem(sys.modules, package, None)  # makes `import package` fail
    with pytest.raises(ConfigError) as e:
        load_tokenizer(str(tmp_path / name))
    assert e.value.where == "data.tokenizer" and name in str(e.value) and package in str(e.value)


def test_tokenizer_file_missing_or_unknown():
    with pytest.raises(ConfigError, match="nope.json") as e:
        load_tokenizer("nope.json")
    assert e.value.where == "data.tokenizer"
    with pytest.raises(ConfigError, match="unknown tokenizer"):
        load_tokenizer("gpt2")


# ---------------------------------------------------------------------------------------------
# packing


def test_packing_by_hand(tmp_path):
    seq_len = 16
    tok = ByteTokenizer()
    texts = ["a", "bb cc", "hello world", "", "X" + "0123456789" * 4, "q" * 16, "r" * 15, "tail end."]
    docs = [tok.encode_document(t) for t in texts]
    path = write_jsonl(tmp_path / "c.jsonl", texts)
    p = build_pipeline(config([text_source(path)], seq_len=seq_len), split="train", rows=3)
    assert p.tokenizer.vocab_size == 257
    # what the run logs at start: every document of the source, their mean length
    assert p.describe() == (f"train data, 3 rows x {seq_len}: data.sources.0 (text): {len(docs)} docs x "
                            f"{np.mean([len(d) for d in docs]):,.0f} tokens, weight 1")
    pieces_seen = {}
    for b in take(p, 40):
        for k, v in b.items():
            assert v.dtype == (np.float32 if k == "loss_mask" else np.int32)
            assert v.shape == (() if k == "num_tokens" else (3, seq_len))
        assert np.array_equal(b["targets"][:, :-1], b["tokens"][:, 1:])  # targets are the next tokens
        assert b["num_tokens"] == np.count_nonzero(b["loss_mask"])
        pad = b["segment_ids"] == 0
        assert not b["loss_mask"][pad].any() and not b["tokens"][pad].any()
        for r, at, toks, pos, mask in segments(b):
            assert np.array_equal(at, np.arange(at[0], at[-1] + 1)), "a document is contiguous in its row"
            assert np.array_equal(pos, np.arange(len(at))), "positions count from 0 within the document"
            # find the document and the offset this piece was cut from: a multiple of seq_len
            hits = [(d, o) for d, doc in enumerate(docs) for o in range(0, len(doc), seq_len)
                    if np.array_equal(doc[o:o + len(toks)], toks)]
            assert len(hits) == 1, (toks, hits)
            d, o = hits[0]
            piece = docs[d][o:o + seq_len + 1]
            expected = np.ones(len(toks), np.float32)
            if len(piece) == len(toks) + 1:  # the piece's last token is the row's final target
                assert at[-1] == seq_len - 1 and b["targets"][r, -1] == piece[-1]
            else:
                assert len(piece) == len(toks)
                expected[-1] = 0  # its target belongs to the next document (or is padding)
            assert np.array_equal(mask, expected)
            pieces_seen[(d, o)] = pieces_seen.get((d, o), 0) + 1
    # every document is covered by its pieces in order (offsets 0, seq_len, ...), none invented;
    # the empty document (just EOS) has nothing to predict and never appears
    expected_pieces = {(d, o) for d, doc in enumerate(docs) for o in range(0, len(doc) - 1, seq_len)}
    assert set(pieces_seen) == expected_pieces and (4, 32) in expected_pieces


def test_segment_ids_unique_per_document_within_a_row(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [numbered(i, 8) for i in range(40)])
    p = build_pipeline(config([text_source(path)], seq_len=32), split="train", rows=4)
    for b in take(p, 10):
        for r in range(4):
            seg = b["segment_ids"][r]
            starts = np.flatnonzero(b["positions"][r] == 0)
            starts = starts[seg[starts] > 0]
            assert len(set(seg[starts])) == len(starts)  # one id per document in the row
            assert len(starts) == 4  # 4 documents of 8 tokens fill 32 + 1 tokens best


# ---------------------------------------------------------------------------------------------
# resume, sharding, splits, mixing


def test_resume_is_bitwise_identical(tmp_path):
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("abcdefgh "), size=rng.integers(3, 90))) for _ in range(60)]
    path = write_jsonl(tmp_path / "c.jsonl", texts)
    cfg = config([text_source(path, weight=3), DataSourceConfig(mqar_pairs=4, mqar_queries=3)], seq_len=32,
                 eval_fraction=0.1)
    straight = take(build_pipeline(cfg, split="train"), 12)
    p = build_pipeline(cfg, split="train")
    take(p, 5)  # 20 rows: the middle of a 32-row pack
    state = json.loads(json.dumps(p.get_state()))  # what a checkpoint stores
    after = take(p, 7)
    q = build_pipeline(cfg, split="train")
    start = q.get_state()
    q.set_state(state)
    resumed = take(q, 7)
    for a, b, c in zip(straight[5:], after, resumed):
        for k in a:
            assert np.array_equal(a[k], b[k]) and np.array_equal(a[k], c[k]), k
    q.set_state(start)  # back to the first batch, as each eval pass rewinds
    assert all(np.array_equal(straight[0][k], v) for k, v in next(q).items())


def test_resume_sees_every_document_once_per_epoch(tmp_path):
    # 24 documents of 16 tokens, two per row of 32 + 1: one epoch is 12 rows = 3 batches of 4;
    # no shuffle window, which may straddle two epochs (test_eval_rows_mix_documents... covers it)
    path = write_jsonl(tmp_path / "c.jsonl", [numbered(i, 16) for i in range(24)])
    cfg = config([text_source(path)], seq_len=32, **{"data.packing_bins": 4, "data.shuffle_window": 0})
    p = build_pipeline(cfg, split="train", rows=4)
    seen = [i for b in take(p, 1) for i in ids_in(b)]
    state = p.get_state()
    q = build_pipeline(cfg, split="train", rows=4)
    q.set_state(state)
    seen += [i for b in take(q, 2) for i in ids_in(b)]
    assert sorted(seen) == list(range(24))
    second = [i for b in take(q, 3) for i in ids_in(b)]
    assert sorted(second) == list(range(24)) and second != seen  # reshuffled each epoch


def test_hosts_and_eval_split_are_disjoint_and_cover_the_corpus(tmp_path):
    n = 40
    path = write_jsonl(tmp_path / "c.jsonl", [numbered(i, 10) for i in range(n)])
    cfg = config([text_source(path)], seq_len=24, eval_fraction=0.1)
    sets = {}
    for split, host in [("train", 0), ("train", 1), ("eval", 0)]:
        p = build_pipeline(cfg, split=split, process_index=host, process_count=2 if split == "train" else 1)
        sets[split, host] = {i for b in take(p, 40) for i in ids_in(b)}  # more than a 32-row pack
    train0, train1, ev = sets["train", 0], sets["train", 1], sets["eval", 0]
    assert not train0 & train1 and not (train0 | train1) & ev
    assert train0 | train1 | ev == set(range(n))
    assert len(ev) == 4 and len(train0) == len(train1) == 18  # 1 in 10 held out; hosts split the rest


def test_rows_per_host_follow_the_batch_size():
    cfg = config([DataSourceConfig()], seq_len=64, batch_size=6)
    assert next(build_pipeline(cfg, split="train", process_index=1, process_count=3))["tokens"].shape == (2, 64)
    with pytest.raises(ConfigError) as e:
        build_pipeline(cfg, split="train", process_count=4)
    assert e.value.where == "train.batch_size"


@pytest.mark.parametrize("fraction", [0.02, 0.1, 0.3, 0.5])
def test_held_out_split_partitions_documents(fraction):
    for n in [1, 2, 3, 7, 49, 50, 51, 333]:
        train = [HeldOut(n, fraction, "train")[i] for i in range(len(HeldOut(n, fraction, "train")))]
        ev = [HeldOut(n, fraction, "eval")[i] for i in range(len(HeldOut(n, fraction, "eval")))]
        assert sorted(train + ev) == list(range(n)) and train == sorted(train) and ev == sorted(ev)
        if n >= 2:
            assert len(ev) >= 1
            assert len(ev) <= max(1, np.ceil(n / max(2, round(1 / fraction))))
    assert len(HeldOut(100, 0.0, "eval")) == 0 and len(HeldOut(5000, 0.02, "eval")) == 100


def test_mixture_token_shares_follow_weights(tmp_path):
    rng = np.random.default_rng(1)
    a = write_jsonl(tmp_path / "a.jsonl", ["a" * rng.integers(8, 30) for _ in range(200)])
    b = write_jsonl(tmp_path / "b.jsonl", ["b" * rng.integers(40, 90) for _ in range(200)])
    p = build_pipeline(config([text_source(a, weight=0.7), text_source(b, weight=0.3)], seq_len=64),
                       split="train", rows=8)
    counts = np.zeros(2)
    for batch in take(p, 150):
        real = batch["tokens"][batch["segment_ids"] > 0]
        counts += [np.sum(real == ord("a")), np.sum(real == ord("b"))]
    share = counts[0] / counts.sum()
    assert abs(share - 0.7) < 0.04, share


# ---------------------------------------------------------------------------------------------
# MQAR


def check_mqar(tokens, mask, pairs, queries, vocab):
    keys, values = tokens[0:2 * pairs:2], tokens[1:2 * pairs:2]
    assert len(set(keys.tolist())) == pairs and np.all((1 <= keys) & (keys < vocab // 2))
    assert np.all((vocab // 2 <= values) & (values < vocab))
    table = dict(zip(keys.tolist(), values.tolist()))
    asked, answers = tokens[2 * pairs::2], tokens[2 * pairs + 1::2]
    assert len(asked) == queries and all(table[k] == v for k, v in zip(asked.tolist(), answers.tolist()))
    assert np.flatnonzero(mask).tolist() == list(range(2 * pairs + 1, 2 * (pairs + queries), 2))


def test_mqar_answers_are_the_paired_values():
    src = MQARSource(8, 5, 512, seed=7)
    for i in [0, 1, 99_999_999]:
        d = src[i]
        check_mqar(d["tokens"], d["loss_mask"], 8, 5, 512)
        assert np.array_equal(d["tokens"], src[i]["tokens"])  # a pure function of (seed, index)
    assert not np.array_equal(src[0]["tokens"], MQARSource(8, 5, 512, seed=8)[0]["tokens"])


def test_mqar_through_the_pipeline():
    pairs, queries = 6, 4
    cfg = config([DataSourceConfig(mqar_pairs=pairs, mqar_queries=queries)], seq_len=63)
    train = build_pipeline(cfg, split="train")
    evals = build_pipeline(cfg, split="eval")
    b = next(train)
    assert b["num_tokens"] == 4 * 3 * queries  # 3 examples of 20 tokens per row of 64
    for r, at, toks, pos, mask in segments(b):
        full = np.append(toks, b["targets"][r, at[-1]])[:2 * (pairs + queries)]
        full_mask = np.zeros(len(full), np.int32)
        full_mask[1:] = mask[:len(full) - 1]  # loss_mask[t] scores target t + 1
        check_mqar(full, full_mask, pairs, queries, 512)
    train_docs = {tuple(t) for _, _, t, _, _ in segments(b)}
    eval_docs = {tuple(t) for _, _, t, _, _ in segments(next(evals))}
    assert not train_docs & eval_docs
    # eval examples come from a seed of their own, the same whatever data.seed is
    tok = ByteTokenizer()
    reseeded = replace(cfg, **{"data.seed": 5})
    for i in range(5):
        ev = build_source(cfg, 0, "eval", tok)[i]["tokens"]
        assert not np.array_equal(ev, build_source(cfg, 0, "train", tok)[i]["tokens"])
        assert not np.array_equal(ev, build_source(reseeded, 0, "train", tok)[i]["tokens"])
        assert np.array_equal(ev, build_source(reseeded, 0, "eval", tok)[i]["tokens"])


def test_mqar_must_fit_the_row_and_vocab():
    with pytest.raises(ConfigError) as e:
        build_pipeline(config([DataSourceConfig(mqar_pairs=8, mqar_queries=8)], seq_len=16), split="train")
    assert e.value.where == "data.sources.0.mqar_pairs" and "seq_len" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_pipeline(replace(config([DataSourceConfig(mqar_pairs=8)], seq_len=64), **{"model.vocab_size": 16}),
                       split="train")
    assert e.value.where == "data.sources.0.mqar_pairs" and "model.vocab_size" in str(e.value)


def test_mqar_latest_values_hand_built():
    # key 3 is written twice (10, then 12): asked, it answers 12; key 5 keeps its only value
    assert latest_values([3, 5, 3], [10, 11, 12], [3, 5, 3]).tolist() == [12, 11, 12]


def scan_answers(tokens, writes):
    """An independent reading of an MQAR example: the value each answer slot should hold,
    from a table updated pair by pair over the writes. {answer position: value}."""
    table = {}
    for j in range(writes):
        table[int(tokens[2 * j])] = int(tokens[2 * j + 1])
    return {i + 1: table[int(tokens[i])] for i in range(2 * writes, len(tokens) - 1) if int(tokens[i]) in table}


def test_mqar_overwrite_answers_the_latest_value():
    p, r, vocab = 6, 3, 64
    src = MQARSource(p, r, vocab, seed=3, overwrites=r)
    for i in range(20):
        d = src[i]
        toks, mask = d["tokens"], d["loss_mask"]
        assert len(toks) == 2 * (p + r + r)
        keys = toks[0:2 * (p + r):2].tolist()
        counts = {k: keys.count(k) for k in keys}
        assert sorted(counts.values()) == [1] * (p - r) + [2] * r  # r keys written twice
        answers = scan_answers(toks, p + r)
        assert np.flatnonzero(mask).tolist() == sorted(answers)  # every answer slot, nothing else
        for pos, value in answers.items():
            asked = int(toks[pos - 1])
            assert counts[asked] == 2 and toks[pos] == value  # asks an overwritten key; the latest value
            first = toks[2 * keys.index(asked) + 1]
            assert first != value and vocab // 2 <= value < vocab  # the new value differs from the old
    # without overwrites or a length, the documents are those of plain MQAR (same seed, same draws)
    plain, same = MQARSource(8, 5, 512, seed=7), MQARSource(8, 5, 512, seed=7, overwrites=0, example_length=0)
    assert all(np.array_equal(plain[i]["tokens"], same[i]["tokens"]) for i in range(5))


def test_mqar_length_spreads_the_queries_over_filler():
    p, q, length = 4, 4, 40
    src = MQARSource(p, q, 64, seed=1, example_length=length)
    for i in range(10):
        d = src[i]
        toks, mask = d["tokens"], d["loss_mask"]
        assert toks.shape == mask.shape == (length,)
        answers = scan_answers(toks, p)
        assert np.flatnonzero(mask).tolist() == sorted(answers) and len(answers) == q
        asked = {pos - 1 for pos in answers}
        filler = [t for j, t in enumerate(toks[2 * p:], 2 * p) if j not in asked and j - 1 not in asked]
        assert set(filler) == {0} and len(filler) == length - 2 * p - 2 * q
        assert all(toks[pos] == v for pos, v in answers.items())
    # through the pipeline: one example per row of `length` tokens
    cfg = config([DataSourceConfig(mqar_pairs=p, mqar_queries=q, mqar_length=length)], seq_len=length)
    b = next(build_pipeline(cfg, split="train"))
    assert b["num_tokens"] == 4 * q and (b["segment_ids"][:, :length - 1] == b["segment_ids"][:, :1]).all()
    # both options at once (the ladder's longer overwrite cells): the latest value, across filler
    p, r, length = 4, 2, 48
    src = MQARSource(p, r, 64, seed=2, overwrites=r, example_length=length)
    last = []
    for i in range(10):
        toks, mask = src[i]["tokens"], src[i]["loss_mask"]
        answers = scan_answers(toks, p + r)
        assert len(toks) == length and np.flatnonzero(mask).tolist() == sorted(answers) and len(answers) == r
        assert all(toks[pos] == v for pos, v in answers.items())
        last.append(max(answers))
    assert max(last) > 2 * (p + 2 * r)  # queries reach past the compact layout's end


def test_mqar_overwrite_and_length_errors():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.sources=[{type: mqar, mqar_pairs: 4, mqar_overwrites: 5}]"])
    assert e.value.where.endswith("data.sources.0.mqar_overwrites")
    with pytest.raises(ConfigError) as e:
        build_pipeline(config([DataSourceConfig(mqar_pairs=4, mqar_queries=4, mqar_length=12)], seq_len=64),
                       split="train")
    assert e.value.where == "data.sources.0.mqar_length" and "shorter" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_pipeline(config([DataSourceConfig(mqar_pairs=4, mqar_queries=4, mqar_length=48)], seq_len=32),
                       split="train")
    assert e.value.where == "data.sources.0.mqar_length" and "seq_len" in str(e.value)


# ---------------------------------------------------------------------------------------------
# sources and errors


def test_text_and_jsonl_documents(tmp_path):
    (tmp_path / "one.txt").write_text("a whole file\nis one document\n")
    write_jsonl(tmp_path / "lines.jsonl", ["first", "second"], key="body")
    with open(tmp_path / "lines.jsonl", "a") as f:
        f.write("\n   \n")  # an empty line is no document; a blank one is an empty document
    src = TextSource([str(tmp_path / "*.txt"), str(tmp_path / "lines.jsonl")], ByteTokenizer(), text_key="body")
    assert [src.text(i) for i in range(len(src))] == ["a whole file\nis one document\n", "first", "second", ""]
    assert np.array_equal(src[1]["tokens"], [*b"first", EOS]) and np.array_equal(src[1]["loss_mask"], [1] * 6)


def test_parquet_documents(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    texts = ["row %d" % i for i in range(10)]
    pq.write_table(pa.table({"body": texts}), tmp_path / "t.parquet", row_group_size=3)
    src = TextSource([str(tmp_path / "t.parquet")], ByteTokenizer(), text_key="body")
    assert [src.text(i) for i in range(len(src))] == texts
    with pytest.raises(ConfigError) as e:
        TextSource([str(tmp_path / "t.parquet")], ByteTokenizer(), text_key="text")
    assert e.value.where == "data.sources.0.text_key" and "body" in str(e.value)


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError) as e:
        TextSource([str(tmp_path / "t.parquet")], ByteTokenizer())
    assert e.value.where == "data.sources.0.paths" and "pyarrow" in str(e.value) and "t.parquet" in str(e.value)


def test_stdlib_corpus():
    p = build_pipeline(config([DataSourceConfig(type="stdlib")], seq_len=128), split="train", rows=4)
    b = next(p)
    assert p.sources[0].documents > 100 and b["num_tokens"] > 400
    seg = b["segment_ids"][0]
    piece = b["tokens"][0][(seg == seg[0]) & (b["tokens"][0] != EOS)]
    assert any(bytes(piece.tolist()) in open(f, "rb").read() for f in stdlib_files())


def test_missing_path_is_named(tmp_path):
    for path in [str(tmp_path / "nope.jsonl"), str(tmp_path / "*.nothing")]:
        with pytest.raises(ConfigError) as e:
            build_pipeline(config([DataSourceConfig(mqar_pairs=2, mqar_queries=2), text_source(path)]), split="train")
        assert e.value.where == "data.sources.1.paths" and path in str(e.value)


def test_empty_dataset_is_named(tmp_path):
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="no documents") as e:
        build_pipeline(config([text_source(tmp_path / "blank.jsonl")]), split="train")
    assert "data.sources.0" in str(e.value) and "blank.jsonl" in str(e.value)
    write_jsonl(tmp_path / "empty.jsonl", ["", "", ""])
    with pytest.raises(ConfigError, match="empty") as e:
        build_pipeline(config([text_source(tmp_path / "empty.jsonl")]), split="train")
    assert "data.sources.0" in str(e.value)


def test_missing_text_key_is_named(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", ["x"], key="content")
    with pytest.raises(ConfigError) as e:
        build_pipeline(config([text_source(tmp_path / "c.jsonl")]), split="train")
    assert e.value.where == "data.sources.0.text_key" and "c.jsonl" in str(e.value)


def test_tokenizer_larger_than_model_vocab(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", ["hello"])
    cfg = replace(config([text_source(path)]), **{"model.vocab_size": 256})
    with pytest.raises(ConfigError) as e:
        build_pipeline(cfg, split="train")
    assert e.value.where == "data.tokenizer" and "model.vocab_size" in str(e.value) and "257" in str(e.value)


def readme_data_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## Your data"):text.index("## Configs")]


def fenced(section: str, lang: str, containing: str) -> str:
    """The one ```lang block of section that contains `containing`."""
    blocks = [b for b in re.findall(rf"```{lang}\n(.*?)```", section, re.S) if containing in b]
    assert len(blocks) == 1, containing
    return blocks[0]


def test_readme_data_recipe_and_its_vocab_rule(tmp_path, monkeypatch):
    """The README's "Your data" steps as written (its tokenizer snippet, k3jax-data and k3jax-train
    command lines, quoted strings): a 512-entry BPE with no EOS token has 513 ids, EOS = 512, so
    model.vocab_size=512 is refused with the README's message and 513 reads both sources; one with
    an EOS-named token keeps 512 ids."""
    readme = readme_data_section()
    flat = re.sub(r"\s+", " ", readme)
    monkeypatch.chdir(tmp_path)
    files = [f for f in stdlib_files() if os.path.getsize(f) > 4000][:25]
    texts = [p for f in files for p in open(f, encoding="utf-8").read().split("\n\n") if len(p) > 40]  # short docs
    os.mkdir("corpus")
    write_jsonl("corpus/docs.jsonl", texts[: len(texts) // 2])
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": texts[len(texts) // 2:]}), "books.parquet")

    exec(fenced(readme, "python", "BpeTrainer"), {})  # writes tokenizer.json
    import tokenizers
    assert tokenizers.Tokenizer.from_file("tokenizer.json").get_vocab_size() == 512
    tok = load_tokenizer("tokenizer.json")
    printed = re.search(r"prints `(HFTokenizer\(.*?\))`", flat).group(1)
    assert repr(tok) == printed == "HFTokenizer('tokenizer.json', vocab_size=513, eos_id=512)"
    assert tok.encode_document("def f(): pass")[-1] == 512

    argv = shlex.split(fenced(readme, "bash", "k3jax-data --output").replace("\\\n", " "))
    assert argv[0] == "k3jax-data" and prepare.main(argv[1:]) == 0
    argv = shlex.split(fenced(readme, "bash", "k3jax-train --config").replace("\\\n", " "))
    assert argv[:3] == ["k3jax-train", "--config", "configs/k3-tiny.yaml"]
    cfg = load_config(ROOT / argv[2], argv[3:])
    assert [(s.type, s.paths, s.weight) for s in cfg.data.sources] == [
        ("arrayrecord", ("shards",), 0.7), ("text", ("books.parquet",), 0.3)]
    assert (cfg.model.vocab_size, cfg.data.tokenizer, cfg.logging.eval_every) == (513, "tokenizer.json", 50)

    with pytest.raises(ConfigError) as e:
        build_pipeline(replace(cfg, **{"model.vocab_size": 512}), split="train")
    said = re.search(r"`(k3jax-train: data\.tokenizer: tokenizer .*?)`", flat).group(1)
    assert f"k3jax-train: {e.value}" == said
    batch = next(build_pipeline(cfg, split="train"))
    real = batch["segment_ids"] > 0
    assert batch["tokens"].max() <= 512 and (batch["tokens"][real] == 512).any()  # EOS, inside the 513 rows

    # a vocabulary with an EOS-named token ends documents with it: 512 ids, 512 rows
    special = tokenizers.Tokenizer(tokenizers.models.BPE())
    special.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    special.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    special.save("eos.json")
    with_eos = load_tokenizer("eos.json")
    assert (with_eos.vocab_size, with_eos.eos_id) == (512, special.token_to_id("<|endoftext|>"))
    next(build_pipeline(replace(cfg, **{"model.vocab_size": 512, "data.tokenizer": "eos.json",
                                        "data.sources": (text_source("books.parquet"),)}), split="train"))


def test_eval_without_held_out_documents(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", ["one", "two", "three"])
    with pytest.raises(ConfigError) as e:
        build_pipeline(config([text_source(path)], eval_fraction=0.0), split="eval")
    assert e.value.where == "data.eval_fraction"
    p = build_pipeline(config([text_source(path), DataSourceConfig()], eval_fraction=0.0, seq_len=64), split="eval")
    assert p.left_out == ["data.sources.0 (text)"] and next(p)["num_tokens"] > 0


def test_state_of_another_pipeline_is_refused(tmp_path):
    p = build_pipeline(config([DataSourceConfig()], seq_len=32), split="train")
    with pytest.raises(ConfigError, match="data.seq_len"):
        build_pipeline(config([DataSourceConfig()], seq_len=64), split="train").set_state(p.get_state())


def test_packing_bins_is_checked():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.packing_bins=0"])
    assert "data.packing_bins" in str(e.value)


# ---------------------------------------------------------------------------------------------
# k3jax-data


def test_prepare_round_trip(tmp_path, capsys):
    texts = [numbered(i, 5 + 7 * i) for i in range(30)]
    write_jsonl(tmp_path / "a.jsonl", texts[:20])
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts[20:]):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(t)
    out = tmp_path / "shards"
    assert prepare.main(["--output", str(out), "--shards", "3", str(tmp_path / "a.jsonl"),
                         str(tmp_path / "txt" / "*.txt")]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    total = sum(len(t) + 1 for t in texts)
    assert summary.startswith("k3jax-data: 30 documents") and f"{total:,} tokens" in summary
    assert "3 shard(s)" in summary and str(out) in summary
    assert len(list(out.glob("*.array_record"))) == 3 and (out / SIDECAR).is_file()

    src = ArrayRecordSource([str(out / "*.array_record")], ByteTokenizer())
    assert len(src) == 30
    for i, t in enumerate(texts):  # shards hold contiguous runs, so order is kept
        assert np.array_equal(src[i]["tokens"], [*t.encode(), EOS])
    cfg = config([DataSourceConfig(type="arrayrecord", paths=(str(out),))], seq_len=256)
    b = next(build_pipeline(cfg, split="train"))
    assert set(ids_in(b)) <= set(range(30)) and b["num_tokens"] > 0


def test_prepare_piped_prints_plain_lines(tmp_path):
    """Piped (as under nohup or `| tee`), k3jax-data's progress is whole lines, no bar redraws."""
    write_jsonl(tmp_path / "a.jsonl", [numbered(i, 40) for i in range(20)])
    out = subprocess.run([sys.executable, "-m", "train.data.prepare", "--output", str(tmp_path / "o"),
                          str(tmp_path / "a.jsonl")], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "\r" not in out.stdout + out.stderr and "%|" not in out.stderr
    lines = out.stdout.splitlines()
    assert lines == [f"k3jax-data: {n}/20 documents, {n * 40:,} tokens" for n in range(2, 20, 2)] + [
        f"k3jax-data: 20 documents, {20 * 40:,} tokens (bytes, vocab 257) in 1 shard(s) in {tmp_path / 'o'}"]


def test_prepare_errors(tmp_path, capsys):
    assert prepare.main(["--output", str(tmp_path / "o"), str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3jax-data: ") and "missing.jsonl" in err and "Traceback" not in err
    assert prepare.main(["--output", str(tmp_path / "o"), "--tokenizer", "absent.model", "--stdlib"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    write_jsonl(tmp_path / "a.jsonl", ["x", "y"])
    assert prepare.main(["--output", str(tmp_path / "o"), str(tmp_path / "a.jsonl")]) == 0
    assert prepare.main(["--output", str(tmp_path / "o"), str(tmp_path / "a.jsonl")]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_shards_of_another_tokenizer_are_refused(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["hello", "world"])
    out = tmp_path / "shards"
    assert prepare.main(["--output", str(out), str(tmp_path / "a.jsonl")]) == 0
    meta = json.loads((out / SIDECAR).read_text())
    meta.update(tokenizer="other.json", tokenizer_fingerprint="sha256:0")  # same vocab_size, other ids
    (out / SIDECAR).write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as e:
        build_pipeline(config([DataSourceConfig(type="arrayrecord", paths=(str(out),))]), split="train")
    assert e.value.where == "data.tokenizer" and "tokens-00000-of-00001.array_record" in str(e.value)
    assert "other.json" in str(e.value)
    os.remove(out / SIDECAR)
    with pytest.raises(ConfigError, match=SIDECAR) as e:
        build_pipeline(config([DataSourceConfig(type="arrayrecord", paths=(str(out),))]), split="train")
    assert e.value.where == "data.sources.0.paths"
