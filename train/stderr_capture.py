"""Holding the process's stderr (file descriptor 2) while a checkpoint restore is tried.

A restore that fails part way (a damaged checkpoint) leaves TensorStore reads in flight. Their
callbacks fire after Orbax's event loop has closed and print "RuntimeError: Event loop is
closed" tracebacks straight to fd 2, from TensorStore's threads, dozens of them, for a failure
the caller reports in one line. So the attempt runs with fd 2 pointed at a temporary file:
- it succeeds: what was written is passed on to stderr unchanged;
- it fails: the caller waits for the file to stop growing (`settle`: the reads finishing) and
  drops the noise, having named the failure itself.
Python's sys.stderr writes to fd 2 as well, so its lines are held and passed on the same way.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sys
import tempfile
import time
import warnings


class StderrCapture:
    def __enter__(self):
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def settle(self, quiet_s: float = 0.5, max_s: float = 10.0) -> None:
        """Wait until nothing was written for `quiet_s` (at most `max_s`): the failed restore's
        reads have finished and printed. Collects garbage first (unawaited coroutines print)."""
        gc.collect()
        deadline, size, since = time.monotonic() + max_s, -1, time.monotonic()
        while time.monotonic() < deadline:
            sys.stderr.flush()
            now = os.fstat(self._file.fileno()).st_size
            if now != size:
                size, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.05)

    def text(self) -> str:
        sys.stderr.flush()
        self._file.seek(0)
        return self._file.read().decode(errors="replace")

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        return False

    def pass_on(self) -> None:
        """Write what was held to the real stderr (call after the block)."""
        held = self.text()
        if held:
            sys.stderr.write(held)
            sys.stderr.flush()
        self._file.close()

    def drop(self) -> None:
        self._file.close()


_dropped: set[str] = set()
_dropped_paths: set[str] = set()


class _NeverRetrieved(logging.Filter):
    """asyncio's "Task exception was never retrieved" for a task of the named coroutines (its
    repr names the coroutine), "_GatheringFuture exception was never retrieved" (the gather over
    them, whose repr does not), and any "exception was never retrieved" whose exception names a
    dropped path (a bare Future's repr names neither coroutine nor gather, only its error, which
    names the file it failed to read): logged when the task is collected, often at exit."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "exception was never retrieved" not in text:
            return True
        return not (
            "_GatheringFuture" in text.splitlines()[0]
            or any(f"coro=<{n}(" in text for n in _dropped)
            or any(path in text for path in _dropped_paths)
        )


_NEVER_RETRIEVED = _NeverRetrieved()


def drop_unraisable_from(*coroutine_names: str, mentioning: tuple[str, ...] = ()) -> None:
    """From now on, drop the reports the interpreter and asyncio make of these coroutines when
    they are collected unfinished or with an error nobody retrieved: "Exception ignored in:
    <coroutine …>" (sys.unraisablehook; every other report goes to the hook installed before),
    asyncio's "Task exception was never retrieved" (a filter on the asyncio logger) and "coroutine
    … was never awaited" (a warnings filter). asyncio's "never retrieved" reports that name one of
    the paths in `mentioning` are dropped too, whatever raised them (the damaged checkpoint's
    directory: every read of it failed, and the failure was named once).

    A failed Orbax restore leaves its per-array read coroutines referenced until they are
    collected, often at interpreter exit; each then reports the read error (a TensorStore spec
    of ~60 lines), long after the failure was named in one line. Call it only once such a
    failure has been reported."""
    names = frozenset(coroutine_names)
    asyncio_log = logging.getLogger("asyncio")
    if _NEVER_RETRIEVED not in asyncio_log.filters:
        asyncio_log.addFilter(_NEVER_RETRIEVED)
    _dropped_paths.update(mentioning)
    if names <= _dropped:
        return
    _dropped.update(names)
    for name in names:
        warnings.filterwarnings("ignore", message=f"coroutine '{re.escape(name)}' was never awaited")
    previous = sys.unraisablehook

    def hook(unraisable):
        if getattr(unraisable.object, "__qualname__", None) in names:
            return
        previous(unraisable)

    sys.unraisablehook = hook
