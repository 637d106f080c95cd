"""The train state: plain nested dicts of arrays (what the optimizer and Orbax see).

    {"params": fp32 master weights, "rest": non-trainable state (the QB router bias),
     "opt_state": optax state, "step": int32, "rng": uint32[2]}

"rng" is never read (the step draws no random numbers: no dropout; the data pipeline seeds
itself from the config). It stays because every checkpoint holds it and Orbax restores only
into the saved tree structure: without it, existing checkpoints would no longer restore.

The model's structure (graphdef) and the parameters' metadata stay static
(`k3jax.model_spec.ModelSpec`); `model_from` rebuilds the nnx model inside jit from the arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.model import create_model
from k3jax.model_spec import ModelSpec


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
