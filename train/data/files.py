"""Expanding `data.sources.i.paths` (files, directories, globs) into a sorted list of files."""

from __future__ import annotations

import glob
import os
from typing import Sequence

from k3jax.config.errors import ConfigError


def expand_paths(patterns: Sequence[str], where: str, suffixes: tuple[str, ...]) -> list[str]:
    """Files named by `patterns`, in order, each once.

    A glob keeps every file it matches; a directory contributes its files (recursively) that
    end in one of `suffixes`. A pattern that names nothing is an error: a typo in a path
    should not silently shrink the corpus.
    """
    out: dict[str, None] = {}
    for pattern in patterns:
        path = os.path.expanduser(pattern)
        if glob.has_magic(path):
            found = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not found:
                raise ConfigError(f"no file matches {pattern}", where)
        elif os.path.isdir(path):
            found = sorted(os.path.join(d, f) for d, _, files in os.walk(path) for f in files if f.endswith(suffixes))
            if not found:
                raise ConfigError(f"directory {pattern} holds no {'/'.join(suffixes)} files", where)
        elif os.path.isfile(path):
            found = [path]
        else:
            raise ConfigError(f"{pattern} does not exist", where)
        out.update(dict.fromkeys(found))
    return list(out)
