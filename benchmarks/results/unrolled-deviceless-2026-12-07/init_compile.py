"""Compile k3-small's init (jit_init) for a compile-only H200; print the time."""
import sys, time
import jax
from k3jax.chips import CHIPS
from k3jax.config import load_config
from k3jax.ops.planning import planning_for
from train.plan.target import target_mesh
from k3jax.sharding.mesh import AXES, mesh_shape
from train.setup import prepare
from train.state import init_train_state
from train.xla_flags import GPU_XLA_OPTIONS

over = sys.argv[1:]
cfg = load_config("configs/k3-small.yaml", ["mesh.num_devices=1", "train.batch_size=8", "train.micro_batches=1"] + over)
sizes = mesh_shape(cfg.mesh, 1)
mesh = target_mesh(CHIPS["h200"], 1, tuple(sizes[a] for a in AXES), AXES)
with planning_for("gpu", target_compiler=True):
    setup = prepare(cfg, mesh=mesh)
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        lowered = jax.jit(lambda: init_train_state(cfg, setup.spec, setup.tx), out_shardings=setup.shardings).lower()
        t1 = time.perf_counter()
        print(f"lowered in {t1-t0:.1f} s", flush=True)
        text = lowered.as_text()
        print("stablehlo lines", text.count("\n"), "rng ops", text.count("threefry") , flush=True)
        compiled = lowered.compile(compiler_options=GPU_XLA_OPTIONS)
        print(f"compiled in {time.perf_counter()-t1:.1f} s", flush=True)
        hlo = compiled.as_text()
        print("fusions", hlo.count(" fusion("), "hlo lines", hlo.count("\n"))
