"""The optimizer update alone on a model's parameter tree: AdamW against (per-head) Muon.

    python -m benchmarks.step.optimizer_step [--config configs/k3-small.yaml] [--variants ...] [--ns]
        [--ranks N] [--profile DIR] [--json out.json]

Times `tx.update` + `optax.apply_updates` (jitted, state donated) on the full parameter tree
with a random gradient, for each variant:

    adamw            optimizer.name=adamw (the train step's default)
    muon             whole-matrix Muon, Newton-Schulz batched by shape in bf16 (train/muon.py)
    muon_head        per-head Muon (optimizer.muon_per_head=true), bf16: the issue-23 goal is
                     the train step with it <= 1.05 x the AdamW step
    muon_head_fp32   per-head Muon, batched, fp32 Newton-Schulz (optimizer.muon_dtype=float32)
    optax_head       per-head Muon through optax.contrib.muon itself (one Newton-Schulz chain per
                     parameter, fp32): the form train/muon.py replaced

Each row: ms per update (mean of --iters after 2 warm-ups), compile seconds, and the Newton-
Schulz FLOPs per update (the expert matrices dominate: k3-small per head, 19.3 TFLOP).
--ns adds a row for the orthogonalisation alone (`orthogonalize` on the per-head Muon leaves,
bf16), with the TFLOP/s it reaches. (The form before the issue-23 round, variant
muon_head_before and row ns_before, was timed with a frozen copy of the old train/muon.py,
kept as a record: benchmarks/results/issue23-close-2026-12-03/muon_before.py.)
--ceiling adds, for each per-head chain of
at least --ceiling-min-tflop (0.5) an update, that chain's Newton-Schulz alone against its
three products (Gram, A A, P X) each timed alone as one batched bf16 matmul with fp32
accumulation: what the chain would take if nothing but its matmuls ran, at the rate XLA's
matmuls reach on those shapes. --ranks N adds one data-parallel rank's share of the per-head
Newton-Schulz sharded over N ranks (train/muon_mesh's chunks for mesh data=N, timed on this one
device), the results' all-gather modelled, not measured (`rank_rows`). --profile DIR traces 3
updates of each Muon variant into DIR/<variant> (benchmarks/tools/profile_summary.py reads them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import train.muon as muon_mod
from benchmarks.bench_util import Rows, ms_per_call
from k3jax.config import load_config
from k3jax.model_spec import model_spec
from train.optimizer import build_optimizer, muon_dimension_numbers, muon_partition_spec, muon_view

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = {
    "adamw": ["optimizer.name=adamw"],
    "muon": ["optimizer.name=muon"],
    "muon_head": ["optimizer.name=muon", "optimizer.muon_per_head=true"],
    "muon_head_fp32": ["optimizer.name=muon", "optimizer.muon_per_head=true", "optimizer.muon_dtype=float32"],
    "optax_head": ["optimizer.name=muon", "optimizer.muon_per_head=true"],
}


def ns_tflop(cfg, params) -> float:
    """Newton-Schulz FLOPs of one update: per matrix [m, n] (m <= n), steps x (4 m^2 n + 2 m^3)."""
    o, total = cfg.optimizer, 0.0
    if o.name != "muon":
        return 0.0
    for p, v in nnx.to_flat_state(params):
        d = muon_dimension_numbers(p, v, o.muon_per_head)
        if d is None:
            continue
        shape, _ = muon_view(v, o.muon_per_head)
        red, out = tuple(np.atleast_1d(d.reduction_axis)), tuple(np.atleast_1d(d.output_axis))
        b = math.prod(s for i, s in enumerate(shape) if i not in red + out)
        m, n = sorted((math.prod(shape[i] for i in red), math.prod(shape[i] for i in out)))
        total += b * o.muon_ns_steps * (4 * m * m * n + 2 * m ** 3)
    return total / 1e12


def optax_per_head(cfg, params):
    """build_optimizer's Muon with optax.contrib.muon in place of train/muon.py (same labels,
    views, decay masks and AdamW branch)."""
    import train.optimizer as opt_mod

    def contrib(schedule, *, ns_steps, beta, weight_decay, weight_decay_mask, dimension_numbers, consistent_rms,
                dtype, partition_specs=None):
        del dtype, partition_specs  # one device: optax's Muon has no sharded Newton-Schulz
        return optax.contrib.muon(schedule, ns_steps=ns_steps, beta=beta, nesterov=True, weight_decay=weight_decay,
                                  weight_decay_mask=weight_decay_mask, muon_weight_dimension_numbers=dimension_numbers,
                                  consistent_rms=consistent_rms)

    saved = opt_mod.batched_muon
    opt_mod.batched_muon = contrib
    try:
        return build_optimizer(cfg.optimizer, 1000, params)[0]
    finally:
        opt_mod.batched_muon = saved


def per_head_leaves(a):
    """The per-head Muon config and parameters of --config, and each Muon leaf's matrix view:
    (cfg, params, shapes, dimension numbers, partition specs)."""
    cfg = load_config(a.config, VARIANTS["muon_head"] + a.overrides)
    params = model_spec(cfg.model, 0).params
    shapes, dims, specs = [], [], []
    for p, v in nnx.to_flat_state(params):
        d = muon_dimension_numbers(p, v, True)
        if d is not None:
            shapes.append(muon_view(v, True)[0])
            dims.append(d)
            specs.append(muon_partition_spec(v, True))
    return cfg, params, shapes, dims, specs


def ns_rows(a) -> list[dict]:
    """`orthogonalize` alone on the per-head Muon leaves (random momentum, their Muon views),
    bf16."""
    cfg, params, shapes, dims, specs = per_head_leaves(a)
    o = cfg.optimizer
    key = iter(jax.random.split(jax.random.key(1), len(shapes)))
    leaves = [1e-3 * jax.random.normal(next(key), s, jnp.float32) for s in shapes]
    tflop = ns_tflop(cfg, params)
    rows = Rows()
    name, fn = "ns_now", muon_mod.orthogonalize
    f = jax.jit(lambda *x, fn=fn: fn(list(x), dims, steps=o.muon_ns_steps, specs=specs))
    t0 = time.perf_counter()
    run = f.lower(*leaves).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(2):
        out = run(*leaves)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(a.iters):
        out = run(*leaves)
    jax.block_until_ready(out)
    ms = (time.perf_counter() - t0) / a.iters * 1e3
    row = dict(variant=name, ms=round(ms, 2), compile_s=round(compile_s, 1), ns_tflop=round(tflop, 3),
               tflops=round(tflop / ms * 1e3, 1), backend=jax.default_backend())
    rows.add(row)
    del out, run
    return rows


def ceiling_rows(a) -> list[dict]:
    """Per large per-head chain: its Newton-Schulz (train/muon.py newton_schulz, bf16) against
    its three products timed alone, each a batched [n, r, c] bf16 matmul with fp32 accumulation."""
    cfg, _, shapes, dims, _ = per_head_leaves(a)
    o = cfg.optimizer
    # planned without partition specs: each stage's leaves are a chain of their own (the optimizer,
    # which has the specs, concatenates them); the rates are per shape either way
    groups = muon_mod.plan_groups([jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes], dims)
    rows = Rows()
    for key, idx in groups.chains.items():
        lays = [groups.layouts[i] for i in idx]
        r, c = lays[0].matrix
        n = sum(math.prod(lay.batch) for lay in lays)
        m, big = min(r, c), max(r, c)
        step_flop = n * (4 * m * m * big + 2 * m ** 3)
        if o.muon_ns_steps * step_flop < a.ceiling_min_tflop * 1e12:
            continue
        x = (1e-3 * jax.random.normal(jax.random.key(2), (n, r, c), jnp.float32)).astype(jnp.bfloat16)
        a_mm = jax.random.normal(jax.random.key(3), (n, m, m), jnp.float32).astype(jnp.bfloat16)
        ns_ms = ms_per_call(jax.jit(lambda x: muon_mod.newton_schulz(x, steps=o.muon_ns_steps)), x, iters=a.iters)
        gram = "nji,njk->nik" if r > c else "nij,nkj->nik"
        px = "nij,njk->nik"
        prods = {"gram": (gram, (x, x), 2 * n * m * m * big),
                 "a_a": ("nij,njk->nik", (a_mm, a_mm), 2 * n * m ** 3),
                 "p_x": (px, (x, a_mm) if r > c else (a_mm, x), 2 * n * m * m * big)}
        row = dict(variant="ceiling", chain=f"{n} x [{r}, {c}]", ns_ms=round(ns_ms, 2),
                   ns_tflops=round(o.muon_ns_steps * step_flop / ns_ms / 1e9, 1))
        alone = 0.0
        for name, (eq, args, flop) in prods.items():
            product = jax.jit(lambda p, q, eq=eq: jnp.einsum(eq, p, q, preferred_element_type=jnp.float32)
                              .astype(jnp.bfloat16))
            ms = ms_per_call(product, *args, iters=a.iters)
            row[f"{name}_ms"], row[f"{name}_tflops"] = round(ms, 3), round(flop / ms / 1e9, 1)
            alone += ms
        row["products_alone_ms"] = round(o.muon_ns_steps * alone, 2)  # one step's three, times the steps
        rows.add(row)
    return rows


def rank_rows(a) -> list[dict]:
    """--ranks N: one data-parallel rank's share of per-head Muon's Newton-Schulz when the update
    is sharded over N ranks (mesh data=N, the parameters replicated over it): the chunks
    `train.plan.optimizer.rank_share` counts, orthogonalised in one program on this one device
    (measured). The results' all-gather cannot be measured on one device: its bytes and their
    time at this chip's link bandwidths (k3jax/chips.py) are the planner's model, labelled so."""
    from k3jax.chips import chip_for_device_kind
    from k3jax.sharding.mesh import AXES
    from train.plan.optimizer import rank_share

    cfg, _, shapes, dims, specs = per_head_leaves(a)
    o = cfg.optimizer
    chip = chip_for_device_kind(jax.devices()[0].device_kind)
    plan = rank_share([jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes], dims, specs,
                      {ax: 1 for ax in AXES} | {"data": a.ranks}, steps=o.muon_ns_steps,
                      itemsize=jnp.dtype(o.muon_dtype).itemsize,
                      links_gbs={"nvlink": chip.intra_node_gbs, "network": chip.inter_node_gbs} if chip else None,
                      devices_per_node=chip.devices_per_node if chip else 8)
    key = iter(jax.random.split(jax.random.key(4), len(plan["chunks"])))
    xs = [(1e-3 * jax.random.normal(next(key), c, jnp.float32)).astype(o.muon_dtype) for c in plan["chunks"]]
    run = jax.jit(lambda *x: [muon_mod.newton_schulz(m, steps=o.muon_ns_steps, dtype=o.muon_dtype) for m in x])
    ms = ms_per_call(run, *xs, iters=a.iters)
    row = dict(variant=f"ns_rank_of_{a.ranks}", ranks=a.ranks, buckets=plan["buckets"], chunks=len(plan["chunks"]),
               ms=round(ms, 2), ns_tflop=round(plan["flops"] / 1e12, 3), tflops=round(plan["flops"] / ms / 1e9, 1),
               all_gather_gb_modelled={k: round(v / 1e9, 3) for k, v in plan["all_gather_bytes"].items()},
               all_gather_ms_modelled=None if plan["all_gather_s"] is None else round(plan["all_gather_s"] * 1e3, 2),
               backend=jax.default_backend())
    rows = Rows()
    rows.add(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "k3-small.yaml"))
    ap.add_argument("--variants", default="adamw,muon_head")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ns", action="store_true", help="also time the orthogonalisation alone")
    ap.add_argument("--ceiling", action="store_true", help="also time each large chain's products alone")
    ap.add_argument("--ceiling-min-tflop", type=float, default=0.5, help="--ceiling's chains: at least this per update")
    ap.add_argument("--profile", default=None, help="trace 3 updates of each Muon variant under this folder")
    ap.add_argument("--ranks", type=int, default=0,
                    help="also time one rank's share of the Newton-Schulz sharded over this many data-parallel ranks")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    rows = Rows()
    for name in a.variants.split(","):
        cfg = load_config(a.config, VARIANTS[name] + a.overrides)
        spec = model_spec(cfg.model, 0)
        tx = optax_per_head(cfg, spec.params) if name == "optax_head" else \
            build_optimizer(cfg.optimizer, 1000, spec.params)[0]
        shapes = nnx.to_pure_dict(spec.params)
        key = iter(jax.random.split(jax.random.key(0), 4 * len(jax.tree.leaves(shapes))))
        params = jax.tree.map(lambda s: 0.02 * jax.random.normal(next(key), s.shape, s.dtype), shapes)
        grads = jax.tree.map(lambda s: 1e-3 * jax.random.normal(next(key), s.shape, s.dtype), shapes)
        state = jax.jit(tx.init)(params)

        def step(params, state, grads):
            upd, state = tx.update(grads, state, params)
            return optax.apply_updates(params, upd), state

        t0 = time.perf_counter()
        run = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
        compile_s = time.perf_counter() - t0
        for _ in range(2):
            params, state = run(params, state, grads)
        jax.block_until_ready(params)
        t0 = time.perf_counter()
        for _ in range(a.iters):
            params, state = run(params, state, grads)
        jax.block_until_ready(params)
        ms = (time.perf_counter() - t0) / a.iters * 1e3
        if a.profile and name != "adamw":
            jax.profiler.start_trace(os.path.join(a.profile, name), create_perfetto_trace=True)
            for _ in range(3):
                params, state = run(params, state, grads)
            jax.block_until_ready(params)
            jax.profiler.stop_trace()
        finite = bool(all(jnp.isfinite(x).all() for x in jax.tree.leaves(params)))
        row = dict(variant=name, ms=round(ms, 2), compile_s=round(compile_s, 1),
                   ns_tflop=round(ns_tflop(cfg, spec.params), 3), finite=finite, backend=jax.default_backend())
        rows.add(row)
        del params, state, grads, run
    if a.ns:
        rows += ns_rows(a)
    if a.ceiling:
        rows += ceiling_rows(a)
    if a.ranks > 1:
        rows += rank_rows(a)
    base = next((r["ms"] for r in rows if r["variant"] == "adamw"), None)
    if base:
        for r in rows:
            if "ms" in r:
                r["vs_adamw_ms"] = round(r["ms"] - base, 2)
        print(json.dumps({r["variant"]: r["vs_adamw_ms"] for r in rows if "ms" in r}), flush=True)
    rows.write(a.json)


if __name__ == "__main__":
    main()
