"""The training/eval input pipeline: a weighted, shuffled, host-sharded, packed stream of batches.

Per source (grain MapDataset, all lazy and random-access):
    split positions (HeldOut) -> host slice [p::P] -> shuffle(seed) -> repeat() -> read document
then MapDataset.mix(sources, rates) -> to_iter_dataset -> cut into pieces of <= seq_len + 1
-> shuffle the pieces in windows (data.shuffle_window) -> first-fit packing into rows of seq_len + 1 -> batch(rows) -> inputs/targets (rows.py).

Order: each source is reshuffled every epoch (grain folds the epoch into the shuffle seed),
and each source's epochs run independently of the others'. Within an epoch of a source every
one of its documents comes once; a shuffle window and a pack of rows can straddle two epochs.
A document longer than a row is cut into consecutive pieces, which the window spreads, so each
batch mixes many documents (in document order, a batch of k3-tiny's 8 rows held 1 KB of one
file and the model drifted from file to file). Sources interleave deterministically by their rates. The whole stream is a pure function of the config and the host
(process_index, process_count), which is what makes `get_state`/`set_state` exact.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import grain
import grain.experimental as gex
import numpy as np

from k3jax.config.errors import ConfigError
from k3jax.config.schema import Config
from train.data.rows import finish_batch
from train.data.sources import build_source
from train.data.split import HeldOut, SplitIntoPieces, piece_tokens, seed32
from train.data.tokenizers import Tokenizer, load_tokenizer

STATE_FORMAT = "k3jax-data-state-v1"
# Documents read per source at start-up to measure tokens per document: weights are token
# shares, grain mixes documents, so each source is drawn at weight / mean tokens.
_SAMPLE_DOCS = 64
# Documents are read and tokenized in Python: reader threads only contend for the GIL (measured
# 2x slower with 4 threads), so reading happens in the batch-prefetch thread below.
_READ_THREADS = 0
_BATCH_PREFETCH = 2  # batches assembled in a background thread while the model trains
# A shuffle window holds at most this share of one pass over the finite sources' pieces (an
# estimate from a sample): no piece appears twice in one window.
_WINDOW_PASS_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class SourceInfo:
    """What the pipeline made of one `data.sources.i`, for logs and tests."""

    name: str
    documents: int  # documents of this split, all hosts
    weight: float  # configured token share (normalised)
    mean_tokens: float  # per document, after cutting into pieces
    rate: float  # share of documents drawn from this source
    finite: bool = True  # False for a synthetic source (MQAR): its "documents" never run out


class DataPipeline:
    """An endless iterator of batches, resumable exactly with get_state()/set_state().

    `next()` returns numpy arrays (rows.finish_batch): tokens, targets, segment_ids,
    positions [rows, seq_len] int32, loss_mask [rows, seq_len] float32, num_tokens int32 [].
    """

    def __init__(self, dataset: grain.IterDataset, *, tokenizer: Tokenizer, split: str, rows: int,
                 seq_len: int, sources: list[SourceInfo], left_out: list[str], identity: dict,
                 pieces_per_pass: float = float("inf")):
        self.tokenizer, self.split, self.rows, self.seq_len = tokenizer, split, rows, seq_len
        # pieces (at most one row each) in one pass over this host's documents, estimated from
        # a sample; inf with a synthetic source
        self.pieces_per_pass = pieces_per_pass
        self.sources, self.left_out = sources, left_out
        self._identity = identity
        self._holder = [iter(dataset)]
        # Close (and drop) grain's iterators at exit, while modules still exist: left to their
        # own __del__ during interpreter teardown they print AttributeErrors.
        self._close = weakref.finalize(self, _close_all, self._holder)

    @property
    def _it(self) -> grain.DatasetIterator:
        if not self._holder:
            raise ValueError("this DataPipeline is closed")
        return self._holder[0]

    def __iter__(self) -> "DataPipeline":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable position: grain's iterator state plus what it is only valid for."""
        return {"format": STATE_FORMAT, "pipeline": self._identity, "iterator": self._it.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue exactly where `get_state()` was taken, in this or a fresh pipeline."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ConfigError(f"not a data-iterator state (expected format {STATE_FORMAT})", "data state")
        saved = state["pipeline"]
        changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in self._identity.items() if saved.get(k) != v]
        if changed:
            raise ConfigError("the saved data-iterator state belongs to a different data pipeline ("
                              + "; ".join(changed) + "); resuming it would repeat or skip documents", "data state")
        self._it.set_state(state["iterator"])

    def close(self) -> None:
        self._close()

    def describe(self) -> str:
        parts = [f"{s.name}: {s.documents:,} docs x {s.mean_tokens:,.0f} tokens, weight {s.weight:.3g}"
                 for s in self.sources]
        skipped = f"; no {self.split} documents in {', '.join(self.left_out)}" if self.left_out else ""
        return f"{self.split} data, {self.rows} rows x {self.seq_len}: " + "; ".join(parts) + skipped


