"""The planner's analytic figures of a config: its abstract train state, parameter counts,
model FLOPs per step and the step's compute time at a chip's peak rate (k3jax-plan).

FLOPs: `k3jax.flops.train_flops_per_token` * B * T per step; the lower bound on the step time
is that divided by devices * peak, and remat=full adds about one forward pass (x 4/3).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from flax import nnx

from k3jax.chips import CHIPS, DEFAULT_CHIP
from k3jax.config.schema import Config
from k3jax.flops import train_flops_per_token
from k3jax.model_sizes import param_counts
from k3jax.model_spec import ModelSpec, model_spec
from train.optimizer import build_optimizer, schedule_steps
from train.state import abstract_train_state

FULL_REMAT_RECOMPUTE = 4 / 3  # remat=full runs about one forward pass again


class AbstractRun(NamedTuple):
    """What a config trains, as shapes (nothing allocated)."""

    spec: ModelSpec
    tx: object  # the optax optimizer
    state: dict  # the train state's ShapeDtypeStructs
    model: object  # the abstract nnx model


def abstract_run(cfg) -> AbstractRun:
    """The abstract train state of a config, shared by the plans of one model on any mesh."""
    return _abstract_cached(cfg.model, cfg.optimizer, cfg.train)


@functools.lru_cache(maxsize=4)  # the mesh and batch do not change the state: reuse it across plans
def _abstract_cached(model_cfg, opt_cfg, train_cfg) -> AbstractRun:
    cfg = Config(model=model_cfg, optimizer=opt_cfg, train=train_cfg)
    spec = model_spec(cfg.model, cfg.train.seed)
    tx, _ = build_optimizer(cfg.optimizer, schedule_steps(cfg), spec.params)
    state = abstract_train_state(cfg, spec, tx)
    return AbstractRun(spec, tx, state, nnx.merge(spec.graphdef, spec.params, spec.rest))


def config_param_counts(cfg) -> dict[str, int]:
    """Parameters by component (`k3jax.model_sizes.param_counts`) of the config's model."""
    return param_counts(abstract_run(cfg).model)


def model_flops_per_step(cfg, batch: int, seq: int, counts: dict[str, int] | None = None) -> float:
    """The model's training FLOPs of one step of `batch` rows of `seq` tokens (no recompute)."""
    counts = counts if counts is not None else config_param_counts(cfg)
    return train_flops_per_token(cfg.model, seq, counts) * batch * seq


def step_compute_seconds(cfg, num_devices: int, peak_tflops: float | None = None, *, batch: int | None = None,
                         seq: int | None = None, counts: dict[str, int] | None = None) -> float:
    """The step's compute per device at the peak rate, with the remat recompute (batch and seq:
    the config's by default); peak_tflops: the default GPU's (k3jax.chips) unless given."""
    peak_tflops = peak_tflops or CHIPS[DEFAULT_CHIP["gpu"]].peak_bf16_tflops
    batch = batch or cfg.train.batch_size
    seq = seq or cfg.data.seq_len
    flops = model_flops_per_step(cfg, batch, seq, counts)
    recompute = FULL_REMAT_RECOMPUTE if cfg.model.remat == "full" else 1.0
    return flops * recompute / num_devices / (peak_tflops * 1e12)
