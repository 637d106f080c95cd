"""One owner per run directory: a lock file k3jax-train takes before it creates or touches
anything in run_dir, and gives back on every exit.

    RUN_DIR/k3jax-train.lock    {"host", "pid", "started", "boot_id", "pid_ns", "proc_start"}

A launch on a run_dir whose lock is held by a live process is refused (`RunDirLocked`, exit 2)
with the holder's host, pid and start time. A lock whose holder is gone is taken over, with one
line saying so. How a holder is judged gone:
- on this host (same host name, boot and pid namespace): its pid no longer runs, or runs another
  program (a reused pid: the process start time in /proc/<pid>/stat differs from the one the
  lock recorded); a reboot (another /proc/sys/kernel/random/boot_id) ends every holder;
- on another host (a requeue onto another node after the first one died; its pids mean nothing
  here): the holder refreshes the lock file's mtime every HEARTBEAT_S seconds. A launch finding
  such a lock watches it for STALE_S seconds of its own clock (no two hosts' clocks compared)
  and takes it over if the mtime did not move; a live holder's heartbeat shows within that time.

The lock appears atomically: written to a private file, then hard-linked into place (`link`
fails on an existing name, also on NFS, where O_EXCL was long unreliable), so no reader sees it
half-written. Taking over renames the stale lock aside, checks that what was renamed is the lock
judged stale (not a new holder's, in a race with another launch), then links a new one.

Several processes (jax.process_count() > 1): process 0 decides and every process learns the
decision (`multihost_utils.broadcast_one_to_all`) before any touches the run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from k3jax.config.errors import ConfigError
from train.distributed import broadcast_text

LOCK_NAME = "k3jax-train.lock"
HEARTBEAT_S = 30.0
STALE_S = 120.0  # four heartbeats: NFS attribute caches and a busy file server may delay one


class RunDirLocked(ConfigError):
    """Another live process owns the run directory (the CLI prints it and exits 2)."""


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the
    pid, it names one process (a reused pid starts later). None where /proc has no such pid."""
    text = _read_text(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name (field 2) may hold spaces
    return fields[19]


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def this_process() -> dict:
    """What the lock records about its holder."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pid_ns": _pid_namespace(),
            "proc_start": process_start(pid)}


def describe(holder: dict) -> str:
    if not holder:
        return "an unreadable lock"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


def _same_machine(holder: dict, me: dict) -> bool:
    """Whether the holder's pid can be looked up here: same host, boot and pid namespace."""
    return all(holder.get(k) == me.get(k) for k in ("host", "boot_id", "pid_ns"))


def local_holder_gone(holder: dict) -> str | None:
    """Why a holder on this machine is gone, or None while it runs."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return "the lock names no pid"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "it is no longer running"
    except PermissionError:  # runs, as another user
        pass
    recorded, now = holder.get("proc_start"), process_start(pid)
    if recorded is not None and now is not None and recorded != now:
        return "its pid now belongs to another process"
    return None


def _mtime(path: Path) -> float | None:
    # open + fstat: NFS revalidates a file's attributes on open (close-to-open consistency),
    # where a bare stat may answer from an attribute cache up to a minute old
    try:
        with open(path) as f:
            return os.fstat(f.fileno()).st_mtime
    except OSError:
        return None


def remote_holder_gone(path: Path, stale_s: float, say: Callable[[str], None], holder: dict) -> str | None:
    """Watch another host's lock for `stale_s` seconds: None as soon as its heartbeat moves the
    mtime (the holder lives), else why it is taken to be gone."""
    first = _mtime(path)
    say(f"k3jax-train: {path} is held by {describe(holder)}; watching its heartbeat for up to "
        f"{stale_s:.0f} s before taking it over ...")
    deadline = time.monotonic() + stale_s
    while time.monotonic() < deadline:
        time.sleep(min(1.0, stale_s / 10))
        now = _mtime(path)
        if now != first:
            return None  # refreshed (or replaced, or removed: judged again by the caller)
    return f"its heartbeat stopped (the lock's mtime did not move in {stale_s:.0f} s)"


@dataclass
class RunLock:
    """A held lock: `release()` gives it back (idempotent); a daemon thread refreshes its
    mtime every `heartbeat_s` seconds meanwhile."""
    path: Path
    content: str
    made_dirs: list[Path]  # directories the lock created (run_dir and missing parents): removed if still empty
    heartbeat_s: float = HEARTBEAT_S

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="k3jax-run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _ours(self) -> bool:
        return _read_text(str(self.path)) == self.content

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            if not self._ours():
                print(f"k3jax-train: warning: {self.path} was removed or replaced by another launch; "
                      f"this run no longer owns {self.path.parent}", flush=True)
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        if self._ours():
            with contextlib.suppress(OSError):
                self.path.unlink()
        for d in self.made_dirs:  # a launch refused before it wrote anything leaves nothing behind
            try:
                d.rmdir()  # only when empty
            except OSError:
                break


def _link_new(path: Path, content: str) -> bool:
    """Create `path` holding `content` atomically; False if it already exists."""
    private = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.{time.monotonic_ns()}")
    private.write_text(content)
    try:
        os.link(private, path)
        return True
    except FileExistsError:
        return False
    finally:
        private.unlink()


def _take_over(path: Path, stale: str, content: str) -> bool:
    """Replace the lock whose text is `stale` with ours; False if it changed hands meanwhile."""
    aside = path.with_name(f"{path.name}.stale.{socket.gethostname()}.{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # another launch took it first
    if _read_text(str(aside)) != stale:  # renamed a new holder's lock: put it back
        with contextlib.suppress(OSError):
            os.link(aside, path)
        aside.unlink()
        return False
    aside.unlink()
    return _link_new(path, content)


def acquire(run_dir, *, say: Callable[[str], None] = print, stale_s: float = STALE_S,
            heartbeat_s: float = HEARTBEAT_S) -> RunLock:
    """Take run_dir's lock (creating run_dir), or raise RunDirLocked naming the live holder."""
    run_dir = Path(run_dir)
    made_dirs = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # deepest first
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    me = this_process()
    content = json.dumps(me)
    for _ in range(5):  # each round: create it, or judge the holder (a race sends us round again)
        if _link_new(path, content):
            return RunLock(path, content, made_dirs, heartbeat_s)
        text = _read_text(str(path))
        if text is None:
            continue  # released meanwhile
        try:
            holder = json.loads(text)
        except ValueError:
            holder = None
        if not isinstance(holder, dict):
            holder, why = {}, "the lock file is unreadable"
        else:
            if _same_machine(holder, me):
                why = local_holder_gone(holder)
            else:
                why = remote_holder_gone(path, stale_s, say, holder)
                if why is None and _read_text(str(path)) != text:
                    continue  # released or replaced while watched: judge the new state
            if why is None:
                raise RunDirLocked(f"{run_dir} is in use by another k3jax-train: {describe(holder)} "
                                   f"(lock: {path}); stop it, or train in another run_dir")
        if _take_over(path, text, content):
            say(f"k3jax-train: took over {path} from {describe(holder)}: {why}")
            return RunLock(path, content, made_dirs, heartbeat_s)
    raise RunDirLocked(f"{path} kept changing hands while this launch tried to take it; launch again")


@contextlib.contextmanager
def hold_run_dir(run_dir, *, say: Callable[[str], None] = print, stale_s: float = STALE_S):
    """Own run_dir for the duration (see the module docstring); released on every exit path.
    Several processes: process 0 holds the lock, and every process raises RunDirLocked when
    process 0 could not take it."""
    import jax

    lock = None
    if jax.process_count() == 1:
        lock = acquire(run_dir, say=say, stale_s=stale_s)
    else:
        refusal = ""
        if jax.process_index() == 0:
            try:
                lock = acquire(run_dir, say=say, stale_s=stale_s)
            except RunDirLocked as e:
                refusal = str(e)
            except Exception as e:  # the others must hear of it, not wait for a lock decision forever
                refusal = f"cannot take the lock in {run_dir}: {type(e).__name__}: {e}"
        refusal = broadcast_text(refusal)
        if refusal:
            if lock is not None:
                lock.release()
            raise RunDirLocked(refusal if jax.process_index() == 0 else f"(process 0) {refusal}")
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
