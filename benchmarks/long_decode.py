"""Long-context decode on one GPU: the hybrid (KDA + MLA) against the same model with every mixer MLA.

    python benchmarks/long_decode.py --config configs/k3-small.yaml --out runs/long_decode \
        [--contexts 32768,131072,1048576] [--budget-s 240]

For each context L and each model (both loaded once), while the time budget lasts; first the
decode rate at batch 1 for every (L, model), then the largest batch, then prefill:
  - cache bytes per sequence: the decode cache for one sequence of L tokens (exact, from its
    shapes: KDA fp32 state + conv windows, MLA latent + rope key, the slot segment ids);
  - decode tokens/s at batch 1, on a cache holding L - steps tokens (synthetic contents: the
    cost of a decode step depends on the cache's shapes, not its values);
  - decode tokens/s at the largest batch that fits: estimated from the free device memory and
    the per-sequence cache and decode transients, tried, halved once on failure;
  - prefill tokens/s of the last `--prefill-chunk` tokens of an L-token prompt (a chunked
    prefill's step at that depth: the chunk attends over the whole cache; at L = chunk it is
    the whole prefill).
Every measurement is recorded with its error if it fails; a measurement that would start after
the budget is recorded as skipped. Writes results.json, summary.md and (with matplotlib)
long_decode.png under --out. CPU smoke test:

    python benchmarks/long_decode.py --config configs/k3-tiny.yaml --contexts 256,512 \
        --prefill-chunk 128 --decode-steps 2 --max-batch 4 --out /tmp/ld
"""

from __future__ import annotations

import argparse
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
from k3jax.config import load_config
from k3jax.model import create_model

LINEAR = ("kda", "gated_deltanet", "deltanet", "linear")


def all_mla(pattern: str) -> str:
    """The layer pattern with every linear-attention mixer replaced by MLA."""
    return re.sub(r"\b(" + "|".join(LINEAR) + r")\b", "mla", pattern)


def cache_bytes(model, batch: int, length: int) -> dict:
    """Bytes of the decode cache from its shapes (nothing allocated): mixer state and total."""
    shapes = jax.eval_shape(lambda: model.init_cache(batch, length))
    def nbytes(tree):
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    return {"layers": nbytes(shapes["layers"]), "total": nbytes(shapes)}


def synthetic_cache(model, batch: int, length: int, filled: int):
    """A cache of `length` slots whose first `filled` hold one document (id 1); zero contents."""
    cache = model.init_cache(batch, length)
    slots = jnp.arange(length, dtype=jnp.int32)
    cache["segment_ids"] = jnp.broadcast_to(jnp.where(slots < filled, 1, -1), (batch, length)).astype(jnp.int32)
    cache["index"] = jnp.asarray(filled, jnp.int32)
    cache["next_position"] = jnp.full((batch,), filled, jnp.int32)
    return cache


def free_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


class Bench:
    def __init__(self, args):
        self.args = args
        self.t0 = time.perf_counter()
        self.records = []

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def measure(self, rec: dict, name: str, fn):
        """Run fn() -> dict into rec[name], recording errors and budget skips."""
        if self.left() <= 0:
            rec[name] = {"skipped": "time budget"}
            return None
        t = time.perf_counter()
        try:
            out = fn()
            out["wall_s"] = round(time.perf_counter() - t, 2)
            rec[name] = out
            return out
        except Exception as e:  # noqa: BLE001 - every failure is a result here
            rec[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "wall_s": round(time.perf_counter() - t, 2)}
            traceback.print_exc()
            return None
        finally:
            self.save()
            print(f"[{time.perf_counter() - self.t0:6.1f}s] L={rec['context']} {rec['model']} {name}: {rec[name]}",
                  flush=True)

    def save(self):
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, "results.json"), "w") as f:
            json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "args": vars(self.args),
                       "records": self.records}, f, indent=1)


