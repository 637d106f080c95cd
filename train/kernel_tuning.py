"""tokamax's kernel configs for this GPU: heuristic by default, tuned on request, kept beside
the compilation cache.

tokamax (the `[gpu]` extra) looks each kernel call's shape up in the tuned configs it ships
(H100, B200, A100, TPUs); on another chip (an H200) every lookup misses, logs an absl WARNING
of about 1,000 characters ("Autotuning cache miss for PallasMosaicGpuRaggedDot(...) on NVIDIA
H200 with key ..."; 136 of them for k3-small's train step) and falls back to a heuristic config.
k3jax-train instead:

1. counts those records and prints none of them (`TokamaxLogFilter` on absl's logger);
2. by default tunes nothing: the kernels keep tokamax's heuristic configs, and one line says how
   many and how to tune them (`train.autotune_budget_s`). Why: tuning k3-small's 11 kernels takes
   a minute or two each on an H200 (one kernel's tuning cannot be interrupted), so a first launch
   that tuned showed no step in 8 minutes (2026-12-01); k3-small's step ran at 679 ms that day
   with the heuristic configs for 10 of its 11 kernel shapes (tuned against heuristic configs
   in one lease: not measured yet);
3. with `train.autotune_budget_s` > 0, tunes the kernels that missed (`tokamax.autotune` over the
   lowered train and eval steps, one kernel at a time) for about that many seconds
   (`tune_within_budget`: a kernel starts only while the longest tuning so far still fits; the
   rest wait for the next launch) and saves the results as JSON under
   `<compile cache>/tokamax/<tokamax version>-jax<jax version>/<device kind>.json`;
4. on every launch, loads that file into tokamax's in-memory cache before lowering: no misses,
   the same program as last time, so JAX's persistent cache hits too (quiet and fast).

The results go into tokamax's own per-op cache (`op.get_autotuning_cache(device_kind)`, where
`BoundArguments.autotune(cache_results=True)` puts them), not through `AutotuningResult` as a
context manager: in tokamax 0.0.17 that overlay is keyed by the op object including its `vjp`,
a fresh `functools.partial` per `PallasMosaicGpuRaggedDot()` instance, so the grouped-matmul
calls never match it. Several processes neither tune nor load (each would pick its own
configs, and SPMD programs must agree): they keep tokamax's heuristics, and say so.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

MISS = "Autotuning cache miss for "
# tokamax's records when tuning a kernel fails (the kernel then keeps its heuristic config)
_FAILURES = ("Failed to autotune", "all configs failed", "Configs timed out")


def record_kind(record: logging.LogRecord) -> tuple[str, str, str] | None:
    """('miss', op name, key) for a tokamax cache miss, ('failure', op name, '') for a failed
    tuning, None for any other record. Pure: reads record.msg and record.args only."""
    msg = record.msg if isinstance(record.msg, str) else ""
    args = record.args if isinstance(record.args, tuple) else ()
    if msg.startswith(MISS):
        return "miss", _op_name(args[0]) if args else "?", str(args[2]) if len(args) > 2 else ""
    if msg.startswith(_FAILURES):
        return "failure", _op_name(args[0]) if args else "?", ""
    return None


def _op_name(op) -> str:
    """'PallasMosaicGpuRaggedDot' from the op, or from its repr 'PallasMosaicGpuRaggedDot(config=...)'."""
    text = op if isinstance(op, str) else type(op).__name__
    return text.split("(", 1)[0].strip() or "?"


class TokamaxLogFilter(logging.Filter):
    """Swallows tokamax's per-kernel autotuning records and counts them: distinct missed
    (op, key) pairs and failed tunings. Every other record passes."""

    def __init__(self):
        super().__init__()
        self.misses: dict[str, set[str]] = {}
        self.failures = 0

    def filter(self, record: logging.LogRecord) -> bool:
        kind = record_kind(record)
        if kind is None:
            return True
        what, op, key = kind
        if what == "miss":
            self.misses.setdefault(op, set()).add(key)
        else:
            self.failures += 1
        return False

    def missed(self) -> int:
        return sum(len(keys) for keys in self.misses.values())

    def reset(self) -> None:
        self.misses.clear()
        self.failures = 0


def fallback_words(misses: dict[str, set[str]]) -> str:
    """What the kernels that missed run instead of a tuned config: tokamax's heuristic configs,
    except k3jax's grouped GEMMs (`K3RaggedDot`), whose fallback on an H100/H200 is the configs
    k3jax measured (`k3jax.ops.grouped_matmul_configs`)."""
    if "K3RaggedDot" in misses:
        return "using its heuristic configs (k3jax's measured configs for the grouped GEMMs, K3RaggedDot)"
    return "using its heuristic configs"


def miss_summary(misses: dict[str, set[str]]) -> str:
    """'6 kernel shapes (PallasMosaicGpuRaggedDot 6)'."""
    n = sum(len(k) for k in misses.values())
    by_op = ", ".join(f"{op} {len(keys)}" for op, keys in sorted(misses.items()))
    return f"{n} kernel shape{'s' * (n != 1)} ({by_op})"


def untuned_line(log_filter: TokamaxLogFilter, device_kind: str) -> str | None:
    """The one line a program that ran tokamax's kernels under `quiet_tokamax(log_filter)` says at
    its end of the kernel shapes that had no tuned config on `device_kind` (their per-shape
    warnings swallowed); None when every shape had one. k3jax-train says more (how to tune them:
    `KernelTuner.after_lowering`)."""
    if not log_filter.missed():
        return None
    return (f"tokamax: {miss_summary(log_filter.misses)} without a tuned config for {device_kind}, "
            f"{fallback_words(log_filter.misses)}")


@contextlib.contextmanager
def quiet_tokamax(log_filter: TokamaxLogFilter, logger_name: str = "absl"):
    """Install `log_filter` on absl's logger (where tokamax logs) for the block."""
    logger = logging.getLogger(logger_name)
    logger.addFilter(log_filter)
    try:
        yield log_filter
    finally:
        logger.removeFilter(log_filter)


