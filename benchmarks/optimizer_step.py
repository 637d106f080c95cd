"""The optimizer update alone on a model's parameter tree: AdamW against (per-head) Muon.

    python benchmarks/optimizer_step.py [--config configs/k3-small.yaml] [--variants ...] [--json out.json]

Times `tx.update` + `optax.apply_updates` (jitted, state donated) on the full parameter tree
with a random gradient, for each variant:

    adamw           optimizer.name=adamw (the train step's default)
    muon            whole-matrix Muon, Newton-Schulz batched by shape in bf16 (train/muon.py)
    muon_head       per-head Muon (optimizer.muon_per_head=true), bf16: the issue-23 goal is
                    train step with it <= 1.05 x the AdamW step
    muon_head_fp32  per-head Muon, batched, fp32 Newton-Schulz (optimizer.muon_dtype=float32)
    optax_head      per-head Muon through optax.contrib.muon itself (one Newton-Schulz chain per
                    parameter, fp32): the form train/muon.py replaced

Each row: ms per update (mean of --iters after 2 warm-ups), compile seconds, and the Newton-
Schulz FLOPs per update (the expert matrices dominate: k3-small per head, 19.3 TFLOP).
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

from k3jax.config import load_config
from train.optimizer import build_optimizer, muon_dimension_numbers, muon_view
from train.state import model_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "k3-small.yaml"))
    ap.add_argument("--variants", default="adamw,muon_head,muon_head_fp32,optax_head")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    rows = []
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
        finite = bool(all(jnp.isfinite(x).all() for x in jax.tree.leaves(params)))
        row = dict(variant=name, ms=round(ms, 2), compile_s=round(compile_s, 1),
                   ns_tflop=round(ns_tflop(cfg, spec.params), 3), finite=finite, backend=jax.default_backend())
        print(json.dumps(row), flush=True)
        rows.append(row)
        del params, state, grads, run
    base = next((r["ms"] for r in rows if r["variant"] == "adamw"), None)
    if base:
        for r in rows:
            r["vs_adamw_ms"] = round(r["ms"] - base, 2)
        print(json.dumps({r["variant"]: r["vs_adamw_ms"] for r in rows}), flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