def decode_rate(model, batch: int, length: int, steps: int) -> dict:
    graphdef, state = nnx.split(model)

    def step(state, token, cache):
        logits, cache = decode.decode_step(nnx.merge(graphdef, state), token, cache)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache

    step = jax.jit(step, donate_argnums=(2,))
    cache = synthetic_cache(model, batch, length, length - steps - 1)
    token = jnp.zeros((batch,), jnp.int32)
    t = time.perf_counter()
    token, cache = step(state, token, cache)  # compile + one step
    jax.block_until_ready(token)
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(steps):
        token, cache = step(state, token, cache)
    jax.block_until_ready(token)
    dt = time.perf_counter() - t
    del cache
    return {"batch": batch, "tokens_per_s": batch * steps / dt, "ms_per_step": 1e3 * dt / steps,
            "compile_s": round(compile_s, 2)}


def prefill_rate(model, length: int, chunk: int, repeats: int) -> dict:
    chunk = min(chunk, length)
    graphdef, state = nnx.split(model)

    def run(state, tokens, cache):
        logits, cache = decode.prefill(nnx.merge(graphdef, state), tokens, cache,
                                       segment_ids=jnp.ones(tokens.shape, jnp.int32))
        return logits[:, -1], cache

    run = jax.jit(run, donate_argnums=(2,))
    tokens = jnp.zeros((1, chunk), jnp.int32)
    cache = synthetic_cache(model, 1, length, length - chunk)
    t = time.perf_counter()
    out, cache = run(state, tokens, cache)
    jax.block_until_ready(out)
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        cache = synthetic_cache(model, 1, length, length - chunk)
        t = time.perf_counter()
        out, cache = run(state, tokens, cache)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    del cache
    dt = min(times) if times else first
    return {"chunk": chunk, "at_position": length - chunk, "tokens_per_s": chunk / dt, "s_per_chunk": dt,
            "first_call_s": round(first, 2)}


def per_seq_decode_bytes(model_cfg, length: int, cache_seq: int) -> int:
    """Per-sequence bytes of a decode step: the cache (kept, donated) plus the largest transient,
    one MLA layer's fp32 scores and probabilities [H, S] (x2 for the fp32 mask and softmax)."""
    return int(cache_seq + 4 * model_cfg.mla.num_heads * length * 4)


def largest_batch(bench: Bench, model, model_cfg, length: int, cache_seq: int) -> dict:
    a = bench.args
    free = free_bytes()
    need = per_seq_decode_bytes(model_cfg, length, cache_seq)
    b = a.max_batch if free is None else max(1, min(a.max_batch, int(0.85 * free / need)))
    if b <= 1:
        return {"batch": 1, "note": "only one sequence fits", "free_bytes": free}
    try:
        out = decode_rate(model, b, length, a.decode_steps)
    except Exception as e:  # noqa: BLE001 - out of memory: try half once
        first_err = f"{type(e).__name__}: {str(e)[:200]}"
        b //= 2
        out = decode_rate(model, b, length, a.decode_steps)
        out["first_try_error"] = first_err
    out["free_bytes_before"] = free
    return out


def run_all(bench: Bench, configs: dict, lengths: list[int]):
    """Both models stay loaded; the measurements go by importance across contexts (decode at
    batch 1 everywhere, then the largest batch, then prefill), so a short budget still covers
    every context with the headline numbers."""
    a = bench.args
    models, recs = {}, {}
    for name, cfg in configs.items():
        try:
            models[name] = create_model(cfg.model, 0)
            jax.block_until_ready(jax.tree.leaves(nnx.state(models[name])))
        except Exception as e:  # noqa: BLE001
            models[name] = f"{type(e).__name__}: {str(e)[:300]}"
        for L in lengths:
            rec = {"context": L, "model": name, "layer_pattern": cfg.model.layer_pattern}
            if isinstance(models[name], str):
                rec["model_error"] = models[name]
            else:
                per_seq = cache_bytes(models[name], 1, L)
                rec["cache_bytes_per_sequence"] = per_seq["total"]
                rec["mixer_cache_bytes_per_sequence"] = per_seq["layers"]
            recs[L, name] = rec
            bench.records.append(rec)
    bench.save()
    live = [(L, n) for L in lengths for n in configs if not isinstance(models[n], str)]
    for L, n in live:
        bench.measure(recs[L, n], "decode_batch1", lambda L=L, n=n: decode_rate(models[n], 1, L, a.decode_steps))
    for L, n in live:
        bench.measure(recs[L, n], "decode_largest_batch",
                      lambda L=L, n=n: largest_batch(bench, models[n], configs[n].model, L,
                                                     recs[L, n]["cache_bytes_per_sequence"]))
    for L, n in live:
        bench.measure(recs[L, n], "prefill",
                      lambda L=L, n=n: prefill_rate(models[n], L, a.prefill_chunk, a.prefill_repeats))


