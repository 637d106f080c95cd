import sys, time, os
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_force_host_platform_device_count=8")
import jax
if sys.argv[1] == "barrier":
    import k3jax.layers.common as common
    n, u = jax.random.normal, jax.random.uniform
    common.jax.random.normal = lambda *a, **k: jax.lax.optimization_barrier(n(*a, **k))
    common.jax.random.uniform = lambda *a, **k: jax.lax.optimization_barrier(u(*a, **k))
from k3jax.config import load_config
from k3jax.model import create_model
cfg = load_config(sys.argv[2], sys.argv[3:])
t = time.perf_counter(); m = create_model(cfg.model, 0); jax.block_until_ready(jax.tree.leaves(__import__("flax").nnx.state(m)))
print(sys.argv[1], sys.argv[2], f"{time.perf_counter()-t:.2f} s")
