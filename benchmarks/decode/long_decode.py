"""Long-context inference on one GPU: the hybrid (KDA + MLA) against the same model with every mixer MLA.

    python -m benchmarks.decode.long_decode --model hybrid  --out OUT/hybrid  [--contexts 32768,131072,1048576]
    python -m benchmarks.decode.long_decode --model all_mla --out OUT/all_mla
    python -m benchmarks.decode.long_decode --summarize OUT/hybrid OUT/all_mla --out OUT    # table, ratios, plot
    (a later folder's rows fill in an earlier one's skipped or failed measurements, e.g. a
    `--parts prefill --decode-reserve-s 0 --contexts 1048576` run given all of a command's time)

One model per command: each fits a 10-minute command at 1M tokens (--budget-s, default 540 s:
no measurement starts that would not end before it). Weights are served in bf16
(model.param_dtype=bfloat16 unless overridden). Per model, in this order:

1. kernel check: the decode kernels (k3jax/ops/decode_kernels) against an fp32 form of their
   math on this device at k3-small's head shapes, each within the limit its error analysis
   gives (benchmarks/checks/decode_kernels_check.py); a kernel that fails to build or to pass
   sends the model to the XLA path (model.decode_impl=xla; the fused step's kernels: to
   model.decode_fused=false), recorded in `kernel_check` / `fused_kernel_check`.
2. prefill: one sequence of the largest context through the chunked prefill (--prefill-chunk
   tokens per call, only the last token's logits), after a warm-up chunk (the compile) outside
   the timed region. Every context L gets the time to prefill its first L tokens: tokens/s, the
   process's peak device memory by then, and the compiled chunk's temporaries. The cache is
   allocated for the largest context from the start (its bytes are given beside the peak).
3. decode at batch 1 for every context, on that cache: one compiled on-device loop of
   --decode-steps steps (decode.decode_loop), a warm-up call then --timed-calls timed ones (the
   median is the figure), with the cache index set so the steps end at L. The step's kernels
   read only the filled slots, so a cache allocated for 1M holds a 32k context at the cost of a
   32k one (on the XLA path the step reads every slot: there the 32k and 128k rows are not
   those of right-sized caches).
4. the largest batch for every context, with a cache of exactly L slots per sequence: the batch
   is found by bisecting real allocations of the cache plus a reserve for the step's temporaries,
   among the batches that fit the allocator's free bytes by its own count (asking for more can
   only fail, and on 2026-12-01 such a failure left the allocator full: benchmarks/
   device_memory.py), then compiled; if XLA's temporaries and unaliased outputs exceed what is
   free beside the cache, the batch shrinks before anything is allocated; if the run runs out of
   memory, it shrinks by the bytes the error names plus the temporaries, and retries. After each
   probe and attempt its arrays are deleted, jax's caches cleared, the arrays left alive listed
   and the free bytes checked against those before the probes (`checks` in the row, and the
   log); memory not given back stops the row with the figures instead of retrying.
5. `--parts batches --batches 8,16,24,32,48`: a decode row at each chosen batch and context
   (synthetic caches of exactly L slots, --largest-steps steps a call), in increasing order, each
   naming the step that ran (`fused`: k3jax.layers.decode_gemv.runs_fused, the model's own rule):
   the batches between the fused step's limit and the largest, measured instead of assumed.
   Run it again with model.decode_fused_max_batch=0 for the plain step at every batch (the default, 64, fuses them all). A batch
   that does not fit what is free ends the sweep with the figures, as does a failure.

Every decode row carries the bytes one step must read and write (the weights it uses: all but
the routed experts, plus the distinct experts B tokens route to under uniform routing, and B
embedding rows; the MLA cache up to L; KDA's state read and written) and its fraction of the
HBM roofline, bytes / HBM bandwidth / step time; every prefill row its fraction of the larger
of its FLOPs at the dense bf16 peak and the weights read per chunk plus the cache written
(`prefill_roofline`), and its MFU. The bandwidth and peak are the running chip's
(k3jax/chips.py, as k3jax-train's MFU; results.json names it as `roofline_chip`), the H200's
where JAX reports a device k3jax does not know (a CPU smoke run). Results go to OUT/results.json as they come (a
killed command keeps what it finished); --summarize joins two models' folders into one
results.json, summary.md and long_decode.png. CPU smoke test (minutes):

    JAX_PLATFORMS=cpu python -m benchmarks.decode.long_decode --config configs/k3-tiny.yaml --model hybrid \\
        --contexts 256,512 --prefill-chunk 128 --decode-steps 2 --out /tmp/ld
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import re
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import decode
from k3jax.chips import CHIPS, Chip, chip_for_device_kind
from k3jax.config import load_config
from k3jax.model import create_model

from benchmarks.checks import decode_kernels_check as dkc  # noqa: E402
from benchmarks.decode import device_memory as dm  # noqa: E402

LINEAR = ("kda", "gated_deltanet", "deltanet", "linear")
GiB = 1 << 30
MiB = 1 << 20
MARGIN = GiB  # beside XLA's temporaries: what memory_analysis does not count (autotuning, workspaces)
SETTLE_S = 5.0  # how long a row waits for freed memory to show as free again


def all_mla(pattern: str) -> str:
    """The layer pattern with every linear-attention mixer replaced by MLA."""
    return re.sub(r"\b(" + "|".join(LINEAR) + r")\b", "mla", pattern)


# ----------------------------------------------------------------------------------------
# bytes


def nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def cache_figures(model, L: int) -> dict:
    """One sequence's cache at L slots, from shapes: total bytes, bytes per slot (what a step
    reads per filled slot) and bytes that do not grow with L (KDA states and conv windows, read
    and written by every step)."""
    at = lambda n: nbytes(jax.eval_shape(lambda: model.init_cache(1, n)))  # noqa: E731
    total, longer = at(L), at(L + 64)
    per_slot = (longer - total) // 64
    return {"total": total, "per_slot": per_slot, "fixed": total - per_slot * L}


def weight_figures(model) -> dict:
    """Weight bytes a decode step reads, by kind (the embedding table is read one row a token,
    the routed experts one expert a (token, slot) at most)."""
    cfg = model.cfg
    dense = expert = embed_row = 0
    moe_layers = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        size = math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
        if "embed_tokens" in names:
            embed_row = size // leaf.shape[0]
        elif "experts" in names:  # the routed experts (the shared ones are "shared_experts")
            expert += size
        else:
            dense += size
    if cfg.moe_every:
        moe_layers = sum(1 for i in range(cfg.num_layers) if cfg.ffn_kind(i) == "moe")
    E = cfg.moe.num_experts
    return {"dense": dense, "per_expert_layer": expert // max(moe_layers * E, 1), "moe_layers": moe_layers,
            "num_experts": E, "top_k": cfg.moe.top_k, "embed_row": embed_row, "all_experts": expert}


def step_bytes(w: dict, c: dict, B: int, L: int) -> int:
    """Bytes one decode step of B sequences at context L must read (and write, for states)."""
    E, k = w["num_experts"], w["top_k"]
    distinct = E * (1 - (1 - k / E) ** B) if w["moe_layers"] else 0
    weights = w["dense"] + w["moe_layers"] * distinct * w["per_expert_layer"] + B * w["embed_row"]
    return int(weights + B * (c["per_slot"] * L + 2 * c["fixed"]))


def headroom(free: int | None) -> tuple[int, int]:
    """(tolerance, reserve) in bytes for a row's memory checks, given the free bytes before it:
    free bytes may come back `tolerance` short after a probe or run and still count as
    returned; `reserve` is held back beside the cache for the step's temporaries. (0, 0) where
    the device reports no free bytes (a CPU)."""
    if not free:
        return 0, 0
    return max(256 * MiB, int(0.002 * free)), max(2 * GiB, int(0.03 * free))


def prefill_flops(model, L: int) -> float:
    """2 x active parameters x tokens, plus MLA's causal attention in the expanded form."""
    cfg = model.cfg
    w = weight_figures(model)
    itemsize = jnp.dtype(cfg.param_dtype).itemsize
    active = (w["dense"] + w["moe_layers"] * w["top_k"] * w["per_expert_layer"]) / itemsize
    m = cfg.mla
    n_mla = sum(1 for x in cfg.mixers if x == "mla")
    attn = n_mla * m.num_heads * (L * L / 2) * 2 * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    return 2 * active * L + attn


