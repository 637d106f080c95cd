import runpy, sys
import jax
import k3jax.layers.common as common
import k3jax.model as model
orig_normal, orig_uniform = jax.random.normal, jax.random.uniform
def normal(*a, **k):
    return jax.lax.optimization_barrier(orig_normal(*a, **k))
def uniform(*a, **k):
    return jax.lax.optimization_barrier(orig_uniform(*a, **k))
common.jax.random.normal = normal  # materialize's module
common.jax.random.uniform = uniform
sys.argv = ["init_compile.py"] + sys.argv[1:]
runpy.run_path("/tmp/g42/init_compile.py", run_name="__main__")
