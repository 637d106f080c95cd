"""A model's static spec: its structure (graphdef) and its parameters' metadata, without arrays.

The trainer keeps the arrays as plain nested dicts (what the optimizer and Orbax see,
train/state.py); `ModelSpec.model_from` rebuilds the nnx model inside jit from them. The
planner, the checkpoint interchange and the trainer build their abstract states from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from flax import nnx
from flax.nnx import traversals

from k3jax.model import K3Model


@dataclass(frozen=True)
class ModelSpec:
    """Static description of a model: graphdef plus abstract Param / other-variable states."""

    graphdef: nnx.GraphDef
    params: nnx.State   # abstract, with metadata (axes, init)
    rest: nnx.State

    def model_from(self, params: dict, rest: dict) -> K3Model:
        return nnx.merge(self.graphdef, state_from_pure(self.params, params), state_from_pure(self.rest, rest))

    def abstract_model(self) -> K3Model:
        """The model with abstract variables (what k3jax.model_sizes counts), from this spec:
        ~0.1 s for k3-small, where building it again (`model_sizes.abstract_model`) takes ~1 s."""
        return nnx.merge(self.graphdef, self.params, self.rest)


def state_from_pure(template: nnx.State, pure: dict) -> nnx.State:
    """An nnx.State with `template`'s variables and metadata and `pure`'s values."""
    values = traversals.flatten_mapping(pure)
    return nnx.from_flat_state([(p, v.replace(value=values[p])) for p, v in nnx.to_flat_state(template)])


def model_spec(model_cfg, seed: int = 0) -> ModelSpec:
    abstract = nnx.eval_shape(lambda: K3Model(model_cfg, rngs=nnx.Rngs(seed)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    return ModelSpec(graphdef, params, rest)
