"""BENCHMARKS.md's tables, generated from the raw results, and the check that BENCHMARKS.md and
README.md quote only figures the results files hold.

    python -m benchmarks.tools.record            # rewrite the generated tables and marked figures
    python -m benchmarks.tools.record --check    # exit 1 naming every figure that differs or cannot be traced

What is generated (the spec, `benchmarks/tools/record_spec.py`, says where each figure comes from):
- a table between `<!-- record:NAME -->` and `<!-- /record:NAME -->` in BENCHMARKS.md: its rows,
  each ending in the results file(s) its figures are read from, and the commands that made them;
- a marked figure `<!--fig:NAME-->TEXT<!--/fig-->` anywhere in BENCHMARKS.md or README.md: TEXT.
Prose outside the markers is written by hand and left alone.

A figure is a value read from one results file under benchmarks/results/ (`J`: a JSON or JSONL
key path; `T`: a regular expression's group in a text file; `Agg`: a mean or count over a JSONL
file's lines), or derived from such values (`Div`, `Sub`, `Sum`), formatted by the spec. The
check fails when a file or key is missing, a pattern matches nothing (or more than once), a
rendered figure differs from the text in the document, a spec table has no markers or markers
name no spec table, or README.md states a ratio or a throughput outside a marked figure (unless
the spec lists it as a constant).

Key paths (`J`): `a.b` a dict key, `[3]` a list index, `[k=v,k2=v2]` the one list element whose
keys equal those values (`[k]` alone: that has key k; `k` may be dotted, `config.block_m`); a JSONL file is the list of its lines.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "benchmarks/results"
DOCS = ("BENCHMARKS.md", "README.md")


class TraceError(Exception):
    """A figure that cannot be read from its results file (one line, naming file and key)."""


# --- reading the results files ------------------------------------------------------------------

_cache: dict[Path, object] = {}


def _load(results: Path, path: str):
    f = results / path
    if f not in _cache:
        if not f.is_file():
            raise TraceError(f"{RESULTS}/{path}: no such file")
        text = f.read_text()
        if f.suffix == ".jsonl":
            try:
                _cache[f] = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as e:
                raise TraceError(f"{RESULTS}/{path}: not JSON lines ({e})") from None
        elif f.suffix == ".json":
            try:
                _cache[f] = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceError(f"{RESULTS}/{path}: not JSON ({e})") from None
        else:
            _cache[f] = text
    return _cache[f]


_SEGMENT = re.compile(r"\[([^\]]*)\]|([^.\[\]]+)")


def _equal(have, want: str) -> bool:
    if isinstance(have, bool) or have is None:
        return str(have).lower() == want.lower()
    if isinstance(have, (int, float)):
        try:
            return float(have) == float(want)
        except ValueError:
            return False
    return str(have) == want


def _field(d, dotted: str):
    for k in dotted.split("."):
        d = d[k]
    return d


def _has(d, dotted: str) -> bool:
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return False
        d = d[k]
    return True


def walk(data, key: str, where: str):
    """The value at `key` (the module docstring's path syntax) in `data`; `where` names the file."""
    pos = 0
    for m in _SEGMENT.finditer(key):
        if m.start() != pos and key[pos : m.start()] != ".":
            raise TraceError(f"{where}: bad key path {key!r}")
        pos = m.end()
        sel, name = m.groups()
        if name is not None:
            if not isinstance(data, dict) or name not in data:
                raise TraceError(f"{where}: no key {name!r} in {key!r}")
            data = data[name]
        elif re.fullmatch(r"-?\d+", sel):
            if not isinstance(data, list) or not -len(data) <= int(sel) < len(data):
                raise TraceError(f"{where}: no item [{sel}] in {key!r}")
            data = data[int(sel)]
        else:
            if not isinstance(data, list):
                raise TraceError(f"{where}: [{sel}] selects from a list, found {type(data).__name__} in {key!r}")
            conds = [c.strip().split("=", 1) for c in sel.split(",")]
            hits = [
                d for d in data if all(_has(d, c[0]) and (len(c) == 1 or _equal(_field(d, c[0]), c[1])) for c in conds)
            ]
            if len(hits) != 1:
                raise TraceError(f"{where}: [{sel}] matches {len(hits)} items, not one, in {key!r}")
            data = hits[0]
    if pos != len(key):
        raise TraceError(f"{where}: bad key path {key!r}")
    return data


class Value:
    """A number (or text) read from the results files."""

    def get(self, results: Path):
        raise NotImplementedError

    def files(self) -> tuple[str, ...]:
        raise NotImplementedError


@dataclass(frozen=True)
class J(Value):
    """The value at `key` in the JSON or JSONL file `path` (under benchmarks/results/)."""

    path: str
    key: str

    def get(self, results):
        v = walk(_load(results, self.path), self.key, f"{RESULTS}/{self.path}")
        if isinstance(v, (dict, list)):
            raise TraceError(f"{RESULTS}/{self.path}: {self.key!r} is a {type(v).__name__}, not a figure")
        if isinstance(v, float) and v != v:
            raise TraceError(f"{RESULTS}/{self.path}: {self.key!r} is NaN")
        return v

    def files(self):
        return (self.path,)


@dataclass(frozen=True)
class T(Value):
    """Group 1 of `pattern` in the text file `path`: it must match exactly once (or `nth` match)."""

    path: str
    pattern: str
    nth: int | None = None

    def get(self, results):
        text = _load(results, self.path)
        if not isinstance(text, str):
            raise TraceError(f"{RESULTS}/{self.path}: a JSON file; read it with J")
        hits = list(re.finditer(self.pattern, text, re.M))
        if self.nth is None and len(hits) != 1:
            raise TraceError(f"{RESULTS}/{self.path}: /{self.pattern}/ matches {len(hits)} times, not once")
        if self.nth is not None and not -len(hits) <= self.nth < len(hits):
            raise TraceError(f"{RESULTS}/{self.path}: /{self.pattern}/ has no match [{self.nth}]")
        s = hits[self.nth or 0].group(1).replace(",", "")
        try:
            return float(s)
        except ValueError:
            return s

    def files(self):
        return (self.path,)


@dataclass(frozen=True)
class Agg(Value):
    """Over the lines of JSONL `path` that have `key`: `mean_last` (mean of the last n values),
    `count_positive` (lines whose value, or sum of its list, is > 0), `count`, or, for a key
    holding one value per layer, `max_since` / `mean_since` (from the lines at step >= n: the
    largest value of any layer, or the mean over the lines of the mean over the layers)."""

    path: str
    key: str
    how: str
    n: int | None = None

    def get(self, results):
        lines = _load(results, self.path)
        if not isinstance(lines, list):
            raise TraceError(f"{RESULTS}/{self.path}: not a JSONL file")
        if self.how in ("max_since", "mean_since"):
            rows = [d[self.key] for d in lines
                    if isinstance(d, dict) and isinstance(d.get(self.key), list) and d.get("step", -1) >= self.n]
            if not rows:
                raise TraceError(f"{RESULTS}/{self.path}: no line at step >= {self.n} has a list {self.key!r}")
            if self.how == "max_since":
                return max(max(r) for r in rows)
            return sum(sum(r) / len(r) for r in rows) / len(rows)
        vals = [
            sum(d[self.key]) if isinstance(d[self.key], list) else d[self.key]
            for d in lines
            if isinstance(d, dict) and self.key in d
        ]
        if not vals:
            raise TraceError(f"{RESULTS}/{self.path}: no line has {self.key!r}")
        if self.how == "mean_last":
            if len(vals) < self.n:
                raise TraceError(f"{RESULTS}/{self.path}: {len(vals)} lines have {self.key!r}, not {self.n}")
            return sum(vals[-self.n :]) / self.n
        if self.how == "count_positive":
            return sum(v > 0 for v in vals)
        if self.how == "count":
            return len(vals)
        raise TraceError(f"{RESULTS}/{self.path}: unknown aggregate {self.how!r}")

    def files(self):
        return (self.path,)


@dataclass(frozen=True)
class Const(Value):
    """A number in a derived figure (a count, a unit); it reads no file."""

    n: float

    def get(self, results):
        return self.n

    def files(self):
        return ()


@dataclass(frozen=True)
class _Op(Value):
    args: tuple

    def files(self):
        return tuple(f for a in self.args for f in a.files())

    def nums(self, results):
        vals = [a.get(results) for a in self.args]
        for a, v in zip(self.args, vals):
            if not isinstance(v, (int, float)):
                raise TraceError(f"{RESULTS}/{a.files()[0]}: {v!r} is not a number")
        return vals


class Div(_Op):
    """a / b."""

    def __init__(self, a: Value, b: Value):
        super().__init__((a, b))

    def get(self, results):
        a, b = self.nums(results)
        return a / b


class Sub(_Op):
    """a - b."""

    def __init__(self, a: Value, b: Value):
        super().__init__((a, b))

    def get(self, results):
        a, b = self.nums(results)
        return a - b


class Sum(_Op):
    """The sum of the values."""

    def __init__(self, *values: Value):
        super().__init__(tuple(values))

    def get(self, results):
        return sum(self.nums(results))


# --- formatting -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fig:
    """One value as the document prints it: fmt.format(value * scale)."""

    value: Value
    fmt: str = "{:g}"
    scale: float = 1.0

    def render(self, results: Path) -> str:
        v = self.value.get(results)
        return self.fmt.format(v * self.scale if isinstance(v, (int, float)) and self.scale != 1 else v)

    def files(self):
        return self.value.files()


@dataclass(frozen=True)
class Range:
    """The smallest and largest of several values, "lo–hi" (one figure when they print alike)."""

    values: tuple
    fmt: str = "{:g}"
    scale: float = 1.0
    sep: str = "–"
    unit: str = ""

    def render(self, results: Path) -> str:
        vals = [v.get(results) for v in self.values]
        lo, hi = (self.fmt.format(x * self.scale) for x in (min(vals), max(vals)))
        return (lo if lo == hi else f"{lo}{self.sep}{hi}") + self.unit

    def files(self):
        return tuple(f for v in self.values for f in v.files())


@dataclass(frozen=True)
class Cat:
    """Text and figures in one cell, e.g. Cat(Fig(compile), " (", Fig(lower), ")")."""

    parts: tuple

    def __init__(self, *parts):
        object.__setattr__(self, "parts", parts)

    def render(self, results: Path) -> str:
        return "".join(p if isinstance(p, str) else p.render(results) for p in self.parts)

    def files(self):
        return tuple(f for p in self.parts if not isinstance(p, str) for f in p.files())


def ms(path: str, key: str = "step_ms") -> Fig:
    return Fig(J(path, key), "{:.1f}")


def pct(value: Value, digits: int = 1) -> Fig:
    return Fig(value, "{:.%df} %%" % digits, 100.0)


def ratio(a: Value, b: Value, digits: int = 2, unit: str = "×") -> Fig:
    return Fig(Div(a, b), "{:.%df}%s" % (digits, unit))


# --- tables ---------------------------------------------------------------------------------------

Cell = "str | Fig | Range"


@dataclass(frozen=True)
class Table:
    """A table of BENCHMARKS.md: its header, its rows (literal text or figures; a results column
    naming each row's files is added) and the commands that made those files."""

    name: str
    header: tuple[str, ...]
    rows: tuple[tuple, ...]
    commands: tuple[str, ...] = ()
    results_column: bool = True

    def __post_init__(self):
        for row in self.rows:
            if len(row) != len(self.header):
                raise ValueError(f"table {self.name}: row {row[0]!r} has {len(row)} cells, header {len(self.header)}")
            if self.results_column and not _row_files(row):
                raise ValueError(f"table {self.name}: row {row[0]!r} reads no results file")

    def label(self, i: int) -> str:
        return self.rows[i][0] if isinstance(self.rows[i][0], str) else f"row {i + 1}"

    def render_rows(self, results: Path) -> list[str]:
        out = []
        for i, row in enumerate(self.rows):
            cells = []
            for c in row:
                if isinstance(c, str):
                    cells.append(c)
                else:
                    try:
                        cells.append(c.render(results))
                    except TraceError as e:
                        raise TraceError(f"table {self.name}, row {self.label(i)!r}: {e}") from None
            if self.results_column:
                cells.append(", ".join(f"`{f}`" for f in _row_files(row)))
            out.append("| " + " | ".join(cells) + " |")
        return out

    def render(self, results: Path) -> str:
        head = list(self.header) + (["results (`benchmarks/results/`)"] if self.results_column else [])
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + self.render_rows(results)
        if self.commands:  # as a code block: from the repository root, on the GPU machine unless said
            lines += [""] + ["    " + c for c in self.commands]
        return "\n".join(lines) + "\n"


def _row_files(row) -> list[str]:
    seen: list[str] = []
    for c in row:
        for f in () if isinstance(c, str) else c.files():
            if f and f not in seen:
                seen.append(f)
    return seen


# --- the documents --------------------------------------------------------------------------------

BLOCK = re.compile(r"<!-- record:([\w-]+) -->\n(.*?)<!-- /record:([\w-]+) -->", re.S)
SPAN = re.compile(r"<!--fig:([\w.-]+)-->(.*?)<!--/fig-->", re.S)
# a ratio (1.12×, 0.87x) or a throughput (70.3 k tokens/s, 92,841 tokens/s) in README's prose
# (a shape, 8×4096 or 16 × 4096, is no ratio: a ratio is written 1.12× and not followed by a number)
README_FIGURE = re.compile(
    r"\d[\d,.]*(?:–[\d,.]+)?(?:×|x\b)(?!\s?\d)"
    r"|\d[\d,.]*(?:–[\d,.]+)?\s?k?\s?tokens/s"
    r"|\d[\d,.]*(?:–[\d,.]+)?\s?(?:ms|TFLOP/s)\b"
)


@dataclass
class Spec:
    tables: dict[str, Table]
    figures: dict[str, object]  # name -> Fig | Range
    readme_constants: tuple[str, ...] = ()  # README figures that are no measurement (a chip's spec)
    results: Path = field(default_factory=lambda: ROOT / RESULTS)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _rendered(m: re.Match, text: str, spec: Spec, name: str, tables: bool) -> tuple[str | None, str | None, str]:
    """(what a block or span should read, or None; the error, or None; where it is) for a match
    of BLOCK or SPAN in a document."""
    where = f"{name}:{_line(text, m.start())}"
    if m.re is BLOCK:
        tname, _, end = m.groups()
        if end != tname:
            return None, f"{where}: <!-- record:{tname} --> closed by /record:{end}", where
        if not tables or tname not in spec.tables:
            return (
                None,
                (
                    f"{where}: record:{tname} is no table of the spec"
                    + ("" if tables else f" (tables belong in {DOCS[0]})")
                ),
                where,
            )
        thing = spec.tables[tname]
    else:
        where += f": fig:{m.group(1)}"
        if m.group(1) not in spec.figures:
            return None, f"{where} is no figure of the spec", where
        thing = spec.figures[m.group(1)]
    try:
        return thing.render(spec.results), None, where
    except TraceError as e:
        return None, f"{where}: {e}", where


def _missing_tables(text: str, spec: Spec, name: str) -> list[str]:
    present = {m.group(1) for m in BLOCK.finditer(text)}
    return [f"{name}: the spec's table {t} has no <!-- record:{t} --> block" for t in spec.tables if t not in present]


def generate(text: str, spec: Spec, name: str, tables: bool) -> tuple[str, list[str]]:
    """(the document with its generated tables and marked figures rewritten, the errors)."""
    errors: list[str] = []

    def sub(m):
        want, err, _ = _rendered(m, text, spec, name, tables)
        if err:
            errors.append(err)
            return m.group(0)
        if m.re is BLOCK:
            return f"<!-- record:{m.group(1)} -->\n{want}<!-- /record:{m.group(1)} -->"
        return f"<!--fig:{m.group(1)}-->{want}<!--/fig-->"

    out = SPAN.sub(sub, BLOCK.sub(sub, text))
    return out, errors + (_missing_tables(text, spec, name) if tables else [])


def untraced_readme_figures(text: str, spec: Spec, name: str) -> list[str]:
    """README figures (ratios, throughputs, times) outside a marked figure and not a listed constant."""
    bare = SPAN.sub(lambda m: " " * len(m.group(0)), text)
    bare = re.sub(r"```.*?```", lambda m: " " * len(m.group(0)), bare, flags=re.S)  # commands, logs
    for c in spec.readme_constants:
        bare = bare.replace(c, " " * len(c))
    return [
        f"{name}:{_line(bare, m.start())}: {m.group(0)!r} is not a marked figure (fig:NAME of the spec) "
        f"nor a constant of the spec"
        for m in README_FIGURE.finditer(bare)
    ]


def check_doc(text: str, spec: Spec, name: str, tables: bool) -> list[str]:
    """The errors of one document: each generated table or marked figure that cannot be traced, or
    that reads otherwise than its results give (naming the line and the results files)."""
    errors = []
    for m in list(BLOCK.finditer(text)) + list(SPAN.finditer(text)):
        want, err, where = _rendered(m, text, spec, name, tables)
        if err:
            errors.append(err)
        elif m.re is BLOCK:
            have, want, line = m.group(2).splitlines(), want.splitlines(), _line(text, m.start())
            errors += [
                f"{name}:{line + 1 + i}: table {m.group(1)} reads\n    {h}\n  where its results give\n    {w}"
                for i, (h, w) in enumerate(zip(have, want))
                if h != w
            ]
            if len(have) != len(want):
                errors.append(
                    f"{where}: table {m.group(1)} has {len(have)} lines, its spec {len(want)} "
                    f"(rows or commands added or removed: python -m benchmarks.tools.record)"
                )
        elif m.group(2) != want:
            files = ", ".join(f"{RESULTS}/{f}" for f in dict.fromkeys(spec.figures[m.group(1)].files()))
            errors.append(f"{where} reads {m.group(2)!r}; {files} give {want!r}")
    return errors + (_missing_tables(text, spec, name) if tables else [])


def check(spec: Spec, docs: dict[str, str]) -> list[str]:
    """Every error of the documents against the results (empty: all traced and equal)."""
    _cache.clear()
    errors = []
    for name, text in docs.items():
        errors += check_doc(text, spec, name, tables=name == DOCS[0])
        if name == DOCS[1]:
            errors += untraced_readme_figures(text, spec, name)
    return errors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tools.record",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 on any figure that differs or " "cannot be traced"
    )
    p.add_argument(
        "--root",
        type=Path,
        default=ROOT,
        help="the repository (its BENCHMARKS.md, README.md and " "benchmarks/results/)",
    )
    a = p.parse_args(argv)
    from benchmarks.tools.record_spec import spec

    s = spec(a.root / RESULTS)
    docs = {n: (a.root / n).read_text() for n in DOCS}
    if a.check:
        errors = check(s, docs)
        for e in errors:
            print(e)
        print(
            f"record: {len(errors)} figure(s) differ or cannot be traced"
            if errors
            else f"record: every table and marked figure of {' and '.join(DOCS)} matches benchmarks/results/"
        )
        return 1 if errors else 0
    _cache.clear()
    failed = False
    for n, text in docs.items():
        new, errs = generate(text, s, n, tables=n == DOCS[0])
        for e in errs:
            print(e)
        failed |= bool(errs)
        if new != text:
            (a.root / n).write_text(new)
            print(f"record: rewrote {n}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
