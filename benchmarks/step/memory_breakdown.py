"""Compile-only memory of a training step, for finding what a config's memory goes to.

    python -m benchmarks.step.memory_breakdown --model k3-small [key=value ...]

Lowers and compiles the real train step on abstract inputs (nothing is allocated, so it runs
on a CPU for a GPU-sized config) and prints XLA's memory analysis: arguments (params,
optimizer state, batch), outputs and the temporary buffer, whose peak is what a device must
hold beyond the state. Compare variants (model.remat=..., model.layer_pattern=...,
model.moe_every=0) to attribute the temporaries. XLA:CPU schedules differently from GPU,
so read the ratios, not the bytes, as the GPU's.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from benchmarks.step.train_step import build  # noqa: E402

from train.setup import prepare  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="k3-small")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    cfg = build(a.model, ["mesh.num_devices=1", *a.overrides])
    setup = prepare(cfg)
    B, T = cfg.train.batch_size, cfg.data.seq_len
    t0 = time.perf_counter()
    with jax.set_mesh(setup.mesh):
        compiled = setup.train_step(cfg).lower(*setup.abstract_args(cfg)).compile()
    m = compiled.memory_analysis()
    gib = 2 ** 30
    row = dict(model=a.model, overrides=a.overrides, tokens=B * T, backend=jax.default_backend(),
               argument_gib=round(m.argument_size_in_bytes / gib, 2), output_gib=round(m.output_size_in_bytes / gib, 2),
               temp_gib=round(m.temp_size_in_bytes / gib, 2),
               temp_kib_per_token=round(m.temp_size_in_bytes / 1024 / (B * T), 1),
               compile_s=round(time.perf_counter() - t0, 1))
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
