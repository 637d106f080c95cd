"""The training clock: wall time spent in training steps, with eval and checkpoints set aside;
and the launch clock: seconds since the process started, stamped on the start lines.

tokens/s and MFU are taken over training time only; what runs between steps (evaluation,
a checkpoint save) is timed on its own and reported as `eval_s` / `checkpoint_s`. The caller
waits for the queued steps to finish before an aside (JAX dispatches asynchronously), so their
device time stays on the training clock and does not leak into the aside.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable


class TrainClock:
    """`lap()` -> training seconds since the previous lap (or `start()`), asides excluded.

        clock.start()
        ... steps ...
        with clock.aside("eval"):
            evaluate()
        clock.aside_seconds["eval"]   # seconds of the last "eval" aside
        n * tokens_per_step / clock.lap()
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self._now = now
        self._t = None
        self._set_aside = 0.0  # aside seconds since the last lap
        self.aside_seconds: dict[str, float] = {}

    def start(self) -> None:
        self._t, self._set_aside = self._now(), 0.0

    def lap(self) -> float:
        if self._t is None:
            raise RuntimeError("TrainClock.lap() before start()")
        now = self._now()
        seconds = now - self._t - self._set_aside
        self._t, self._set_aside = now, 0.0
        return max(seconds, 1e-9)

    @contextlib.contextmanager
    def aside(self, name: str):
        """Time the block as `name`, off the training clock."""
        t0 = self._now()
        try:
            yield
        finally:
            dt = self._now() - t0
            self._set_aside += dt
            self.aside_seconds[name] = dt


def process_age_s(stat: str | None = None, uptime: str | None = None, ticks_per_s: float | None = None) -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time against
    /proc/uptime, both counted from boot), so the start lines' stamps include Python's imports
    of JAX and the rest; None where /proc is not there. The arguments replace the files' text
    and the clock-tick rate (tests)."""
    import os

    try:
        stat = open("/proc/self/stat").read() if stat is None else stat
        uptime = open("/proc/uptime").read() if uptime is None else uptime
        ticks_per_s = os.sysconf("SC_CLK_TCK") if ticks_per_s is None else ticks_per_s
        # the command name, field 2, is in parentheses and may hold spaces: count from after it;
        # the start time is field 22 (proc(5)), the 20th after the name
        started = int(stat[stat.rindex(")") + 2:].split()[19]) / ticks_per_s
        return max(float(uptime.split()[0]) - started, 0.0)
    except (OSError, ValueError, IndexError):
        return None


def launch_time(now: Callable[[], float] = time.perf_counter, age_s: float | None = None) -> float:
    """The process's start on the `now` clock, called once its imports are done. Where its age
    is unknown or implausible (over 10 minutes of imports: a container whose /proc/uptime
    counts from another boot than its processes' start times), now."""
    age = process_age_s() if age_s is None else age_s
    return now() - (age if age is not None and 0.0 <= age <= 600.0 else 0.0)


def stamp(seconds: float) -> str:
    """'[  12.3 s] ': a start line's seconds since launch."""
    return f"[{seconds:6.1f} s] "
