"""Everything a training step needs besides data, built once from a config.

The CLI, the benchmarks and the compile-only checks all start here, so they train, time
and size the same program.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from k3jax.sharding import batch_sharding, make_mesh, state_shardings
from train.checkpoint import abstract_with_shardings
from train.kernel_tuning import KernelTuner, quiet_tokamax
from train.optimizer import build_optimizer, schedule_steps
from train.state import ModelSpec, abstract_train_state, model_spec
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
    """Mesh (from cfg.mesh unless given), model spec, optimizer and the state's shardings."""
    mesh = make_mesh(cfg.mesh) if mesh is None else mesh
    spec = model_spec(cfg.model, cfg.train.seed)
    tx, schedule = build_optimizer(cfg.optimizer, schedule_steps(cfg), spec.params)
    abstract = abstract_train_state(cfg, spec, tx)
    return StepSetup(mesh, spec, tx, schedule, abstract, state_shardings(mesh, spec, tx, abstract),
                     batch_sharding(mesh))


def compile_steps(cfg, setup: StepSetup, tuner: KernelTuner, *, with_eval: bool = False):
    """The train step (and the eval step) compiled ahead of time: k3jax-train compiles before
    its clock starts, so tokens/s never includes a compile and no eval stalls on one.
    tokamax's kernels get their tuned configs here (train/kernel_tuning.py): loaded, or tuned
    on a chip's first launch. Returns (train step, eval step or None)."""
    abstract = setup.abstract_args(cfg)

    def lower():
        fns = [setup.train_step(cfg)] + ([setup.eval_step(cfg)] if with_eval else [])
        return [f.lower(*abstract) for f in fns]

    with quiet_tokamax(tuner.log_filter):
        tuner.load()
        with jax.set_mesh(setup.mesh):
            lowered = lower()
        if tuner.after_lowering(lowered):  # tokamax benchmarks its kernels on one device, off the mesh
            with jax.set_mesh(setup.mesh):
                lowered = lower()  # with the tuned configs
        with jax.set_mesh(setup.mesh):
            compiled = [low.compile() for low in lowered]
    return compiled[0], (compiled[1] if with_eval else None)
