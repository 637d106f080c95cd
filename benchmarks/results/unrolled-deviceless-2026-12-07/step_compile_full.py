"""k3-small's train step (8 x 4096, one micro-batch) compiled for a compile-only H200 with full
code generation (XLA:GPU's LLVM and ptxas, as k3jax-train compiles it), timed.

    PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1 python step_compile_full.py [key=value ...]
"""
import sys
import time

from benchmarks.tools.glue_regions import k3_small_on_h200
from train.xla_flags import GPU_XLA_OPTIONS

with k3_small_on_h200(sys.argv[1:], 8) as (cfg, setup):
    t0 = time.perf_counter()
    lowered = setup.train_step(cfg).lower(*setup.abstract_args(cfg))
    t1 = time.perf_counter()
    print(f"lowered in {t1-t0:.1f} s", flush=True)
    compiled = lowered.compile(compiler_options=GPU_XLA_OPTIONS)
    print(f"compiled in {time.perf_counter()-t1:.1f} s", flush=True)