def _absl_flags_parsed() -> None:
    # grain's worker processes read absl flags; a program that never ran absl.app has not
    # parsed them, which grain reports as an error instead of using the defaults.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _own_memory(batch: dict) -> dict:
    # Workers hand batches over in shared memory; copying them out frees each block at once
    # instead of leaving them to teardown (where grain warns about "leaked" blocks).
    return {k: np.array(v) for k, v in batch.items()}


def _close_all(holder: list) -> None:
    while holder:
        holder.pop().close()


def _mean_piece_tokens(source, max_len: int) -> float:
    """Mean tokens per document after cutting, from a fixed sample (the same on every host)."""
    n = len(source)
    idx = np.arange(n) if n <= _SAMPLE_DOCS else np.sort(
        np.random.default_rng(0).choice(n, _SAMPLE_DOCS, replace=False))
    lengths = np.array([len(source[int(i)]["tokens"]) for i in idx])
    mean = float(piece_tokens(lengths, max_len).mean())
    if mean == 0:
        what = f"all {n} documents are" if n <= _SAMPLE_DOCS else f"all {_SAMPLE_DOCS} sampled documents are"
        raise ConfigError(f"{what} empty (no document has two tokens)", source.name)
    return mean


def _rows_per_host(cfg: Config, process_count: int, rows: int | None) -> int:
    if rows is not None:
        if rows <= 0:
            raise ConfigError(f"rows must be positive, got {rows}", "rows")
        return rows
    if cfg.train.batch_size % process_count:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} is not divisible by the "
                          f"{process_count} hosts (process_count)", "train.batch_size")
    return cfg.train.batch_size // process_count


