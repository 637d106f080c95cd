"""Which source line made each instruction of an optimized HLO module (its stack frames).

    sources = hlo_sources(open("step.hlo").read())
    # {"input_reduce_fusion.12": "k3jax/layers/norms.py:15 rms_normalize", ...}

`compiled.as_text()` ends with FileNames / FunctionNames / FileLocations / StackFrames
tables, and every instruction's metadata names its innermost frame (`stack_frame_id`).
Each instruction is attributed to its innermost frame inside this repository (k3jax/,
train/, benchmarks/), skipping jax/optax/flax internals. `benchmarks/tools/profile_summary.py
--hlo` uses it to put a profile's kernels against the lines that made them.
"""

from __future__ import annotations

import re

OURS = re.compile(r"(?:^|/)((?:k3jax|train|benchmarks)/[\w/]+\.py)$")


def _tables(lines):
    sec, out = None, {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    for line in lines:
        if line in out:
            sec = line
            continue
        m = re.match(r"(\d+) (.*)", line)
        if sec and m:
            out[sec][int(m.group(1))] = m.group(2)
    return out


def hlo_sources(text: str, depth: int = 1) -> dict[str, str]:
    """instruction name -> "path:line function" of its innermost frame in this repository;
    with depth > 1, that many of its frames in this repository, innermost first, joined by " < "."""
    lines = text.split("\n")
    t = _tables(lines[next((i for i, l in enumerate(lines) if l == "FileNames"), len(lines)):])
    files = {k: v.strip('"') for k, v in t["FileNames"].items()}
    funcs = {k: v.strip('"') for k, v in t["FunctionNames"].items()}
    locs = {}
    for k, v in t["FileLocations"].items():
        d = dict(re.findall(r"(\w+)=(\d+)", v))
        locs[k] = (files.get(int(d["file_name_id"]), "?"), funcs.get(int(d["function_name_id"]), "?"), int(d["line"]))
    frames = {k: tuple(int(x) for x in re.findall(r"=(\d+)", v)[:2]) for k, v in t["StackFrames"].items()}

    def ours(fid):
        seen, found = set(), []
        while fid in frames and fid not in seen and len(found) < depth:
            seen.add(fid)
            loc, parent = frames[fid]
            path, func, line = locs.get(loc, ("?", "?", 0))
            m = OURS.search(path)
            if m:
                found.append(f"{m.group(1)}:{line} {func.split('.')[-1]}")
            fid = parent - 1  # parent_frame_id counts from 1; 0 = none
        return " < ".join(found) or None

    out = {}
    for line in lines:
        m = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = .*stack_frame_id=(\d+)", line)
        if m:
            src = ours(int(m.group(2)))
            if src:
                out[m.group(1)] = src
    return out
