"""k3-small's train step (8 x 4096, one micro-batch) compiled for a compile-only H200 with full
code generation (XLA:GPU's LLVM and ptxas), timed."""
import sys, time
import jax
from k3jax.chips import CHIPS
from k3jax.config import load_config
from k3jax.ops.planning import planning_for
from train.plan.target import target_mesh
from k3jax.sharding.mesh import AXES, mesh_shape
from train.setup import prepare
from train.xla_flags import GPU_XLA_OPTIONS

cfg = load_config("configs/k3-small.yaml", ["mesh.num_devices=1", "train.batch_size=8", "train.micro_batches=1"] + sys.argv[1:])
sizes = mesh_shape(cfg.mesh, 1)
mesh = target_mesh(CHIPS["h200"], 1, tuple(sizes[a] for a in AXES), AXES)
with planning_for("gpu", target_compiler=True):
    setup = prepare(cfg, mesh=mesh)
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        lowered = setup.train_step(cfg).lower(*setup.abstract_args(cfg))
        t1 = time.perf_counter()
        print(f"lowered in {t1-t0:.1f} s", flush=True)
        compiled = lowered.compile(compiler_options=GPU_XLA_OPTIONS)
        print(f"compiled in {time.perf_counter()-t1:.1f} s", flush=True)
