"""Pytree key paths as the plain keys a state's dicts and lists are indexed by.

`jax.tree_util.tree_flatten_with_path` names a leaf by DictKey / SequenceKey / GetAttrKey
entries; flax's nnx flat states by plain keys already. The sharding rules, the planner, the
optimizer's parameter groups and train/relayout.py match leaves across trees by these tuples.
"""

from __future__ import annotations


def plain_path(path) -> tuple:
    """A key path -> its plain keys, e.g. ("params", "stages", 0, "units", "layers", 3, "mlp")."""
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