def summarize(bench: Bench):
    """summary.md: one row per (context, model), ratios hybrid vs all-MLA; the plot."""
    recs = bench.records
    by = {(r["context"], r["model"]): r for r in recs}
    def get(r, k, f="tokens_per_s"):
        return (r.get(k) or {}).get(f)

    header = ("| context | model | cache / seq (GB) | prefill tok/s (last chunk) | decode tok/s b=1 | "
              "largest batch | decode tok/s there |")
    lines = [f"# Long-context decode, {jax.devices()[0].device_kind}, jax {jax.__version__}", "",
             header, "|---|---|---|---|---|---|---|"]
    def fmt(x, p=0):
        return "n/a" if x is None else f"{x:,.{p}f}"

    for r in recs:
        big = r.get("decode_largest_batch") or {}
        lines.append(f"| {r['context']:,} | {r['model']} | {fmt(r.get('cache_bytes_per_sequence', 0) / 1e9, 3)} | "
                     f"{fmt(get(r, 'prefill'))} | {fmt(get(r, 'decode_batch1'), 1)} | {big.get('batch', 'n/a')} | "
                     f"{fmt(big.get('tokens_per_s'), 1)} |")
    lines += ["", "Ratios (hybrid vs all-MLA):", ""]
    for L in sorted({r["context"] for r in recs}):
        h, m = by.get((L, "hybrid")), by.get((L, "all_mla"))
        if not (h and m):
            continue
        mem = 1 - h.get("cache_bytes_per_sequence", 0) / max(m.get("cache_bytes_per_sequence", 1), 1)
        parts = [f"cache -{100 * mem:.1f}%"]
        for k, label in (("decode_batch1", "decode b=1"), ("decode_largest_batch", "decode at the largest batch")):
            a, b = get(h, k), get(m, k)
            if a and b:
                parts.append(f"{label} x{a / b:.2f}")
        lines.append(f"- {L:,}: " + ", ".join(parts))
    lines += ["", "Errors and skips are in results.json (each measurement's `error` / `skipped`)."]
    with open(os.path.join(bench.args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("hybrid", "all_mla"):
        rs = sorted((r for r in recs if r["model"] == name), key=lambda r: r["context"])
        ax1.plot([r["context"] for r in rs], [r.get("cache_bytes_per_sequence", np.nan) / 1e9 for r in rs], "o-",
                 label=name)
        for k, style in (("decode_batch1", "o-"), ("decode_largest_batch", "s--")):
            pts = [(r["context"], get(r, k)) for r in rs if get(r, k)]
            if pts:
                ax2.plot(*zip(*pts), style, label=f"{name}, {'b=1' if k == 'decode_batch1' else 'largest batch'}")
    for ax, title in ((ax1, "decode cache per sequence (GB)"), (ax2, "decode tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(bench.args.out, "long_decode.png"), dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/k3-small.yaml")
    p.add_argument("--contexts", default="32768,131072,1048576")
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=240.0, help="no measurement starts after this many seconds")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.add_argument("--prefill-repeats", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("overrides", nargs="*", help="config key=value")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.join(a.out, "jax-cache"))
    bench = Bench(a)
    hybrid = load_config(a.config, list(a.overrides))
    mla = load_config(a.config, list(a.overrides) + [f"model.layer_pattern={all_mla(hybrid.model.layer_pattern)}"])
    run_all(bench, {"hybrid": hybrid, "all_mla": mla}, sorted(int(x) for x in a.contexts.split(",")))
    bench.save()
    summarize(bench)


if __name__ == "__main__":
    main()
