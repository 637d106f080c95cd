"""The train state: plain nested dicts of arrays (what the optimizer and Orbax see).

    {"params": fp32 master weights, "rest": non-trainable state (the QB router bias),
     "opt_state": optax state, "step": int32, "rng": uint32[2]}

"rng" is never read (the step draws no random numbers: no dropout; the data pipeline seeds
itself from the config). It stays because every checkpoint holds it and Orbax restores only
into the saved tree structure: without it, existing checkpoints would no longer restore.

The model's structure (graphdef) and the parameters' metadata (`templates`) stay static;
`model_from` rebuilds the nnx model inside jit from the arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import traversals

from k3jax.model import K3Model, create_model


@dataclass(frozen=True)
class ModelSpec:
    """Static description of a model: graphdef plus abstract Param / other-variable states."""

    graphdef: nnx.GraphDef
    params: nnx.State   # abstract, with metadata (axes, init)
    rest: nnx.State

    def model_from(self, params: dict, rest: dict) -> K3Model:
        return nnx.merge(self.graphdef, state_from_pure(self.params, params), state_from_pure(self.rest, rest))


def state_from_pure(template: nnx.State, pure: dict) -> nnx.State:
    """An nnx.State with `template`'s variables and metadata and `pure`'s values."""
    values = traversals.flatten_mapping(pure)
    return nnx.from_flat_state([(p, v.replace(value=values[p])) for p, v in nnx.to_flat_state(template)])


def model_spec(model_cfg, seed: int = 0) -> ModelSpec:
    abstract = nnx.eval_shape(lambda: K3Model(model_cfg, rngs=nnx.Rngs(seed)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    return ModelSpec(graphdef, params, rest)


def init_train_state(cfg, spec: ModelSpec, tx, *, shardings=None) -> dict:
    """Fresh parameters (one fused draw), optimizer state, step 0 and the run's RNG key."""
    def init():
        model = create_model(cfg.model, cfg.train.seed)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
        return {"params": params, "rest": rest, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(jax.random.PRNGKey(cfg.train.seed))}
    return jax.jit(init, out_shardings=shardings)()


def train_state_from_weights(cfg, tx, params: dict, rest: dict, *, shardings=None) -> dict:
    """Step 0 of a run that starts from given weights (k3jax-import): those params and router
    bias, a fresh optimizer state, the run's RNG key."""
    def init(params, rest):
        return {"params": params, "rest": rest, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(jax.random.PRNGKey(cfg.train.seed))}
    return jax.jit(init, out_shardings=shardings)(params, rest)


def abstract_train_state(cfg, spec: ModelSpec, tx) -> dict:
    return jax.eval_shape(lambda: init_train_state(cfg, spec, tx))
