"""A model's init (create_model) on XLA:CPU with the test suite's flags, timed in a fresh process.

    PYTHONPATH=. python cpu_init.py fused|buffer configs/k3-tiny.yaml [key=value ...]

fused: the draw fused into every parameter's slice, as before 7699459 (MATERIALIZED_DRAW_MAX = 0).
"""
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                      "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402
from flax import nnx  # noqa: E402

import k3jax.layers.common as common  # noqa: E402
from k3jax.config import load_config  # noqa: E402
from k3jax.model import create_model  # noqa: E402

if sys.argv[1] == "fused":
    common.MATERIALIZED_DRAW_MAX = 0
cfg = load_config(sys.argv[2], sys.argv[3:])
t = time.perf_counter()
jax.block_until_ready(jax.tree.leaves(nnx.state(create_model(cfg.model, 0))))
print(sys.argv[1], sys.argv[2], f"{time.perf_counter() - t:.2f} s")
