"""k3-small's init (init_train_state, as k3jax-train runs it) compiled for a compile-only H200; prints the times.

    PYTHONPATH=. python init_compile.py [--fused] [key=value ...]

--fused: the draw fused into every parameter's slice, as before 7699459 (MATERIALIZED_DRAW_MAX = 0).
"""
import sys
import time

import jax

import k3jax.layers.common as common
from benchmarks.tools.glue_regions import k3_small_on_h200
from train.state import init_train_state
from train.xla_flags import GPU_XLA_OPTIONS

overrides = [a for a in sys.argv[1:] if a != "--fused"]
if "--fused" in sys.argv[1:]:
    common.MATERIALIZED_DRAW_MAX = 0
with k3_small_on_h200(overrides, 8) as (cfg, setup):
    t0 = time.perf_counter()
    lowered = jax.jit(lambda: init_train_state(cfg, setup.spec, setup.tx), out_shardings=setup.shardings).lower()
    t1 = time.perf_counter()
    print(f"lowered in {t1-t0:.1f} s", flush=True)
    text = lowered.as_text()
    print("stablehlo lines", text.count("\n"), "rng ops", text.count("threefry"), flush=True)
    compiled = lowered.compile(compiler_options=GPU_XLA_OPTIONS)
    print(f"compiled in {time.perf_counter()-t1:.1f} s", flush=True)
    hlo = compiled.as_text()
    print("fusions", hlo.count(" fusion("), "hlo lines", hlo.count("\n"))
