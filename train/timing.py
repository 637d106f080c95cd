"""The training clock: wall time spent in training steps, with eval and checkpoints set aside.

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
