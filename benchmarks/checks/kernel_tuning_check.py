"""train/kernel_tuning.py against the installed tokamax, in seconds, on a CPU or a GPU.

    python -m benchmarks.checks.kernel_tuning_check        (needs tokamax: the [gpu] extra)

CI has no tokamax, so its tests drive the log filter and the messages with stand-in records;
this script runs the real thing on tokamax's chunked-XLA linear cross-entropy op (tunable on
any backend, with a VJP op beside it, as the grouped matmul has): four launches, each with
tokamax's in-memory cache emptied as a new process has it, and checks

1. a benchmark before any tuning: the misses are counted, no absl line is printed, one line says so;
2. k3jax-train's launch with a tuning budget: tunes them, saves the file, lowers again with no miss left;
3. its second launch: loads the file, no miss, nothing tuned;
4. a benchmark after: loads the file, no miss.

Each check prints a PASS / FAIL line (benchmarks/checks/verdict.py; `judge`, which the CPU
tests drive with recorded launches); exits non-zero if any fails.
"""

from __future__ import annotations

import io
import logging
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.checks.verdict import Verdicts


def main() -> int:
    import tokamax
    from tokamax._src.ops import op as op_lib

    import k3jax.ops.gpu_extra as gpu_extra
    from train.kernel_tuning import KernelTuner, quiet_tokamax

    printed = io.StringIO()
    logging.basicConfig(stream=printed)  # absl records that get through land here
    x, w = jnp.ones((256, 64), jnp.float32), jnp.ones((64, 512), jnp.float32)
    labels = jnp.zeros((256,), jnp.int32)

    def grads(x, w):
        loss = lambda x, w: tokamax.linear_softmax_cross_entropy_loss(x, labels, w, implementation="chunked_xla")  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(x, w)

    cache = Path(tempfile.mkdtemp(prefix="k3jax-tuning-check-"))
    said: list[str] = []
    real_check = gpu_extra.tokamax_unavailable

    def launch(load_only: bool) -> tuple[int, int]:
        """(misses at the first lowering, misses at the end)."""
        gpu_extra.tokamax_unavailable = lambda: None  # this op runs on any backend
        try:
            tuner = KernelTuner.for_run(cache, processes=1, say=said.append,
                                        budget_s=0.0 if load_only else float("inf"))
        finally:
            gpu_extra.tokamax_unavailable = real_check
        with quiet_tokamax(tuner.log_filter):
            tuner.load()
            lowered = jax.jit(grads).lower(x, w)
            first = tuner.log_filter.missed()
            if tuner.after_lowering([lowered]):
                lowered = jax.jit(grads).lower(x, w)
            last = tuner.log_filter.missed()
        lowered.compile()(x, w)
        op_lib._AUTOTUNING_CACHE.clear()  # a new process starts with tokamax's shipped configs only
        jax.clear_caches()
        return first, last

    launches = {}
    n = len(said)
    launches["before"] = (*launch(load_only=True), said[n:])
    n = len(said)
    first, last = launch(load_only=False)
    launches["tuned"] = (first, last, said[n:], len(list(cache.rglob("*.json"))))
    n = len(said)
    launches["next"] = (*launch(load_only=False), said[n:])
    launches["after"] = (*launch(load_only=True),)
    verdicts = Verdicts("kernel_tuning")
    judge(verdicts, launches, printed.getvalue())
    for line in said:
        print("  |", line)
    print(f"tokamax {tokamax.__version__}, jax {jax.__version__}, {jax.devices()[0].device_kind}; files: "
          + ", ".join(str(p.relative_to(cache)) for p in cache.rglob("*.json")))
    return verdicts.exit_code()


def judge(verdicts: Verdicts, launches: dict, printed: str, kernels: int = 2) -> bool:
    """The four launches' verdicts. launches: "before", "next": (misses at the first lowering,
    misses at the end, the lines said); "tuned": the same and the tuned files' count; "after":
    (misses first, misses at the end). printed: what got through to the log."""
    first, last, lines = launches["before"]
    ok = verdicts.expect("before tuning", "misses counted and kept", first == kernels and last == kernels,
                         f"{first} then {last} misses, {kernels} kernels")
    ok &= verdicts.expect("before tuning", "one line about them", len(lines) == 1 and "no tuned config" in lines[-1],
                          f"{len(lines)} lines")
    first, last, lines, files = launches["tuned"]
    ok &= verdicts.expect("launch with a budget", "tuned, saved, no miss left", first == kernels and last == 0
                          and files == 1, f"{first} then {last} misses, {files} files")
    two = len(lines) == 2 and lines[0].startswith(f"tuning {kernels} kernels") and lines[1].startswith(
        f"tuned {kernels} of {kernels} kernels")
    ok &= verdicts.expect("launch with a budget", "two lines", two, f"{len(lines)} lines")
    first, last, lines = launches["next"]
    ok &= verdicts.expect("next launch", "loaded, no miss", first == 0 and last == 0 and len(lines) == 1
                          and "loaded from" in lines[-1], f"{first} then {last} misses, {len(lines)} lines")
    first, last = launches["after"]
    ok &= verdicts.expect("benchmark after", "loaded, no miss", first == 0 and last == 0, f"{first} then {last} misses")
    ok &= verdicts.expect("all launches", "no absl record printed", "Autotuning cache miss" not in printed,
                          "tokamax's per-kernel warning kept out of the log")
    return ok


if __name__ == "__main__":
    sys.exit(main())