def device_slug(device_kind: str) -> str:
    """'NVIDIA H200' -> 'nvidia_h200' (a file name)."""
    return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") or "device"


def tuning_file(cache_dir: Path, device_kind: str, tokamax_version: str, jax_version: str) -> Path:
    """Where this chip's tuned configs live, beside JAX's compilation cache."""
    return Path(cache_dir) / "tokamax" / f"{tokamax_version}-jax{jax_version}" / f"{device_slug(device_kind)}.json"


def write_atomically(path: Path, text: str) -> None:
    """Readers (another launch) see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class KernelTuner:
    """The k3jax-train side of tokamax's autotuning; a no-op where tokamax's kernels do not run.

    path: this chip's tuning file, loaded when present (None: nothing is loaded or saved);
    why_not: why this run can tune nothing (None when it could); say: where its lines go;
    budget_s: about how many seconds of tuning this launch may spend (0: none, the kernels
    without a tuned config keep tokamax's heuristic ones); how_to_tune: what the line about
    untuned kernels tells the user to set."""

    path: Path | None
    device_kind: str
    active: bool  # tokamax's kernels run here (a GPU with the extra)
    why_not: str | None
    say: Callable[[str], None]
    log_filter: TokamaxLogFilter = field(default_factory=TokamaxLogFilter)
    tuned_s: float = 0.0
    budget_s: float = 0.0
    how_to_tune: str = "train.autotune_budget_s=SECONDS"

    @classmethod
    def for_run(cls, cache_dir: Path | None, *, processes: int, say, budget_s: float = 0.0,
                how_to_tune: str = "train.autotune_budget_s=SECONDS") -> "KernelTuner":
        """budget_s: 0 loads configs tuned earlier and tunes nothing (the default, and what
        benchmarks do to keep their time budget); > 0 tunes for about that long."""
        import jax

        from k3jax.ops.gpu_extra import tokamax_unavailable

        device_kind = jax.devices()[0].device_kind
        active = tokamax_unavailable() is None
        path = None
        if active and cache_dir is not None and processes == 1:
            path = tuning_file(cache_dir, device_kind, _tokamax_version(), jax.__version__)
        why_not = ("train.compile_cache_dir=off: nowhere to keep tuned configs" if cache_dir is None else
                   "several processes: each would tune its own configs, and their programs must agree"
                   if processes > 1 else None)
        return cls(path, device_kind, active, why_not, say, budget_s=budget_s, how_to_tune=how_to_tune)

    @property
    def _untunable_path(self) -> Path:
        return self.path.with_suffix(".untunable.txt")

    def load(self) -> int:
        """Put this chip's saved configs into tokamax's cache; how many (0 without a file)."""
        if self.path is None or not self.path.is_file():
            return 0
        import tokamax

        try:
            result = tokamax.AutotuningResult.loads(self.path.read_text())
        except Exception as e:  # a file from another tokamax, or damaged: tune again
            self.say(f"tokamax: ignoring {self.path} ({type(e).__name__}); its kernels are tuned again")
            return 0
        if result.device_kind != self.device_kind:
            return 0
        n = _install(result.data, self.device_kind)
        self.say(f"tokamax: {n} kernel configs tuned for this GPU ({self.device_kind}) loaded from {self.path}")
        return n

    def after_lowering(self, lowered: Iterable) -> bool:
        """Called with the steps lowered under `quiet_tokamax(self.log_filter)`: tune what
        missed and save it. True when configs changed, so the steps must be lowered again."""
        if not self.active or not self.log_filter.missed():
            return False
        misses = miss_summary(self.log_filter.misses)
        if self.path is None or self.why_not is not None:
            self.say(f"tokamax: {misses} have no tuned config for {self.device_kind}; "
                     f"{fallback_words(self.log_filter.misses)} ({self.why_not})")
            return False
        if not self.budget_s:  # the default: no launch waits for tuning
            self.say(f"tokamax: {misses} have no tuned config for {self.device_kind}: "
                     f"{fallback_words(self.log_filter.misses)}. "
                     f"To tune them once for this GPU kind, set "
                     f"{self.how_to_tune.replace('SECONDS', str(SECONDS_PER_KERNEL * self.log_filter.missed()))} "
                     f"(about {SECONDS_PER_KERNEL // 60} min per kernel on an H200; kept in {self.path} "
                     f"and loaded by every later launch)")
            return False
        import jax
        import tokamax

        untunable = self._untunable()
        bound = _unique(ba for low in lowered for ba in tokamax.autotuning.get_bound_args(low))
        todo = [ba for ba in bound if ba.cached_autotuning_data is None and _key(ba) not in untunable]
        if not todo:
            self.say(f"tokamax: {misses} keep its heuristic configs (their tuning failed before; "
                     f"delete {self._untunable_path} to try again)")
            return False
        within = f"within about {self.budget_s:.0f} s" if math.isfinite(self.budget_s) else "with no time limit"
        self.say(f"tuning {len(todo)} kernels for this GPU ({self.device_kind}) {within} "
                 f"(train.autotune_budget_s): a kernel starts only while the longest tuning so far still fits, "
                 f"and one kernel's tuning cannot be interrupted; results kept in {self.path} ...")
        t0 = time.perf_counter()

        def tune_one(ba):
            result = tokamax.autotune([ba], progress_bar=False, timeout=CONFIG_COMPILE_TIMEOUT_S)
            self._save(result)  # a launch stopped mid-way keeps every kernel tuned so far
            return result

        results, left, longest_s = tune_within_budget(todo, tune_one, self.budget_s)
        self.tuned_s = time.perf_counter() - t0
        n = sum(_install(r.data, self.device_kind) for r in results)
        tuned = {_key(ba) for r in results for ba, data in r.data if _working(data)}
        tried = todo[:len(todo) - left]
        failed = [_key(ba) for ba in tried if _key(ba) not in tuned]
        if failed:
            write_atomically(self._untunable_path, "\n".join(sorted(untunable | set(failed))) + "\n")
        self.say(f"tuned {n} of {len(todo)} kernels in {self.tuned_s:.0f} s (the longest {longest_s:.0f} s)"
                 + (f"; {len(failed)} keep tokamax's heuristic config (their tuning failed)" if failed else "")
                 + (f"; {left} left for the next launch with a tuning budget (heuristic configs until then)"
                    if left else ""))
        jax.clear_caches()  # nothing traced with the heuristic configs may be reused
        self.log_filter.reset()
        return True

    def _save(self, result) -> None:
        """Merge `result` into this chip's tuning file (the configs tuned earlier are kept)."""
        import tokamax

        saved = result
        if self.path.is_file():
            with contextlib.suppress(Exception):
                earlier = tokamax.AutotuningResult.loads(self.path.read_text())
                if earlier.device_kind == result.device_kind:
                    saved = earlier | result
        write_atomically(self.path, saved.dumps(prune_errors=True))

    def _untunable(self) -> set[str]:
        p = self._untunable_path
        return set(p.read_text().splitlines()) - {""} if p.is_file() else set()


def tune_within_budget(todo: list, tune_one: Callable, budget_s: float, clock: Callable[[], float] = time.perf_counter):
    """tune_one(kernel) for the kernels of `todo` in order, for about `budget_s` seconds.
    Returns (the results, how many kernels were left untried, the longest kernel's seconds).

    One kernel's tuning cannot be cut short (tokamax compiles and times its configs in one
    call), so the deadline is checked before each kernel against an estimate of its time, the
    longest tuning so far: a kernel starts only when the seconds spent plus that estimate still
    fit in the budget. The first kernel always starts (when budget_s > 0): every launch that
    asks for tuning makes progress, even with a budget shorter than one kernel. 0 tunes none.

    Why a budget: tokamax tries tens of configs per grouped matmul, each compiled and timed:
    60 to 229 s per kernel for k3-small on an H200 (2026-12-01: 3 in 180 s, one in 229 s), so tuning all 11 in one launch
    holds its first step for 15 minutes or more. The kernels left are tuned on the next launches."""
    t0, results, longest = clock(), [], 0.0
    for i, kernel in enumerate(todo):
        began = clock()
        if budget_s <= 0 or (i and began - t0 + longest > budget_s):
            return results, len(todo) - i, longest
        results.append(tune_one(kernel))
        longest = max(longest, clock() - began)
    return results, 0, longest


# what tuning one of k3-small's kernels took on an H200, typically (60 s each for 3, one 229 s; 2026-12-01):
# the budget the line about untuned kernels suggests is this many seconds per kernel
SECONDS_PER_KERNEL = 120

# tokamax's limit on compiling one candidate config (its default, 600 s, lets one pathological
# config hold a launch for ten minutes)
CONFIG_COMPILE_TIMEOUT_S = 60.0


def _key(ba) -> str:
    """A kernel's identity across launches: its op and its autotuning cache key."""
    return f"{type(ba.op).__name__} {ba.autotuning_cache_key!r}".replace("\n", " ")


def _working(data) -> bool:
    """Whether autotuning data holds at least one config that ran (not only exceptions)."""
    return any(not isinstance(v, Exception) for v in data.values())


def _tokamax_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tokamax")
    except PackageNotFoundError:
        return "unknown"


def _unique(bound_args) -> list:
    seen, out = set(), []
    for ba in bound_args:
        key = (type(ba.op).__name__, ba.autotuning_cache_key)
        try:
            if key in seen:
                continue
            seen.add(key)
        except TypeError:  # an unhashable key: keep it, tokamax copes with repeats
            pass
        out.append(ba)
    return out


def _install(data, device_kind: str) -> int:
    """(bound arguments, autotuning data) pairs into tokamax's per-op caches; how many had a
    working config."""
    n = 0
    for ba, tuned in data:
        if not _working(tuned):  # every config failed: the kernel keeps its heuristic one
            continue
        # exceptions left in would make tokamax's `fastest_config` consider them; drop them
        ba.op.get_autotuning_cache(device_kind)[ba.autotuning_cache_key] = type(tuned)(tuned.prune_errors())
        n += 1
    return n
