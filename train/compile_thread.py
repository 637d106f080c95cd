"""A lowered program compiled off the critical path: on its own thread, or when first needed.

k3jax-train's first step waits only for the train step's compile; the eval step, needed first
at step `logging.eval_every`, compiles meanwhile. XLA releases the GIL while it compiles
(measured here: a Python loop on the main thread ran at full speed beside a 10 s compile on
another thread), so the two compiles run side by side on the host's cores.

Determinism: the program is fixed when it is lowered, on the caller's thread, before this
starts (tracing, and tokamax's choice of kernel configs, happen there); compiling a lowered
program on another thread or later gives the same executable, and the persistent compilation
cache holds it for the next launches either way.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import jax


class DeferredCompile:
    """`lowered.compile()`, started on a thread now (background=True) or run by the first
    `result()` call (background=False: several processes keep their compiles in one order).

        pending = DeferredCompile(eval_lowered, mesh)
        ...                       # compile and run the train step meanwhile
        eval_fn = pending.result()  # waits if the compile is still running; raises its error
        pending.seconds             # how long the compile took (None before it ended)
    """

    def __init__(self, lowered, mesh=None, *, background: bool = True, now: Callable[[], float] = time.perf_counter):
        self._lowered, self._mesh, self._now = lowered, mesh, now
        self._compiled, self._error = None, None
        self.seconds: float | None = None
        self.background = background
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._compile, name="k3jax-compile", daemon=False)
            self._thread.start()

    def _compile(self) -> None:
        t0 = self._now()
        try:
            with jax.set_mesh(self._mesh) if self._mesh is not None else contextlib.nullcontext():
                self._compiled = self._lowered.compile()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller by result()
            self._error = e
        finally:
            self.seconds = self._now() - t0
            self._lowered = None  # the lowered module is large: drop it once compiled

    def done(self) -> bool:
        """Whether result() returns without compiling or waiting."""
        return self.seconds is not None and (self._thread is None or not self._thread.is_alive())

    def result(self):
        """The compiled program: waits for the thread, or compiles here on the first call."""
        if self._thread is not None:
            self._thread.join()
        elif self.seconds is None:
            self._compile()
        if self._error is not None:
            raise self._error
        return self._compiled

    def wait(self) -> None:
        """Let a running compile end (before the process exits: a thread still inside XLA when
        the interpreter shuts down can crash it). Errors are left to result()."""
        if self._thread is not None:
            self._thread.join()
