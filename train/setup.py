"""Everything a training step needs besides data, built once from a config.

The CLI, the benchmarks and the compile-only checks all start here, so they train, time
and size the same program.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from k3jax.config.schema import replace
from k3jax.sharding import batch_sharding, make_mesh, state_shardings
from train import scan_outputs
from train.checkpoint import abstract_with_shardings
from train.relayout import stage_layout
from train.compile_thread import DeferredCompile
from train.kernel_tuning import KernelTuner, quiet_tokamax
from train.optimizer import build_optimizer, schedule_steps
from k3jax.model_spec import ModelSpec, model_spec
from train.state import abstract_train_state
from train.step import BATCH_KEYS, compile_step, make_eval_step, make_train_step


@dataclass(frozen=True)
class StepSetup:
    mesh: jax.sharding.Mesh
    spec: ModelSpec
    tx: object  # optax.GradientTransformation
    schedule: object  # step -> learning rate
    abstract: dict  # the train state as ShapeDtypeStructs
    shardings: dict  # its shardings on `mesh`
    rows: jax.sharding.NamedSharding  # the batch's sharding

    def train_step(self, cfg, *, donate: bool = True):
        """The jitted (not yet compiled) train step; the state is donated unless told not to."""
        return compile_step(make_train_step(cfg, self.spec, self.tx, self.schedule), self.shardings, self.rows,
                            donate=donate)

    def with_schedule(self, cfg) -> "StepSetup":
        """The same setup with the optimizer and schedule rebuilt for `cfg` (e.g. the schedule
        length a resumed run keeps); the state's layout does not depend on them."""
        tx, schedule = build_optimizer(cfg.optimizer, schedule_steps(cfg), self.spec.params)
        return dataclasses.replace(self, tx=tx, schedule=schedule)

    def eval_step(self, cfg):
        return jax.jit(make_eval_step(cfg, self.spec), in_shardings=(self.shardings, self.rows))

    def abstract_args(self, cfg):
        """(state, batch) as sharded ShapeDtypeStructs, for lowering without allocating."""
        shape = (cfg.train.batch_size, cfg.data.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32, sharding=self.rows)
                 for k in BATCH_KEYS}
        return abstract_with_shardings(self.abstract, self.shardings), batch


def prepare(cfg, mesh=None) -> StepSetup:
    """Mesh (from cfg.mesh unless given), model spec, optimizer and the state's shardings; sets
    how scans start their outputs (`train.scan_output_init` on one device, else zeros;
    process-wide: train/scan_outputs.py)."""
    mesh = make_mesh(cfg.mesh) if mesh is None else mesh
    scan_outputs.install(cfg.train.scan_output_init, mesh.size)
    spec = model_spec(cfg.model, cfg.train.seed)
    tx, schedule = build_optimizer(cfg.optimizer, schedule_steps(cfg), spec.params)
    abstract = abstract_train_state(cfg, spec, tx)
    return StepSetup(mesh, spec, tx, schedule, abstract, state_shardings(mesh, spec, tx, abstract),
                     batch_sharding(mesh))


def setup_in_layout(setup: StepSetup, cfg, saved_model) -> StepSetup:
    """`setup` (prepared from `cfg`) when `saved_model` stores its layers where cfg's model does;
    otherwise the same run prepared in saved_model's layer layout (`model.scan_layers`, the one
    knob that moves them), on the same mesh: what a checkpoint or imported weights written in
    that layout are read into before train.relayout moves them into `setup`'s."""
    if stage_layout(saved_model) == stage_layout(cfg.model):
        return setup
    return prepare(replace(cfg, **{"model.scan_layers": saved_model.scan_layers}), setup.mesh)


@dataclass
class CompiledSteps:
    """What `compile_steps` returns: the compiled train step; the eval step's compile, under way
    or deferred (`.result()` gives the compiled step); and where the seconds went."""
    train: object
    eval: DeferredCompile | None
    lower_s: float  # tracing and lowering both steps (twice when kernels were tuned), tuning excluded
    train_compile_s: float  # the train step's compile alone (from the persistent cache when it hits)


def compile_steps(cfg, setup: StepSetup, tuner: KernelTuner, *, with_eval: bool = False,
                  eval_in_background: bool = True) -> CompiledSteps:
    """The train step compiled ahead of time, and the eval step's compile started beside it:
    k3jax-train compiles before its clock starts, so tokens/s never includes a compile, and its
    first step waits for the train step's compile only (train/compile_thread.py).
    tokamax's kernels get their configs here (train/kernel_tuning.py): tuned earlier and
    loaded, tuned now when `train.autotune_budget_s` asks, else its heuristics.

    eval_in_background: compile the eval step on a thread while the train step compiles (one
    process); False defers it to the first `result()` call (several processes: each compiles
    its programs in the same order)."""
    abstract = setup.abstract_args(cfg)

    def lower():
        fns = [setup.train_step(cfg)] + ([setup.eval_step(cfg)] if with_eval else [])
        return [f.lower(*abstract) for f in fns]

    t0 = time.perf_counter()
    with quiet_tokamax(tuner.log_filter):
        tuner.load()
        with jax.set_mesh(setup.mesh):
            lowered = lower()
        if tuner.after_lowering(lowered):  # tokamax benchmarks its kernels on one device, off the mesh
            with jax.set_mesh(setup.mesh):
                lowered = lower()  # with the tuned configs
        lower_s = time.perf_counter() - t0 - tuner.tuned_s
        # the eval step first, so that it compiles beside the train step
        pending = DeferredCompile(lowered[1], setup.mesh, background=eval_in_background) if with_eval else None
        t0 = time.perf_counter()
        with jax.set_mesh(setup.mesh):
            train = lowered[0].compile()
    return CompiledSteps(train, pending, lower_s, time.perf_counter() - t0)
