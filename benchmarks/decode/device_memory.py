"""Device memory around measurements that may run out of it (benchmarks/decode/long_decode.py's
largest batch): what is free, what is still alive, one array per allocation, and releasing a
failed attempt's buffers (checked) before the next.

    arr = allocate((n,), jnp.float32, 0)          # one execution, one output, ready
    msg = forget(e)                                # the error's text; its traceback chain dropped
    release((cache, token))                        # wait for pending work, then delete
    report = scrub(baseline_ids)                   # gc, jax.clear_caches, arrays left alive
    free = settle(expected_free)                   # poll until the allocator has the bytes back

Why: on 2026-12-01 (all-MLA at 1M tokens, one H200) the largest-batch probe asked for a cache of
13 x 10.742 GB = 139.64 GB with 139.63 GB free. The allocation failed inside one jitted
execution that allocates every cache array at once, and from then on the allocator stayed full
(0 bytes free after gc.collect, the row's free_bytes_after_probes): every later allocation,
down to 4 bytes, failed, each after the BFC allocator's 10 s wait for frees. Python held none
of those bytes (a failed execution returns no arrays; checked on CPU with a failing
multi-output jit: jax.live_arrays() is empty after it), so nothing a script does afterwards can
get them back. The same day's other rows had failed probes too, all on the separate
single-array reserve allocation, and the next probes found their memory free again. Hence
(long_decode): never ask for more than the allocator says is free, allocate one array per
execution, and after any failure check that the bytes came back before trying again, and stop
with the figures when they did not.
"""

from __future__ import annotations

import gc
import time

import jax
import jax.numpy as jnp

MiB = 1 << 20


def memory_stats() -> dict:
    return jax.devices()[0].memory_stats() or {}


def free_bytes() -> int | None:
    """What the device's allocator can still hand out (None where it does not say: CPU)."""
    s = memory_stats()
    return None if "bytes_limit" not in s else int(s["bytes_limit"] - s.get("bytes_in_use", 0))


def live_arrays(exclude: frozenset[int] = frozenset()) -> list[jax.Array]:
    """Arrays alive on the backend (not deleted) whose id is not in exclude."""
    return [x for x in jax.live_arrays() if id(x) not in exclude and not x.is_deleted()]


def array_bytes(arrays) -> int:
    return sum(int(x.nbytes) for x in arrays)


def baseline() -> frozenset[int]:
    """The ids of the arrays alive now (after a collection): what must outlive a measurement."""
    gc.collect()
    return frozenset(id(x) for x in live_arrays())


def allocate(shape, dtype, fill=0) -> jax.Array:
    """An array of `shape` filled with `fill`, its allocation finished: one output per
    execution, so an out-of-memory failure leaves no half-allocated set of buffers."""
    x = jnp.full(shape, fill, dtype)
    x.block_until_ready()
    return x


def release(tree) -> None:
    """Free tree's device buffers now: wait for the work that uses them (an error there is
    the caller's to have seen already), then delete them."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            try:
                x.block_until_ready()
            except Exception:  # noqa: BLE001 - a failed computation's output is freed all the same
                pass
            x.delete()


def forget(e: BaseException) -> str:
    """The error's text, then its traceback chain cut: a traceback keeps every frame's locals
    (arrays included) alive for as long as the exception object lives."""
    text = f"{type(e).__name__}: {e}"
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        nxt = e.__cause__ or e.__context__
        e.__cause__ = e.__context__ = None
        e = nxt
    return text


def scrub(keep: frozenset[int], clear_caches: bool = True, delete_over: int = MiB) -> dict:
    """After a measurement (failed or not): collect garbage, drop jax's compiled executables
    (clear_caches) and list the arrays alive that are not in `keep`; those of delete_over bytes
    or more are deleted (nothing of a finished measurement should be alive, and holding them
    would fail the next one). -> {"stray_arrays", "stray_bytes", "live_bytes"}."""
    gc.collect()
    if clear_caches:
        jax.clear_caches()
        gc.collect()
    stray = live_arrays(keep)
    out = {"stray_arrays": len(stray), "stray_bytes": array_bytes(stray)}
    release([x for x in stray if x.nbytes >= delete_over])
    del stray
    out["live_bytes"] = array_bytes(live_arrays())
    return out


def settle(expected_free: int | None, tolerance: int, timeout_s: float = 5.0) -> int | None:
    """Poll the allocator until it has at least expected_free - tolerance bytes free again
    (frees complete when the device is done with the buffers), for up to timeout_s.
    -> the free bytes last seen (None where the device does not say)."""
    free = free_bytes()
    if free is None or expected_free is None:
        return free
    deadline = time.perf_counter() + timeout_s
    while free < expected_free - tolerance and time.perf_counter() < deadline:
        time.sleep(0.05)
        gc.collect()
        free = free_bytes()
    return free
