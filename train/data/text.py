"""Raw-text document sources, tokenized on the fly: files/JSONL/Parquet, and the Python stdlib.

Start-up builds only an index of where each document lives (file, byte range or row);
`__getitem__` reads one document, so memory stays flat however large the files are.
"""

from __future__ import annotations

import json
import os
import sysconfig
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np

from k3jax.config.errors import ConfigError
from train.data.files import expand_paths
from train.data.tokenizers import Tokenizer, needs_text_extra

TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")
_CHUNK = 1 << 24  # bytes scanned at a time when indexing JSONL lines
_ROW_GROUP_CACHE = 8  # decoded Parquet row groups kept per source


def _kind(path: str) -> str:
    if path.endswith(".jsonl"):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    return "file"  # .txt and anything else: the whole file is one document


def _line_ranges(path: str) -> tuple[np.ndarray, np.ndarray]:
    """[start, stop) byte ranges of the non-blank lines of a file, without reading it whole."""
    starts, stops = [], []
    offset, line_start = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            newlines = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + offset
            if newlines.size:
                starts.append(np.concatenate([[line_start], newlines[:-1] + 1]))
                stops.append(newlines)
                line_start = int(newlines[-1]) + 1
            offset += len(chunk)
    if offset > line_start:
        starts.append(np.array([line_start]))
        stops.append(np.array([offset]))
    if not starts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    a, b = np.concatenate(starts).astype(np.int64), np.concatenate(stops).astype(np.int64)
    keep = b - a >= 2  # "{}" is the shortest JSON object; shorter lines are blank ("", "\r")
    return a[keep], b[keep]


def _read_range(path: str, start: int, stop: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(stop - start)


class TextSource:
    """Documents from text files; `__getitem__(i)` -> dict(tokens=int32[n], loss_mask=int32[n]).

    `.jsonl`: one document per line (field `text_key`); `.parquet`: one per row (column
    `text_key`, needs pyarrow); any other file (`.txt`, `.md`, `.py`, ...) is one document.
    Directories contribute their .txt/.md/.jsonl/.parquet files. Each document is encoded with
    `tokenizer` and ends with its EOS; loss_mask is all ones.
    """

    def __init__(self, paths: Sequence[str], tokenizer: Tokenizer, *, text_key: str = "text",
                 where: str = "data.sources.0", files: Sequence[str] | None = None, kind: str = "text"):
        self.name = f"{where} ({kind})"
        self.tokenizer, self.text_key, self._where = tokenizer, text_key, where
        self.files = list(files) if files is not None else expand_paths(paths, f"{where}.paths", TEXT_SUFFIXES)
        self._kinds = [_kind(p) for p in self.files]
        file_ids, starts, stops = [], [], []
        for i, (path, kind) in enumerate(zip(self.files, self._kinds)):
            if kind == "jsonl":
                a, b = _line_ranges(path)
                if a.size:
                    self._check_jsonl(path, json.loads(_read_range(path, a[0], b[0])))
            elif kind == "parquet":
                a, b = self._index_parquet(path)
            else:
                size = os.path.getsize(path)
                a, b = (np.array([0]), np.array([size])) if size else (np.zeros(0), np.zeros(0))
            file_ids.append(np.full(a.size, i, np.int32))
            starts.append(a.astype(np.int64))
            stops.append(b.astype(np.int64))
        # [num_docs] each: which file, and a byte range (or, for Parquet, row group and row)
        self._file = np.concatenate(file_ids) if file_ids else np.zeros(0, np.int32)
        self._start = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self._stop = np.concatenate(stops) if stops else np.zeros(0, np.int64)
        self._row_groups: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._file.size)

    def __getitem__(self, index: int) -> dict:
        tokens = self.tokenizer.encode_document(self.text(index))
        return {"tokens": tokens, "loss_mask": np.ones_like(tokens)}

    def text(self, index: int) -> str:
        """The raw text of document `index`."""
        f, a, b = int(self._file[index]), int(self._start[index]), int(self._stop[index])
        path, kind = self.files[f], self._kinds[f]
        if kind == "parquet":
            return self._parquet_rows(f, a)[b]
        raw = _read_range(path, a, b)
        if kind == "file":
            return raw.decode("utf-8", errors="replace")
        if not raw.strip():  # a whitespace-only line: an empty document, skipped downstream
            return ""
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: the line at byte {a} is not JSON ({e})", f"{self._where}.paths") from None
        return self._check_jsonl(path, row, a)

    def _check_jsonl(self, path: str, row, at: int = 0) -> str:
        text = row.get(self.text_key) if isinstance(row, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f"{path}: the line at byte {at} has no string field {self.text_key!r}",
                              f"{self._where}.text_key")
        return text

    def _index_parquet(self, path: str) -> tuple[np.ndarray, np.ndarray]:
        pq = _pyarrow_parquet(path, f"{self._where}.paths")
        meta = pq.ParquetFile(path).metadata
        if self.text_key not in meta.schema.names:
            raise ConfigError(f"{path} has no column {self.text_key!r} (columns: {', '.join(meta.schema.names)})",
                              f"{self._where}.text_key")
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        groups = np.repeat(np.arange(len(sizes)), sizes)
        rows = np.concatenate([np.arange(n) for n in sizes]) if sizes else np.zeros(0, np.int64)
        return groups, rows

    def _parquet_rows(self, file: int, group: int) -> list:
        # Reading is per row group; a few decoded groups are kept because neighbouring rows
        # are often asked for together (prepared ArrayRecord shards avoid this entirely).
        key = (file, group)
        with self._lock:
            if key in self._row_groups:
                self._row_groups.move_to_end(key)
                return self._row_groups[key]
        pq = _pyarrow_parquet(self.files[file], f"{self._where}.paths")
        table = pq.ParquetFile(self.files[file]).read_row_group(group, columns=[self.text_key])
        rows = [t if isinstance(t, str) else "" for t in table.column(0).to_pylist()]
        with self._lock:
            self._row_groups[key] = rows
            while len(self._row_groups) > _ROW_GROUP_CACHE:
                self._row_groups.popitem(last=False)
        return rows

    def __getstate__(self):  # grain worker processes get a copy without the cache or lock
        state = self.__dict__.copy()
        state["_row_groups"], state["_lock"] = OrderedDict(), None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _pyarrow_parquet(path: str, where: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(needs_text_extra("pyarrow", path), where) from None
    return pq


# directories of the standard library that are not its own source: installed packages,
# bytecode, and test suites (odd encodings, generated data)
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_files() -> list[str]:
    """The running Python's standard-library `.py` files, sorted (the same list on every call)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _STDLIB_SKIP]
        out += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return sorted(out)


class StdlibSource(TextSource):
    """Real text every machine has: one document per standard-library `.py` file.

    The corpus is whatever Python runs the job (about 800 files, 12 MB for 3.11), so runs on
    different Python versions see different data.
    """

    def __init__(self, tokenizer: Tokenizer, *, where: str = "data.sources.0"):
        files = stdlib_files()
        if not files:
            raise ConfigError(f"no standard-library .py files under {sysconfig.get_paths()['stdlib']}", where)
        super().__init__((), tokenizer, where=where, files=files, kind="stdlib")
