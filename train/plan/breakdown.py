"""What a compiled program's memory peak holds, by the code that made each buffer.

XLA writes, beside a compiled module (`xla_dump_to`), its buffers' live ranges and the set
live at the peak (`*-live-range.txt`), and the optimized HLO whose instructions carry the
Python stack frame that traced them. `peak_breakdown` joins the two: every buffer live at the
peak is named by the innermost frame in this project (file and function), whether the forward
or the backward made it, and whether a loop stacks it (a scan's saved residuals), then the
bytes are summed per name. k3jax-plan prints the result as the compiled terms of its table.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

_PEAK = re.compile(r"^\s*Live ranges at \d+ \(peak\):\s*$")
_LIVE = re.compile(r"^\s+(\S+?)\{[^}]*\}: (\d+) bytes")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")


@dataclass(frozen=True)
class Site:
    op: str          # the HLO opcode (fusion, parameter, copy, ...)
    op_name: str     # JAX's name stack ("jit(step)/while/body/transpose(jvp(...))/dot_general")
    frame: int       # stack_frame_id, 0 when absent


def _tables(text: str) -> tuple[dict, dict, dict, dict]:
    """The module's FileNames, FunctionNames, FileLocations and StackFrames tables."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        if current is not None:
            m = _TABLE_ROW.match(line)
            if m:
                current[int(m.group(1))] = m.group(2)
            elif line.strip() == "":
                continue
            else:
                current = None
    return (tables.get("FileNames", {}), tables.get("FunctionNames", {}), tables.get("FileLocations", {}),
            tables.get("StackFrames", {}))


def _field(row: str, name: str) -> int:
    m = re.search(rf"{name}=(\d+)", row)
    return int(m.group(1)) if m else 0


class FrameResolver:
    """stack_frame_id -> the innermost frame whose file lies under one of `roots`."""

    def __init__(self, text: str, roots: tuple[str, ...]):
        self.files, self.functions, self.locations, self.frames = _tables(text)
        self.roots = tuple(os.path.abspath(r) + os.sep for r in roots)
        self._cache: dict[int, str | None] = {}

    def project_site(self, frame: int) -> str | None:
        if frame in self._cache:
            return self._cache[frame]
        seen, fid, found = set(), frame, None
        while fid and fid not in seen:
            seen.add(fid)
            row = self.frames.get(fid)
            if row is None:
                break
            loc = self.locations.get(_field(row, "file_location_id"), "")
            path = self.files.get(_field(loc, "file_name_id"), "").strip('"')
            for root in self.roots:
                if os.path.abspath(path).startswith(root):
                    func = self.functions.get(_field(loc, "function_name_id"), "").strip('"')
                    found = f"{os.path.relpath(os.path.abspath(path), root)}:{func}"
                    break
            if found:
                break
            fid = _field(row, "parent_frame_id")
        self._cache[frame] = found
        return found


def _after_shape(line: str, i: int) -> int:
    """The index just past the HLO shape that starts at line[i] (a tuple shape is parenthesised
    and may hold spaces; layouts and memory spaces follow in braces)."""
    if line.startswith("(", i):
        depth = 0
        for j in range(i, len(line)):
            depth += {"(": 1, ")": -1}.get(line[j], 0)
            if depth == 0:
                return j + 1
        return len(line)
    j = i
    while j < len(line) and line[j] != " ":
        if line[j] == "{":
            j = line.find("}", j)
            if j < 0:
                return len(line)
        j += 1
    return j


def instruction_sites(text: str) -> dict[str, Site]:
    out = {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name = m.group(1)
        o = _OPCODE.match(line, _after_shape(line, m.end()))
        if not o:
            continue
        op = o.group(1)
        on = _OP_NAME.search(line)
        fr = _FRAME.search(line)
        out[name] = Site(op, on.group(1) if on else "", int(fr.group(1)) if fr else 0)
    return out


def peak_buffers(live_range_text: str) -> list[tuple[str, int]]:
    """(instruction name, bytes) of every buffer live at the peak."""
    out, inside = [], False
    for line in live_range_text.splitlines():
        if _PEAK.match(line):
            inside = True
            continue
        if inside:
            m = _LIVE.match(line)
            if not m:
                if line.strip().startswith("Stack trace") or not line.strip():
                    break
                continue
            out.append((m.group(1), int(m.group(2))))
    return out


def _phase(op_name: str) -> str:
    """forward / backward of the differentiated model, else the rest of the step (the optimizer
    update, statistics, the loops' bookkeeping)."""
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "step"


def label(site: Site | None, resolver: FrameResolver) -> str:
    """A buffer's name in the breakdown: phase, project code site, and 'stacked by a loop'
    for a loop body's dynamic-update-slice into a stacked buffer (a scan's saved residuals)."""
    if site is None:
        return "other: buffers without a traced origin"
    if site.op == "parameter" and "/" not in site.op_name:
        return "arguments: the train state and the batch"
    where = resolver.project_site(site.frame) if site.frame else None
    phase = _phase(site.op_name)
    stacked = "dynamic_update_slice" in site.op_name and "/while/body/" in site.op_name
    what = where or (site.op_name.rsplit("/", 1)[-1] if site.op_name else f"XLA {site.op}")
    if stacked:
        return f"{phase}: saved for the backward, stacked by a scan ({what})"
    if site.op == "while":
        return f"loop state carried by a while loop ({what})"
    return f"{phase}: {what}"


def peak_breakdown(dump_dir: str, roots: tuple[str, ...], module_glob: str = "*") -> tuple[int, list[tuple[str, int]]]:
    """(peak bytes, [(name, bytes)] largest first) of the module dumped in `dump_dir` whose
    file name matches `module_glob` (the largest such module when several match)."""
    lives = glob.glob(os.path.join(dump_dir, f"{module_glob}after_optimizations-live-range.txt"))
    if not lives:
        raise FileNotFoundError(f"no live-range dump in {dump_dir}")
    live = max(lives, key=os.path.getsize)
    hlo = live.replace("-live-range.txt", ".txt")
    with open(live) as f:
        buffers = peak_buffers(f.read())
    with open(hlo) as f:
        text = f.read()
    sites, resolver = instruction_sites(text), FrameResolver(text, roots)
    sums: dict[str, int] = {}
    for name, nbytes in buffers:
        key = label(sites.get(name), resolver)
        sums[key] = sums.get(key, 0) + nbytes
    return sum(b for _, b in buffers), sorted(sums.items(), key=lambda kv: -kv[1])
