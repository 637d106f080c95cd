"""k3jax-data: tokenize text once into ArrayRecord shards that `type: arrayrecord` sources read.

    k3jax-data --output data/tok [--tokenizer bytes|FILE] [--shards N] [--text-key text] INPUT ...
    k3jax-data --output data/stdlib --stdlib

INPUTs are files, directories or globs: `.jsonl` (one document per line), `.parquet` (one per
row) or plain text (one per file). Documents keep their input order and are cut into N
contiguous shards, so reading the shards in order gives the documents in order. The sidecar
`k3jax-data.json` (written last: a run that died leaves none) records the tokenizer.

Progress: a redrawn bar when stdout and stderr are terminals, else (a pipe, a file, nohup) a
plain line at each tenth of the documents, as k3jax-train decides (train.metrics.draws_bar).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import numpy as np
from tqdm import tqdm

from k3jax.config.errors import ConfigError
from train.data.shards import SIDECAR, SUFFIX, WRITER_OPTIONS, shard_name, write_sidecar
from train.data.files import expand_paths
from train.data.text import TEXT_SUFFIXES, TextSource, stdlib_files
from train.data.tokenizers import Tokenizer, load_tokenizer
from train.metrics import draws_bar

EXIT_BAD_INPUT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3jax-data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="text/JSONL/Parquet files, directories or globs")
    p.add_argument("--output", required=True, metavar="DIR", help="directory for the shards and sidecar")
    p.add_argument("--tokenizer", default="bytes", help="'bytes', a tokenizer.json or a sentencepiece .model")
    p.add_argument("--shards", type=int, default=1, metavar="N", help="number of shards (default 1)")
    p.add_argument("--text-key", default="text", help="JSONL field / Parquet column holding the text")
    p.add_argument("--stdlib", action="store_true", help="add the Python standard library's .py files")
    p.add_argument("--overwrite", action="store_true", help="replace shards already in --output")
    return p


def prepare(inputs: list[str], output: str, tokenizer: Tokenizer, *, shards: int = 1, text_key: str = "text",
            stdlib: bool = False, overwrite: bool = False, progress: bool = True) -> dict:
    """Write the shards and sidecar; returns the summary (documents, tokens, shards, output)."""
    if shards <= 0:
        raise ConfigError(f"must be positive, got {shards}", "--shards")
    if not inputs and not stdlib:
        raise ConfigError("no input: name files, directories or globs, or pass --stdlib")
    files = expand_paths(inputs, "INPUT", TEXT_SUFFIXES) + (stdlib_files() if stdlib else [])
    source = TextSource((), tokenizer, text_key=text_key, where="INPUT", files=files)
    if len(source) == 0:
        raise ConfigError(f"no documents found in {len(files)} input file(s)")
    os.makedirs(output, exist_ok=True)
    old = glob.glob(os.path.join(output, f"*{SUFFIX}")) + glob.glob(os.path.join(output, SIDECAR))
    if old and not overwrite:
        raise ConfigError(f"{output} already holds k3jax-data output; pass --overwrite or choose another --output")
    for path in old:
        os.remove(path)

    from array_record.python.array_record_module import ArrayRecordWriter

    num_docs = len(source)
    shards = min(shards, num_docs)
    # contiguous blocks of documents: shard s holds [bounds[s], bounds[s + 1])
    bounds = [num_docs * s // shards for s in range(shards + 1)]
    counts, tokens = {}, 0
    with _Progress(num_docs, progress) as bar:
        for s in range(shards):
            name = shard_name(s, shards)
            writer = ArrayRecordWriter(os.path.join(output, name), WRITER_OPTIONS)
            try:
                for i in range(bounds[s], bounds[s + 1]):
                    ids = source[i]["tokens"]
                    writer.write(np.asarray(ids, np.int32).tobytes())
                    tokens += len(ids)
                    bar.update(tokens)
            finally:
                writer.close()
            counts[name] = bounds[s + 1] - bounds[s]
    write_sidecar(output, tokenizer, counts, tokens)
    return {"documents": num_docs, "tokens": tokens, "shards": shards, "output": output}


class _Progress:
    """A tqdm bar on a terminal; elsewhere a plain line on stdout at each tenth of the documents
    (`k3jax-data: 300/3,000 documents, 81,920 tokens`), so a log file holds no redraws."""

    def __init__(self, total: int, progress: bool):
        self.total, self.done = total, 0
        self.bar = tqdm(total=total, unit="doc", desc="k3jax-data", file=sys.stderr) if draws_bar(progress) else None
        self.lines = progress and self.bar is None
        self.next_line = 1  # in tenths of the documents

    def update(self, tokens: int) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()
            self.bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
        elif self.lines and self.done < self.total and self.done * 10 >= self.next_line * self.total:  # main() says the end
            print(f"k3jax-data: {self.done:,}/{self.total:,} documents, {tokens:,} tokens", flush=True)
            self.next_line = self.done * 10 // self.total + 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_intermixed_args(argv)
    try:
        tokenizer = load_tokenizer(a.tokenizer, where="--tokenizer")
        s = prepare(a.inputs, a.output, tokenizer, shards=a.shards, text_key=a.text_key, stdlib=a.stdlib,
                    overwrite=a.overwrite)
    except ConfigError as e:
        # input problems already name their file; the sources' internal keys would only confuse
        where = e.where if e.where and not e.where.startswith("INPUT") else None
        print(f"k3jax-data: {where + ': ' if where else ''}{e.message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"k3jax-data: {s['documents']:,} documents, {s['tokens']:,} tokens ({tokenizer.spec}, vocab "
          f"{tokenizer.vocab_size}) in {s['shards']} shard(s) in {s['output']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
