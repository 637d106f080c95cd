"""The logging window: what one logged training line averages.

Windows are fixed: the k-th covers steps (k-1)*every+1 .. k*every (`logging.every`), whatever
launches ran them, so a run that stopped and resumed logs the same values at the multiples of
`every` as one that never stopped. The lines between (a launch's first step, a stop, the last
step) average the window so far and leave it open. Each line carries `window_steps`, how many
steps it averages: it covers steps step-window_steps+1 .. step.

A resumed launch continues the window its checkpoint cut: the line logged at the checkpoint's
step (by the launch that saved it, or by any launch that reached that step: resume is exact, so
they logged the same values) holds the mean over the window's first steps, and the new steps
are added to it, weighted by their counts. The join is exact up to rounding: the carried mean
is the float32 mean written to metrics.jsonl, so a joined value can differ from an uninterrupted
run's in the last bits (about 1e-7 relative). Without such a line (a launch killed between its
last line and its checkpoint), the window's first line counts only its own steps, and says so
in `window_steps`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# per-layer metrics whose largest per-step value in the window is logged beside the mean, under
# this name: a window's mean dilutes a one-step spike tenfold, and whether a high mean was one bad
# step or ten middling ones is what a balance problem turns on (issue 47's window at steps 191-200)
PEAKS = {"max_violation": "max_violation_peak"}
# ... and the step at which each peaked (the first, on a tie): which step a spike was, without
# the ~15 % a line every step costs (benchmarks/results/qb-steps-2026-12-06/)
PEAK_STEPS = {peak: peak + "_step" for peak in PEAKS.values()}


class LogWindow:
    """On-device sums over the current window's steps (no host sync per step), and the part of
    the window an earlier launch ran (`carried`: its step count and mean per metric). The metrics
    of `PEAKS` also keep their largest value over the window's steps (on device, elementwise)."""

    def __init__(self, every: int, start: int, run_dir, constant=frozenset()):
        """constant: the metrics no line logs (train.metrics.constant_metrics): absent from the
        carried line, and not joined."""
        self.every, self.start, self.constant = every, start, frozenset(constant)
        self.opened_after = start  # the last step before this launch's part of the window
        self.sums, self.peaks, self.peak_steps = None, None, None
        self.carried = carried_window(Path(run_dir) / "metrics.jsonl", start, every)

    def add(self, step: int, metrics: dict) -> None:
        """Step `step`'s metrics (device arrays: scalars, or one value per MoE layer)."""
        self.sums = metrics if self.sums is None else jax.tree.map(jnp.add, self.sums, metrics)
        peaks = {PEAKS[k]: v for k, v in metrics.items() if k in PEAKS}
        if self.peaks is None:
            self.peak_steps = {PEAK_STEPS[k]: jnp.full(jnp.shape(v), step, jnp.int32) for k, v in peaks.items()}
            self.peaks = peaks
        else:
            self.peak_steps = {PEAK_STEPS[k]: jnp.where(v > self.peaks[k], step, self.peak_steps[PEAK_STEPS[k]])
                               for k, v in peaks.items()}
            self.peaks = jax.tree.map(jnp.maximum, self.peaks, peaks)

    def snapshot(self) -> tuple:
        """The window as it stands (device arrays, not read): `means` of it later gives what
        `means` gives now, whatever steps are added after `after_line`. k3jax-train logs a
        window's last line this way once the next step is queued, so the device is not idle
        while the host reads and writes the line."""
        return self.sums, self.peaks, self.peak_steps, self.opened_after

    def means(self, step: int, snapshot: tuple | None = None) -> tuple[int, dict]:
        """(steps averaged, the mean of each metric over the window so far and the `PEAKS`
        metrics' largest values), on the host; of `snapshot` (taken at `step`) when given."""
        sums, peaks, peak_steps, opened_after = snapshot if snapshot is not None else self.snapshot()
        n = step - opened_after
        means = {k: np.asarray(v) / n for k, v in jax.device_get(sums).items()}
        peaks = {k: np.asarray(v) for k, v in jax.device_get(peaks or {}).items()}
        steps = {k: np.asarray(v) for k, v in jax.device_get(peak_steps or {}).items()}
        carried = self.carried if opened_after == self.start else None
        if carried is None:
            return n, means | peaks | steps
        before, carried_means = carried
        logged = {k: v for k, v in means.items() if k not in self.constant}
        if not set(logged) <= set(carried_means) or any(np.shape(carried_means[k]) != v.shape
                                                        for k, v in logged.items()):
            return n, means | peaks | steps  # an earlier version's metrics: not joinable, so not joined
        total = before + n
        joined = {k: (before * np.asarray(carried_means[k], np.float64) + n * v.astype(np.float64)) / total
                  for k, v in logged.items()}
        # the carried line's peak covers its steps (a line from before peaks were logged has none:
        # the peak then covers this launch's steps only)
        for k, v in peaks.items():
            old = np.asarray(carried_means[k], v.dtype) if k in carried_means else None
            if old is None or old.shape != v.shape:
                joined[k], joined[PEAK_STEPS[k]] = v, steps[PEAK_STEPS[k]]
                continue
            joined[k] = np.maximum(old, v)
            old_step = carried_means.get(PEAK_STEPS[k])
            if old_step is not None and np.shape(old_step) == v.shape:  # the earlier step on a tie
                joined[PEAK_STEPS[k]] = np.where(old >= v, np.asarray(old_step).astype(np.int64),
                                                 steps[PEAK_STEPS[k]])
            # a carried line from before peak steps were logged: that window's step is not known
        return total, joined

    def after_line(self, step: int) -> None:
        """A line was logged at `step`: at the window's end, the next window opens."""
        if step % self.every == 0:
            self.sums, self.peaks, self.peak_steps, self.opened_after = None, None, None, step


def carried_window(metrics_path: Path, start: int, every: int) -> tuple[int, dict] | None:
    """(steps, means) that metrics.jsonl's last line at step `start` holds for the window
    `start` falls in, or None: a fresh run, a start at a window's end, or no such line."""
    if start % every == 0 or not metrics_path.is_file():
        return None
    found = None
    with open(metrics_path) as f:
        for line in f:
            if f'"step": {start},' not in line:  # skip the parse of every other line
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a crash
                continue
            if row.get("step") == start and isinstance(row.get("window_steps"), (int, float)):
                found = row
    if found is None:
        return None
    steps = int(found.pop("window_steps"))  # written as a float, as every scalar
    window_opened_after = start // every * every
    if not 0 < steps <= start - window_opened_after:  # logged under another logging.every
        return None
    return steps, found