def roofline_chip() -> Chip:
    """The chip whose spec the rooflines and MFU use: the running device's, or the H200 this
    benchmark was written for where JAX reports a device k3jax/chips.py does not know (a CPU)."""
    return chip_for_device_kind(jax.devices()[0].device_kind) or CHIPS["h200"]


def prefill_roofline(flops: float, weight_bytes: int, chunks: int, cache_bytes: int, chip: Chip) -> tuple[float, str]:
    """(seconds, bound) `chip`'s spec allows a prefill of `chunks` chunks: the larger of its
    FLOPs at the dense bf16 peak and the fewest bytes it must move at the HBM bandwidth (every
    chunk reads the weights; the cache is written once). Both are floors: a fraction of it over
    the measured time stays below 1."""
    compute = flops / (chip.peak_bf16_tflops * 1e12)
    memory = (chunks * weight_bytes + cache_bytes) / (chip.hbm_tbps * 1e12)
    return max(compute, memory), ("compute" if compute >= memory else "memory")


# ----------------------------------------------------------------------------------------
# bookkeeping


class Bench:
    def __init__(self, args, model_name: str):
        self.args = args
        self.t0 = time.perf_counter()
        self.chip = roofline_chip()
        self.result = {"device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
                       "roofline_chip": self.chip.name, "jax": jax.__version__, "model": model_name,
                       "args": vars(args), "records": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    def record(self, L: int) -> dict:
        for r in self.result["records"]:
            if r["context"] == L:
                return r
        r = {"context": L, "model": self.result["model"]}
        self.result["records"].append(r)
        return r

    def save(self):
        os.makedirs(self.args.out, exist_ok=True)
        path = os.path.join(self.args.out, "results.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    def log(self, msg: str):
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def measure(self, rec: dict, name: str, fn, need_s: float = 0.0):
        """rec[name] = fn() (a dict), or the error, or a skip when less than need_s is left."""
        if self.left() < need_s:
            rec[name] = {"skipped": f"time budget ({self.left():.0f} s left, about {need_s:.0f} s needed)"}
            self.save()
            self.log(f"L={rec['context']} {name}: skipped")
            return None
        t = time.perf_counter()
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - every failure is a result here
            traceback.print_exc()
            out = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        out["wall_s"] = round(time.perf_counter() - t, 2)
        rec[name] = out
        self.save()
        self.log(f"L={rec['context']} {name}: {json.dumps(out, default=str)[:400]}")
        return out


def is_oom(e) -> bool:
    """Whether an error (or its text) is an out-of-memory."""
    return bool(re.search(r"RESOURCE_EXHAUSTED|out of memory|Out of memory|OOM", str(e)))


def oom_bytes(e) -> int | None:
    """The allocation size an out-of-memory error (or its text) names, if it does."""
    m = re.search(r"allocate ([\d.]+)\s*([KMG]i?B|B|bytes)?", str(e))
    if not m:
        return None
    unit = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1e3, "MB": 1e6, "GB": 1e9}.get(m.group(2) or "", 1)
    return int(float(m.group(1)) * unit)


def delete(tree):
    """Free the device buffers of tree's arrays now (donated ones are gone already)."""
    dm.release(tree)
    gc.collect()


# ----------------------------------------------------------------------------------------
# the kernels on this device


def kernel_check(dtype=jnp.bfloat16) -> dict:
    """The decode kernels against an fp32 form of their math (benchmarks/checks/
    decode_kernels_check.py: limits from its error analysis); raises when one fails."""
    rows = dkc.kernel_check(dtype)
    if bad := dkc.failed(rows):
        raise RuntimeError(f"kernel check failed: {bad} ({rows})")
    return rows


def fused_kernel_check(dtype=jnp.bfloat16) -> dict:
    """The fused decode step's kernels, likewise."""
    rows = dkc.fused_kernel_check(dtype)
    if bad := dkc.failed(rows):
        raise RuntimeError(f"fused kernel check failed: {bad} ({rows})")
    return rows


# ----------------------------------------------------------------------------------------
# measurements


class Runner:
    """One model's compiled calls and its batch-1 cache."""

    def __init__(self, bench: Bench, model):
        self.bench, self.model = bench, model
        self.graphdef, self.state = nnx.split(model)
        self.w = weight_figures(model)
        self.timed = False  # whether any compiled call has run (a failure before is a build failure)

    def chunk_fn(self):
        graphdef = self.graphdef

        @functools.partial(jax.jit, donate_argnums=(2,))
        def run(state, tokens, cache):
            logits, cache = decode.prefill(nnx.merge(graphdef, state), tokens, cache,
                                           segment_ids=jnp.ones(tokens.shape, jnp.int32), last_only=True)
            return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache

        return run

    def loop_fn(self, steps: int):
        graphdef = self.graphdef

        @functools.partial(jax.jit, donate_argnums=(2,))
        def run(state, token, cache, index):
            B = token.shape[0]
            cache = dict(cache, index=index, next_position=jnp.full((B,), index, jnp.int32))
            tokens, cache = decode.decode_loop(nnx.merge(graphdef, state), token, cache, steps=steps)
            return tokens, cache

        return run

    # ---- prefill, one sequence of the largest context; rows for every context on the way

    def prefill(self, contexts: list[int], chunk: int, reserve_s: float) -> tuple:
        a, bench, model = self.bench.args, self.bench, self.model
        Lmax = contexts[-1]
        chunk = min(chunk, Lmax)
        if any(L % chunk for L in contexts):
            raise ValueError(f"--prefill-chunk {chunk} must divide every context {contexts}")
        cache = jax.jit(lambda: model.init_cache(1, Lmax))()
        cache_alloc = nbytes(cache)
        run = self.chunk_fn()
        rng = np.random.default_rng(0)
        tokens = lambda i: jnp.asarray(rng.integers(0, model.cfg.vocab_size, (1, chunk)), jnp.int32)  # noqa: E731
        t = time.perf_counter()
        compiled = run.lower(self.state, tokens(0), cache).compile()
        compile_s = time.perf_counter() - t
        mem = compiled.memory_analysis()
        temp = getattr(mem, "temp_size_in_bytes", None)
        t = time.perf_counter()
        token, cache = compiled(self.state, tokens(0), cache)  # warm-up chunk
        jax.block_until_ready(token)
        warm_s = time.perf_counter() - t
        self.timed = True
        cache = dict(cache, index=jnp.zeros((), jnp.int32), next_position=jnp.zeros((1,), jnp.int32),
                     segment_ids=jnp.full_like(cache["segment_ids"], -1))
        done, total_s, times = 0, 0.0, []
        for L in contexts:
            bench.record(L)["prefill"] = {"pending": True}
        while done < Lmax:
            last = times[-1] if times else warm_s
            if bench.left() - reserve_s < last * 1.1:
                break
            t = time.perf_counter()
            token, cache = compiled(self.state, tokens(done), cache)
            jax.block_until_ready(token)
            dt = time.perf_counter() - t
            times.append(dt)
            total_s += dt
            done += chunk
            if done in contexts:
                rec = bench.record(done)
                stats = dm.memory_stats()
                weights = nbytes(nnx.state(model, nnx.Param))
                flops = prefill_flops(model, done)
                roof_s, bound = prefill_roofline(flops, weights, done // chunk, cache_figures(model, done)["total"],
                                                 bench.chip)
                rec["prefill"] = {
                    "tokens": done, "seconds": round(total_s, 3), "tokens_per_s": done / total_s,
                    "chunk": chunk, "last_chunk_s": round(dt, 4),
                    "mfu": flops / total_s / (bench.chip.peak_bf16_tflops * 1e12),
                    "roofline_ms": 1e3 * roof_s, "roofline_fraction": roof_s / total_s, "roofline_bound": bound,
                    "peak_bytes_in_use": stats.get("peak_bytes_in_use"), "cache_bytes_allocated": cache_alloc,
                    "cache_bytes_needed": cache_figures(model, done)["total"], "chunk_temp_bytes": temp,
                    "weight_bytes": weights, "compile_s": round(compile_s, 1),
                    "warmup_chunk_s": round(warm_s, 2)}
                bench.save()
                bench.log(f"prefill {done} tokens: {total_s:.1f} s, {done / total_s:,.0f} tok/s")
        for L in contexts:
            rec = bench.record(L)
            if rec["prefill"].get("pending"):
                rec["prefill"] = {"skipped": "time budget", "tokens_done": done, "seconds": round(total_s, 2),
                                  "tokens_per_s_so_far": done / total_s if total_s else None,
                                  "chunk_seconds": [round(x, 3) for x in times]}
        bench.save()
        return token, cache, done

    # ---- decode at batch 1 on the prefilled cache

    def decode_batch1(self, token, cache, contexts: list[int], steps: int, profile: str | None = None):
        loop = self.loop_fn(steps)
        idx = lambda L: jnp.asarray(L - steps, jnp.int32)  # noqa: E731  the timed steps end at L
        t = time.perf_counter()
        compiled = loop.lower(self.state, token, cache, idx(contexts[-1])).compile()
        compile_s = time.perf_counter() - t
        self.timed = True
        for L in sorted(contexts, reverse=True):
            def measure(L=L):
                nonlocal cache
                tokens, cache = compiled(self.state, token, cache, idx(L))  # warm-up
                jax.block_until_ready(tokens)
                times = []
                for _ in range(self.bench.args.timed_calls):
                    t = time.perf_counter()
                    tokens, cache = compiled(self.state, token, cache, idx(L))
                    jax.block_until_ready(tokens)
                    times.append(time.perf_counter() - t)
                row = self._row(1, L, steps, times, compile_s=round(compile_s, 1))
                if profile and L == contexts[-1]:  # one more call, traced (the timed ones are not)
                    cache = traced_call(row, profile, lambda c: compiled(self.state, token, c, idx(L)), cache)
                return row
            self.bench.measure(self.bench.record(L), "decode_batch1", measure, need_s=5)
        return cache

    def _row(self, B: int, L: int, steps: int, times: list[float], **extra) -> dict:
        """A decode row from the timed calls' seconds (each `steps` steps): the median call."""
        c = cache_figures(self.model, L)
        seconds = float(np.median(times))
        step_s = seconds / steps
        moved = step_bytes(self.w, c, B, L)
        hbm = self.bench.chip.hbm_tbps * 1e12
        return {"batch": B, "tokens_per_s": B * steps / seconds, "ms_per_step": 1e3 * step_s, "steps": steps,
                "call_seconds": [round(t, 5) for t in times], "bytes_per_step": moved,
                "roofline_ms": 1e3 * moved / hbm, "roofline_fraction": moved / hbm / step_s,
                **extra}

    # ---- the largest batch at context L

    def cache_shapes(self, B: int, L: int):
        """B sequences' cache of L slots, as shapes (nothing allocated)."""
        return jax.eval_shape(lambda: self.model.init_cache(B, L))

    def synthetic_cache(self, B: int, L: int):
        """B sequences' cache of L slots with every slot filled (segment id 1), allocated one
        array per execution (device_memory.allocate): when one runs out of memory, the arrays
        made before it are deleted here and nothing else was allocated. (The 2026-12-01 run
        allocated the whole cache in one execution; it failed part way and the allocator stayed
        full: device_memory's docstring.)"""
        flat, treedef = jax.tree_util.tree_flatten_with_path(self.cache_shapes(B, L))
        arrays = []
        try:
            for path, s in flat:
                fill = 1 if getattr(path[0], "key", None) == "segment_ids" else 0
                arrays.append(dm.allocate(s.shape, s.dtype, fill))
        except BaseException:
            dm.release(arrays)
            raise
        return jax.tree.unflatten(treedef, arrays)

    def fits(self, B: int, L: int, reserve: int) -> bool:
        """Whether B sequences' cache and `reserve` more bytes can be allocated (really); both
        are deleted again before this returns."""
        cache = spare = None
        try:
            cache = self.synthetic_cache(B, L)
            spare = dm.allocate((max(reserve, 4) // 4,), jnp.float32)
            return True
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            dm.forget(e)
            return False
        finally:
            dm.release((cache, spare))
            cache = spare = None

    def largest_batch(self, L: int, steps: int, max_batch: int) -> dict:
        """The largest batch of L-slot sequences whose decode loop runs here, and its row.

        1. Probes: real allocations of the cache plus a reserve for the step's temporaries,
           bisected, but only of batches that fit the allocator's own count of free bytes
           (`cap`): asking for more can only fail, and a failed allocation can leave the
           allocator full for the rest of the process (the 2026-12-01 all-MLA 1M row:
           device_memory's docstring). The cap is probed first (on a GPU): it fits unless the
           memory is fragmented.
        2. Attempts: compile at B (no allocation), then check the cache plus XLA's temporaries
           and unaliased outputs (memory_analysis) against the free bytes; run (warm-up, timed
           calls). An out-of-memory shrinks B by the bytes the error names plus the step's
           temporaries, and by what the free bytes allow.
        After every probe and attempt its arrays are deleted, the garbage collected, jax's
        caches cleared, the arrays left alive listed (and deleted), and the free bytes must
        come back to what they were before the probes (within `tol`). When they do not, the
        row stops there with the figures: every later allocation would fail too."""
        c = cache_figures(self.model, L)
        keep = dm.baseline()  # the weights and whatever else outlives this row
        free = dm.free_bytes()
        tol, reserve = headroom(free)
        cap = max_batch if free is None else max(0, min(max_batch, (free - reserve) // c["total"]))
        info = {"free_bytes_before": free, "reserve_bytes": reserve, "cap": cap,
                "largest_free_block_bytes": dm.memory_stats().get("largest_free_block_bytes"),
                "live_bytes_before": dm.array_bytes(dm.live_arrays())}
        probes, attempts, checks = [], [], []

        def check(where: str) -> dict:
            """What the probe or attempt just finished left behind (see the docstring)."""
            rep = dm.scrub(keep)
            now = dm.settle(free, tol, SETTLE_S)
            rep = {"where": where, "free_bytes": now, **rep,
                   "held_bytes": None if now is None or free is None else max(0, free - now)}
            checks.append(rep)
            gb = lambda x: "n/a" if x is None else f"{x / 1e9:.2f} GB"  # noqa: E731
            self.bench.log(f"L={L} largest batch, {where}: live {gb(rep['live_bytes'])}, "
                           f"{rep['stray_arrays']} arrays left alive ({gb(rep['stray_bytes'])}), free {gb(now)}"
                           f" of {gb(free)} before")
            return rep

        def held(rep: dict) -> dict | None:
            if not rep["held_bytes"] or rep["held_bytes"] <= tol:
                return None
            return {"error": f"device memory not returned after {rep['where']}: {rep['held_bytes'] / 1e9:.2f} GB of "
                             f"the {free / 1e9:.2f} GB free before the probes are still in use, with "
                             f"{rep['stray_arrays']} arrays of this row alive ({rep['stray_bytes'] / 1e9:.2f} GB, "
                             "deleted); not retried: every allocation would fail, each after the allocator's wait",
                    "probes": probes, "attempts": attempts, "checks": checks, **info}

        lo, hi = 0, cap + 1  # lo fits (0 trivially), hi does not (or is past the cap)
        first = free is not None
        while hi - lo > 1:
            mid = hi - 1 if first else (lo + hi) // 2
            first = False
            ok = self.fits(mid, L, reserve)
            probes.append([mid, ok])
            if stop := held(check(f"probe {mid} ({'fits' if ok else 'does not fit'})")):
                return stop
            lo, hi = (mid, hi) if ok else (lo, mid)
        if lo == 0:
            return {"error": "not even one sequence fits", "probes": probes, **info}
        info["free_bytes_after_probes"] = dm.free_bytes()
        B = lo
        loop = self.loop_fn(steps)
        for _ in range(3):
            if B < 1:
                break
            att = {"batch": B}
            attempts.append(att)
            compiled, extra = self._compile_at(loop, B, L, att)
            beyond = max(reserve, extra + MARGIN)  # held back beside the cache
            now = dm.free_bytes()
            if now is not None and B * c["total"] + beyond > now:
                att["shrunk"] = (f"cache {B * c['total'] / 1e9:.2f} GB + {beyond / 1e9:.2f} GB for the step "
                                 f"(temporaries and unaliased outputs {extra / 1e9:.2f} GB) > {now / 1e9:.2f} GB free")
                B = min(B - 1, (now - beyond) // c["total"])
                compiled = None
                continue
            row, msg = self._run_at(compiled, B, L, steps, att, f"L{L}")
            compiled = None
            rep = check(f"batch {B} ({'ran' if row else 'out of memory'})")
            if row is not None:
                return {**row, "probes": probes, "attempts": attempts, "checks": checks, **info}
            if stop := held(rep):
                return stop
            # the bytes missing (at least what the error names) plus the step's temporaries
            named = oom_bytes(msg) or 0
            B_next = B - max(1, math.ceil((named + extra) / c["total"]))
            if rep["free_bytes"] is not None:
                B_next = min(B_next, (rep["free_bytes"] - beyond - named) // c["total"])
            att["next_batch"] = int(B_next)
            B = B_next
        return {"error": "out of memory at every batch tried", "probes": probes, "attempts": attempts,
                "checks": checks, **info}

    def _compile_at(self, loop, B: int, L: int, att: dict):
        """The decode loop compiled for B sequences of L slots (nothing allocated); att gets its
        compile seconds and XLA's temporaries. -> (compiled, bytes it needs beside the cache)."""
        t = time.perf_counter()
        compiled = loop.lower(self.state, jax.ShapeDtypeStruct((B,), jnp.int32), self.cache_shapes(B, L),
                              jax.ShapeDtypeStruct((), jnp.int32)).compile()
        ma = compiled.memory_analysis()
        size = lambda k: int(getattr(ma, k, 0) or 0)  # noqa: E731
        temp = size("temp_size_in_bytes")
        extra = temp + max(0, size("output_size_in_bytes") - size("alias_size_in_bytes"))
        att.update(temp_bytes=temp, extra_bytes=extra, compile_s=round(time.perf_counter() - t, 1))
        return compiled, extra

    def _run_at(self, compiled, B: int, L: int, steps: int, att: dict, trace: str):
        """One warm-up and the timed calls of `compiled` on a synthetic cache of B sequences (with
        --profile, one more call traced into PROFILE/`trace`); everything it allocated is released
        before it returns. -> (row, None), or (None, the out-of-memory message, also in
        att["error"]); any other failure raises."""
        token = index = cache = tokens = None
        try:
            token = jnp.asarray(np.arange(B) % self.model.cfg.vocab_size, jnp.int32)
            index = jnp.asarray(L - steps, jnp.int32)
            cache = self.synthetic_cache(B, L)
            tokens, cache = compiled(self.state, token, cache, index)  # warm-up
            jax.block_until_ready(tokens)
            times = []
            for _ in range(self.bench.args.timed_calls):
                t = time.perf_counter()
                tokens, cache = compiled(self.state, token, cache, index)
                jax.block_until_ready(tokens)
                times.append(time.perf_counter() - t)
            row = self._row(B, L, steps, times, compile_s=att["compile_s"], temp_bytes=att["temp_bytes"],
                            extra_bytes=att["extra_bytes"])
            prof = getattr(self.bench.args, "profile", None)
            if prof:  # the row's call traced once more (the timed calls are not)
                cache = traced_call(row, os.path.join(prof, trace),
                                    lambda c: compiled(self.state, token, c, index), cache)
            return row, None
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            msg = dm.forget(e)  # the traceback's frames would keep this attempt's arrays alive
            att["error"] = msg[:300]
            return None, msg
        finally:
            dm.release((token, index, cache, tokens))
            token = index = cache = tokens = None

    # ---- chosen batches at context L

    def batch_sweep(self, L: int, steps: int, batches: list[int]) -> dict:
        """A decode row at each of `batches` (B sequences of L slots, synthetic caches), in
        increasing order: the batches between the fused step's limit
        (model.decode_fused_max_batch) and the largest measured instead of assumed. Each row
        names the step that ran (`fused`: decode_gemv.runs_fused, the model's own rule). The
        sweep ends, keeping the rows before, at a batch whose cache and step do not fit what is
        free (the figures in its row), at the first out-of-memory or other failure (larger
        batches would fail too), when memory is not returned after a row, or when less than
        --largest-need-s of the time budget is left. With --profile each row's call is traced
        into PROFILE/L<context>_B<batch>."""
        from k3jax.layers.decode_gemv import runs_fused

        c = cache_figures(self.model, L)
        keep = dm.baseline()
        free = dm.free_bytes()
        tol, reserve = headroom(free)
        need_s = self.bench.args.largest_need_s
        loop = self.loop_fn(steps)
        rows = []
        for B in sorted(set(batches)):
            att = {"batch": B, "fused": runs_fused(self.model.cfg, B)}
            rows.append(att)
            if self.bench.left() < need_s:
                att["skipped"] = f"time budget ({self.bench.left():.0f} s left, about {need_s:.0f} s needed)"
                break
            now = dm.free_bytes()
            if now is not None and B * c["total"] + reserve > now:
                att["skipped"] = f"cache {B * c['total'] / 1e9:.2f} GB + {reserve / 1e9:.2f} GB > {now / 1e9:.2f} GB free"
                break
            compiled, row, msg = None, None, None
            try:
                compiled, extra = self._compile_at(loop, B, L, att)
                beyond = max(reserve, extra + MARGIN)
                now = dm.free_bytes()
                if now is not None and B * c["total"] + beyond > now:
                    att["skipped"] = (f"cache {B * c['total'] / 1e9:.2f} GB + {beyond / 1e9:.2f} GB for the step "
                                      f"> {now / 1e9:.2f} GB free")
                else:
                    row, msg = self._run_at(compiled, B, L, steps, att, f"L{L}_B{B}")
            except Exception as e:  # noqa: BLE001 - a failure ends the sweep; the rows before it stand
                traceback.print_exc()
                msg = dm.forget(e)
                att["error"] = f"{type(e).__name__}: {msg[:300]}"
            compiled = None
            if row is not None:
                att.update(row)
                self.bench.log(f"L={L} batch {B} ({'fused' if att['fused'] else 'plain'} step): "
                               f"{row['tokens_per_s']:,.1f} tokens/s, {100 * row['roofline_fraction']:.1f} % of "
                               "its roofline")
            rep = dm.scrub(keep)
            after = dm.settle(free, tol, SETTLE_S)
            if free is not None and after is not None and free - after > tol:
                att["held_bytes"] = free - after
                att["error"] = (att.get("error", "") + f" device memory not returned: {(free - after) / 1e9:.2f} GB "
                                f"still in use ({rep['stray_arrays']} arrays of this row deleted)").strip()
                break
            if row is None:
                break
        return {"rows": rows, "free_bytes_before": free, "reserve_bytes": reserve}


def traced_call(row: dict, path: str, call, cache):
    """One more decode call, `call(cache) -> (tokens, cache)`, under jax.profiler into `path`;
    the row notes the trace, or why there is none (the row stands without it). -> the cache."""
    try:
        jax.profiler.start_trace(path, create_perfetto_trace=True)
        try:
            tokens, cache = call(cache)
            jax.block_until_ready(tokens)
        finally:
            jax.profiler.stop_trace()
        row["profile"] = path
    except Exception as e:  # noqa: BLE001 - the row stands without its trace
        row["profile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return cache


def run_model(a, name: str):
    overrides = list(a.overrides)
    if not any(o.startswith("model.param_dtype=") for o in overrides):
        overrides.append("model.param_dtype=bfloat16")  # served weights
    if name == "all_mla":
        pattern = load_config(a.config, overrides).model.layer_pattern
        overrides.append(f"model.layer_pattern={all_mla(pattern)}")
    cfg = load_config(a.config, overrides)
    bench = Bench(a, name)
    contexts = sorted(int(x) for x in a.contexts.split(","))
    bench.result["layer_pattern"] = cfg.model.layer_pattern
    if jax.default_backend() == "gpu" and cfg.model.decode_impl != "xla":
        try:
            bench.result["kernel_check"] = kernel_check()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            bench.result["kernel_check"] = {"error": f"{type(e).__name__}: {str(e)[:400]}", "fallback": "xla"}
            overrides.append("model.decode_impl=xla")
            cfg = load_config(a.config, overrides)
        bench.log(f"kernel check: {bench.result['kernel_check']}")
    if jax.default_backend() == "gpu" and cfg.model.decode_impl != "xla" and cfg.model.decode_fused:
        try:
            bench.result["fused_kernel_check"] = fused_kernel_check()
        except Exception as e:  # noqa: BLE001 - the step runs without the fused kernels
            traceback.print_exc()
            bench.result["fused_kernel_check"] = {"error": f"{type(e).__name__}: {str(e)[:400]}",
                                                  "fallback": "decode_fused=false"}
            overrides.append("model.decode_fused=false")
            cfg = load_config(a.config, overrides)
        bench.log(f"fused kernel check: {bench.result['fused_kernel_check']}")
    bench.result["tuning"] = {k: dict(v) for k, v in tuning_tables().items()}
    parts = set(a.parts.split(","))
    while True:
        bench.result["decode_impl"] = cfg.model.decode_impl
        bench.result["decode_fused"] = cfg.model.decode_fused
        model = create_model(cfg.model, 0)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        runner = Runner(bench, model)
        bench.result["weights"] = runner.w
        for L in contexts:
            rec = bench.record(L)
            rec["layer_pattern"] = cfg.model.layer_pattern
            rec["cache_bytes_per_sequence"] = cache_figures(model, L)["total"]
        bench.save()
        if not parts & {"prefill", "decode1"}:
            break
        token = cache = None
        try:
            if "prefill" in parts:
                token, cache, _ = runner.prefill(contexts, a.prefill_chunk, a.decode_reserve_s)
            else:
                cache = jax.jit(lambda: model.init_cache(1, contexts[-1]))()
                token = jnp.zeros((1,), jnp.int32)
            if "decode1" in parts:
                cache = runner.decode_batch1(token, cache, contexts, a.decode_steps, a.profile)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            err = f"{type(e).__name__}: {str(e)[:400]}"
            for L in contexts:
                if (bench.record(L).get("prefill") or {}).get("pending"):
                    bench.record(L)["prefill"] = {"error": err}
            if not runner.timed and cfg.model.decode_impl != "xla" and not is_oom(e):
                # the kernels built alone (kernel check) but not inside the model: without the
                # fused step's kernels first, then the plain path
                step_back = "model.decode_fused=false" if cfg.model.decode_fused else "model.decode_impl=xla"
                bench.result.setdefault("fallbacks", []).append({"from": cfg.model.decode_impl,
                                                                 "fused": cfg.model.decode_fused, "error": err})
                delete((token, cache))
                overrides.append(step_back)
                cfg = load_config(a.config, overrides)
                continue
            bench.result["batch1_error"] = err
        delete((token, cache))
        bench.save()
        break
    if "batches" in parts:
        for L in contexts:
            bench.measure(bench.record(L), "decode_batches",
                          lambda L=L: runner.batch_sweep(L, a.largest_steps, a.batches), need_s=a.largest_need_s)
    if "largest" in parts:
        for L in contexts:
            bench.measure(bench.record(L), "decode_largest_batch",
                          lambda L=L: runner.largest_batch(L, a.largest_steps, a.max_batch), need_s=a.largest_need_s)
    bench.log("done")
    return bench.result


# ----------------------------------------------------------------------------------------
# summary


def summarize(results: list[dict], out: str):
    """One results.json for both models, summary.md (rows, ratios) and long_decode.png."""
    merged = {}  # a later folder's measurements of one (context, model) fill in an earlier one's
    for res in results:
        for r in res["records"]:
            old = merged.setdefault((r["context"], r["model"]), {})
            for k, v in r.items():
                failed = isinstance(v, dict) and ("skipped" in v or "error" in v)
                if k not in old or not failed:
                    old[k] = v
    records = list(merged.values())
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"runs": [{k: v for k, v in res.items() if k != "records"} for res in results],
                   "records": records}, f, indent=1, default=str)
    get = lambda r, k, f: (r.get(k) or {}).get(f)  # noqa: E731
    fmt = lambda x, p=0: "n/a" if x is None else f"{x:,.{p}f}"  # noqa: E731
    kind = results[0].get("device_kind", "?") if results else "?"
    lines = [f"# Long-context inference, {kind}, jax {jax.__version__}", "",
             "| context | model | cache / seq (GB) | prefill tok/s | prefill peak (GB) | decode b=1 tok/s "
             "(ms/step, roofline) | largest batch | decode tok/s there (roofline) |",
             "|---|---|---|---|---|---|---|---|"]
    def pct(d):
        return "n/a" if d.get("roofline_fraction") is None else f"{100 * d['roofline_fraction']:.0f} %"

    for r in sorted(records, key=lambda r: (r["context"], r["model"])):
        b1, big = r.get("decode_batch1") or {}, r.get("decode_largest_batch") or {}
        peak = get(r, "prefill", "peak_bytes_in_use")
        lines.append(
            f"| {r['context']:,} | {r['model']} | {fmt(r.get('cache_bytes_per_sequence', 0) / 1e9, 3)} | "
            f"{fmt(get(r, 'prefill', 'tokens_per_s'))} | {fmt(peak / 1e9 if peak else None, 1)} | "
            f"{fmt(b1.get('tokens_per_s'), 1)} ({fmt(b1.get('ms_per_step'), 2)} ms, {pct(b1)}) | "
            f"{big.get('batch', 'n/a')} | {fmt(big.get('tokens_per_s'), 0)} ({pct(big)}) |")
    lines += ["", "Hybrid against all-MLA:", ""]
    by = {(r["context"], r["model"]): r for r in records}
    for L in sorted({r["context"] for r in records}):
        h, m = by.get((L, "hybrid")), by.get((L, "all_mla"))
        if not (h and m):
            continue
        parts = [f"cache ratio {h['cache_bytes_per_sequence'] / m['cache_bytes_per_sequence']:.3f}"]
        for k, label in (("prefill", "prefill"), ("decode_batch1", "decode b=1"),
                         ("decode_largest_batch", "decode at each one's largest batch")):
            x, y = get(h, k, "tokens_per_s"), get(m, k, "tokens_per_s")
            if x and y:
                parts.append(f"{label} x{x / y:.2f}")
        lines.append(f"- {L:,}: " + ", ".join(parts))
    sweeps = [r for r in sorted(records, key=lambda r: (r["context"], r["model"]))
              if (r.get("decode_batches") or {}).get("rows")]
    if sweeps:
        lines += ["", "Chosen batches (`--parts batches`): tokens/s (roofline), the step that ran:", "",
                  "| context | model | batch | tokens/s | roofline | step |",
                  "|---|---|---|---|---|---|"]
        for r in sweeps:
            for row in r["decode_batches"]["rows"]:
                what = "fused" if row.get("fused") else "plain"
                if "tokens_per_s" not in row:
                    what += f": {(row.get('skipped') or row.get('error') or 'not run')[:80]}"
                lines.append(f"| {r['context']:,} | {r['model']} | {row['batch']} | {fmt(row.get('tokens_per_s'), 1)} "
                             f"| {pct(row)} | {what} |")
    lines += ["", "Errors and skips: results.json (each measurement's `error` / `skipped`)."]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name in ("hybrid", "all_mla"):
        rs = sorted((r for r in records if r["model"] == name), key=lambda r: r["context"])
        axes[0].plot([r["context"] for r in rs], [r.get("cache_bytes_per_sequence", np.nan) / 1e9 for r in rs], "o-",
                     label=name)
        for k, style in (("decode_batch1", "o-"), ("decode_largest_batch", "s--")):
            pts = [(r["context"], get(r, k, "tokens_per_s")) for r in rs if get(r, k, "tokens_per_s")]
            if pts:
                axes[1].plot(*zip(*pts), style, label=f"{name}, {'b=1' if k == 'decode_batch1' else 'largest batch'}")
        pts = [(r["context"], get(r, "prefill", "tokens_per_s")) for r in rs if get(r, "prefill", "tokens_per_s")]
        if pts:
            axes[2].plot(*zip(*pts), "o-", label=name)
    for ax, title in zip(axes, ("decode cache per sequence (GB)", "decode tokens/s", "prefill tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:  # a panel with no rows (e.g. a sweep-only run) has no legend
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "long_decode.png"), dpi=120)


PARTS = {"prefill", "decode1", "largest", "batches"}


def batch_list(text: str) -> list[int]:
    """'8,16,24' -> [8, 16, 24] (argparse type: a clear error for anything else)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, e.g. 8,16,24; got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1; got {text!r}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/k3-small.yaml")
    p.add_argument("--model", choices=("hybrid", "all_mla"), default="hybrid")
    p.add_argument("--contexts", default="32768,131072,1048576")
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=540.0, help="no measurement starts that would end after this")
    p.add_argument("--parts", default="prefill,decode1,largest", help="which measurements (comma-separated)")
    p.add_argument("--prefill-chunk", type=int, default=32768)
    p.add_argument("--decode-steps", type=int, default=64, help="timed steps per call at batch 1")
    p.add_argument("--largest-steps", type=int, default=16, help="timed steps per call at the largest batch")
    p.add_argument("--timed-calls", type=int, default=3, help="timed calls per decode row (the median is the figure)")
    p.add_argument("--decode-reserve-s", type=float, default=200.0,
                   help="seconds the prefill leaves for the decode measurements")
    p.add_argument("--largest-need-s", type=float, default=45.0, help="seconds a largest-batch row needs to start")
    p.add_argument("--max-batch", type=int, default=4096)
    p.add_argument("--batches", type=batch_list, default=[8, 16, 24, 32, 48],
                   help="with --parts batches: the batch sizes to decode at, e.g. 8,16,24,32,48")
    p.add_argument("--profile", default=None,
                   help="a jax.profiler trace of one batch-1 decode call (--decode-steps steps) at the largest context; "
                        "with --parts largest, one more call of each largest-batch row, per context (DIR/L<context>); "
                        "with --parts batches, of each chosen batch (DIR/L<context>_B<batch>). "
                        "XLA runs a traced call op by op, without its command buffers (CUDA graphs)")
    p.add_argument("--tuning", default="", help="kernel launch parameters, e.g. prefill.block_q=64,decode.block=128,"
                   "decode.programs=1056,gemv.block_n=32 (k3jax/ops/decode_kernels: each kernel's TUNING; "
                   "`tuning_tables`)")
    p.add_argument("--summarize", nargs="+", default=None, help="join these folders' results.json into --out")
    p.add_argument("overrides", nargs="*", help="config key=value")
    a = p.parse_args(argv)
    unknown = set(a.parts.split(",")) - PARTS
    if unknown:
        p.error(f"--parts: unknown {', '.join(sorted(unknown))}; the parts are {', '.join(sorted(PARTS))}")
    if a.summarize:
        results = []
        for d in a.summarize:
            with open(os.path.join(d, "results.json")) as f:
                results.append(json.load(f))
        summarize(results, a.out)
        return
    os.makedirs(a.out, exist_ok=True)
    set_tuning(a.tuning)
    from train.kernel_tuning import TokamaxLogFilter, quiet_tokamax, untuned_line

    # tokamax logs a ~1,000-character absl warning per kernel shape without a tuned config for
    # this GPU (the MoE's grouped GEMM at a large batch): counted, said once, as `train` does
    log_filter = TokamaxLogFilter()
    with quiet_tokamax(log_filter):
        run_model(a, a.model)
    if log_filter.missed():
        print(f"long_decode: {untuned_line(log_filter, jax.devices()[0].device_kind)}", flush=True)


def tuning_tables() -> dict:
    """The decode kernels' launch parameters, by the name --tuning gives them."""
    from k3jax.ops.decode_kernels import attnres_norm, gemv, kda_layer, mla_decode, mla_layer, mla_prefill, moe_experts

    return {"prefill": mla_prefill.TUNING, "decode": mla_decode.TUNING, "gemv": gemv.TUNING,
            "attnres": attnres_norm.TUNING, "kda_layer": kda_layer.TUNING, "mla_layer": mla_layer.TUNING,
            "moe": moe_experts.TUNING}


def set_tuning(text: str):
    """'prefill.block_q=64,decode.block=128' -> the kernels' TUNING dicts."""
    tables = tuning_tables()
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        kernel, _, name = key.partition(".")
        if kernel not in tables or name not in tables[kernel]:
            raise SystemExit(f"--tuning: unknown key {key!r}; expected one of "
                             f"{[f'{k}.{n}' for k, t in tables.items() for n in t]}")
        tables[kernel][name] = int(value)


if __name__ == "__main__":
    main()