def build_pipeline(cfg: Config, *, split: str, process_index: int = 0, process_count: int = 1,
                   rows: int | None = None) -> DataPipeline:
    """The `split` ("train" or "eval") stream of host `process_index` of `process_count`.

    Hosts read disjoint documents; each yields `rows` rows per batch (default
    train.batch_size // process_count). "eval" holds out a share of every finite source's
    documents (split.HeldOut, independent of data.seed) and draws MQAR from its own seed;
    a source with nothing held out is left out of the eval mixture (see `left_out`).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, {process_count}")
    d = cfg.data
    rows = _rows_per_host(cfg, process_count, rows)
    max_len = d.seq_len + 1
    tokenizer = load_tokenizer(d.tokenizer)
    if any(s.type != "mqar" for s in d.sources) and tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer {d.tokenizer!r} has {tokenizer.vocab_size} ids but model.vocab_size is "
                          f"{cfg.model.vocab_size}; raise model.vocab_size to at least {tokenizer.vocab_size}",
                          "data.tokenizer")

    datasets, infos, left_out, identity_sources = [], [], [], []
    # the eval stream never depends on data.seed: runs of one corpus evaluate on the same rows
    seed = d.seed if split == "train" else 0
    finite_pieces = 0.0  # this host's pieces in one pass over the finite sources (an estimate)
    total_weight = sum(s.weight for s in d.sources)
    for i, s in enumerate(d.sources):
        source = build_source(cfg, i, split, tokenizer)
        if len(source) == 0:
            raise ConfigError("no documents found" + (f" in {', '.join(source.files)}" if hasattr(source, "files")
                                                      else ""), source.name)
        mean = _mean_piece_tokens(source, max_len)
        if s.type == "mqar":
            positions = grain.MapDataset.range(len(source))
        else:
            positions = grain.MapDataset.source(HeldOut(len(source), d.eval_fraction, split))
        if len(positions) == 0:
            if split == "eval":
                left_out.append(source.name)
                continue
            raise ConfigError(f"no {split} documents", source.name)
        if len(positions) < process_count:
            raise ConfigError(f"{len(positions)} {split} documents cannot be shared by {process_count} hosts",
                              source.name)
        ds = positions[process_index::process_count]
        if s.type != "mqar":  # synthetic examples are independent already: nothing to spread
            finite_pieces += len(ds) * max(1.0, mean / max_len)
        ds = ds.shuffle(seed32(seed, i, split == "eval")).repeat().map(source.__getitem__)
        weight = s.weight / total_weight
        datasets.append((ds, weight / mean))
        infos.append(SourceInfo(source.name, len(positions), weight, mean, 0.0, finite=s.type != "mqar"))
        # no paths: a corpus moved to another mount resumes fine; its size still has to match
        identity_sources.append([s.type, s.weight, len(source), len(positions)])
    if not datasets:
        raise ConfigError("no source has documents held out for eval: raise data.eval_fraction, add documents, "
                          "or turn evaluation off", "data.eval_fraction")
    rates = np.array([r for _, r in datasets])
    infos = [dataclasses.replace(info, rate=float(r)) for info, r in zip(infos, rates / rates.sum())]

    mixed = datasets[0][0] if len(datasets) == 1 else grain.MapDataset.mix([ds for ds, _ in datasets], list(rates))
    it = mixed.to_iter_dataset(grain.ReadOptions(num_threads=_READ_THREADS))
    it = gex.FlatMapIterDataset(it, SplitIntoPieces(max_len))
    window = int(min(_WINDOW_PASS_SHARE * finite_pieces, d.shuffle_window // max_len))
    if window > 1:
        it = gex.WindowShuffleIterDataset(it, window_size=window, seed=seed32(seed, split == "eval", 2))
    it = gex.FirstFitPackIterDataset(
        it, length_struct={"tokens": max_len, "loss_mask": max_len}, num_packing_bins=max(rows, d.packing_bins),
        seed=seed32(seed, split == "eval", 1), shuffle_bins=True,
        meta_features=("loss_mask",))  # packed alongside tokens; needs no segment ids of its own
    it = it.batch(rows, drop_remainder=True).map(finish_batch)
    if d.num_workers > 0:
        _absl_flags_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=d.num_workers)).map(_own_memory)
    it = gex.ThreadPrefetchIterDataset(it, prefetch_buffer_size=_BATCH_PREFETCH)

    identity = {"split": split, "data.seq_len": d.seq_len, "data.seed": d.seed, "rows": rows,
                "process_index": process_index, "process_count": process_count,
                "data.eval_fraction": d.eval_fraction, "data.num_workers": d.num_workers,
                "data.packing_bins": d.packing_bins, "data.tokenizer": tokenizer.fingerprint,
                "data.sources": identity_sources}
    if window > 1:  # absent when off: a run started before windows existed resumes with 0
        identity["data.shuffle_window"] = d.shuffle_window
    return DataPipeline(it, tokenizer=tokenizer, split=split, rows=rows, seq_len=d.seq_len, sources=infos,
                        left_out=left_out, identity=identity,
                        pieces_per_pass=float("inf") if any(not i.finite for i in infos) else finite_pieces)
