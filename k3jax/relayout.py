"""Convert between scanned (stacked) and per-layer parameter layouts.

Scanned stages store each unit-layer's parameters with a leading [repeat] axis; a model
built with scan_layers=False (or another unit length) stores them differently. Both are
the same network, and these functions move weights between them by absolute layer index,
so a checkpoint never depends on how the layers were grouped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def layer_states(model) -> list:
    """One nnx.State per absolute layer (DecoderLayer params and other variables)."""
    out = [None] * model.cfg.num_layers
    for stage, stacked in zip(model.plan, model.stages):
        state = nnx.state(stacked.units)
        for r in range(stage.repeat):
            for j in range(len(stage.unit)):
                out[stage.layer_index(r, j)] = jax.tree.map(lambda a: a[r], state["layers"][j])
    return out


def set_layer_states(model, states) -> None:
    """Write per-layer states (as from `layer_states`) into `model`'s stacked layout."""
    if len(states) != model.cfg.num_layers:
        raise ValueError(f"set_layer_states: {len(states)} layer states for a {model.cfg.num_layers}-layer model")
    for stage, stacked in zip(model.plan, model.stages):
        state = nnx.state(stacked.units)
        for j in range(len(stage.unit)):
            reps = [states[stage.layer_index(r, j)] for r in range(stage.repeat)]
            state["layers"][j] = jax.tree.map(lambda *a: jnp.stack(a), *reps)
        nnx.update(stacked.units, state)


def copy_weights(src, dst) -> None:
    """Copy every weight of `src` into `dst`, two models of the same network whose layers may
    be grouped differently (scanned vs unscanned)."""
    for name in ("embed_tokens", "norm", "lm_head", "output_attn_res", "router_bias"):
        if not hasattr(src, name):
            continue
        part = getattr(src, name)
        if isinstance(part, nnx.Variable):
            getattr(dst, name)[...] = part[...]
        else:
            nnx.update(getattr(dst, name), nnx.state(part))
    set_layer_states(dst, layer_states(src))
