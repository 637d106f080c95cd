"""A checkpoint's integrity record, written once its save is complete and checked before a
resume restores it: a damaged checkpoint is found by a cheap look, before Orbax reads it.

    RUN_DIR/checkpoints/<step>/k3jax_manifest.json
        {"format": 1, "files": {"state/ocdbt.process_0/d/…": [size, crc32 or null], …}}

Every file of the step is listed with its size; files up to CRC_MAX_BYTES (Orbax's metadata,
the OCDBT manifests and index nodes, the JSON items) with their CRC-32 as well. The large array
files are checked by size only: a CRC would read the whole checkpoint back at every save and
every resume. A truncated or replaced file (the usual damage: a full disk, a killed copy, a
file overwritten) changes its size; a flipped bit inside a large array file is left to Orbax's
restore, which the resume tries next (train/resume.py). A step without a manifest (saved by an
earlier version, or killed between Orbax's finalisation and this record) is checked by the
restore alone.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

MANIFEST = "k3jax_manifest.json"
CRC_MAX_BYTES = 1 << 20


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(step_dir) -> bool:
    """Record a completed step's files; False when the step is gone (Orbax's retention may
    delete it before this runs)."""
    step_dir = Path(step_dir)
    try:
        files = {}
        for p in _files(step_dir):
            size = p.stat().st_size
            files[p.relative_to(step_dir).as_posix()] = [size, _crc32(p) if size <= CRC_MAX_BYTES else None]
        tmp = step_dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({"format": 1, "files": files}))
        os.replace(tmp, step_dir / MANIFEST)
    except FileNotFoundError:
        return False
    return True


def manifest_problem(step_dir) -> str | None:
    """The first way the step's files differ from its manifest ("state/…/d/9a…: 100 bytes, 1,624
    when saved"), None when they agree or there is no manifest to check against."""
    step_dir = Path(step_dir)
    try:
        record = json.loads((step_dir / MANIFEST).read_text())
        files = record["files"]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__})"
    for rel, (size, crc) in files.items():
        p = step_dir / rel
        try:
            now = p.stat().st_size
        except FileNotFoundError:
            return f"{rel}: missing"
        if now != size:
            return f"{rel}: {now:,} bytes, {size:,} when saved"
        if crc is not None and _crc32(p) != crc:
            return f"{rel}: contents changed since the save (CRC-32)"
    return None
