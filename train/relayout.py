"""A train state moved from one layer layout to another: `model.scan_layers` changes on resume.

The decoder keeps its layers in stages (k3jax.layout.plan_stages): stage s holds `repeat`
copies of a unit of layers, each parameter stacked over the copies, at
.../stages/<s>/units/layers/<j>/... with shape [repeat, ...]. The scanned plan and the unrolled
one (`model.scan_layers=false`: one stage of every layer, repeat 1) compute the same function
with the same parameters at different places: k3-small's layer 9 is [stages/1/.../layers/1][1]
scanned (stage 1 = 3 x (kda, kda, kda, mla) from layer 4) and [stages/0/.../layers/9][0]
unrolled. The optimizer's moments mirror the parameters (the same key-path suffix), and the
QB router bias is one [moe layers, experts] array in layer order in both plans, so a whole train
state moves by the same rule: each layer's slice goes to the place its layer has in the other
plan. Everything outside the stages is the same leaf in both.

`relayout` does it for arrays (one jitted gather, into the target's shardings) and for
ShapeDtypeStructs (what `check_resumable` compares before anything is read). While it runs the
stage leaves exist twice (the checkpoint's and the new ones); the old ones are deleted when it
returns, before the first step allocates anything.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.layout import plan_stages
from k3jax.tree_paths import plain_path

Keys = tuple  # a key path as plain keys: ("params", "stages", 0, "units", "layers", 3, "mlp", "kernel")


class RelayoutError(ValueError):
    """The two states are not the same state in two layouts (another optimizer, another model)."""


def stage_layout(model_cfg) -> tuple[tuple[int, int, int], ...]:
    """(first layer, unit length, repeat) of each stage: two configs with equal layouts store
    every layer at the same place."""
    return tuple((st.start, len(st.unit), st.repeat) for st in plan_stages(model_cfg))


def layer_places(model_cfg) -> list[tuple[int, int, int]]:
    """(stage, slot in its unit, repeat) of each layer, in layer order."""
    places = {}
    for s, st in enumerate(plan_stages(model_cfg)):
        for r in range(st.repeat):
            for j in range(len(st.unit)):
                places[st.layer_index(r, j)] = (s, j, r)
    return [places[layer] for layer in range(len(places))]


def _split(path) -> tuple[Keys, int, int, Keys] | None:
    """A leaf's key path -> (prefix, stage, slot, suffix) when it lies in a stage, else None."""
    keys = plain_path(path)
    for i in range(len(keys) - 4):
        if keys[i] == "stages" and keys[i + 2] == "units" and keys[i + 3] == "layers":
            return keys[:i], int(keys[i + 1]), int(keys[i + 4]), keys[i + 5:]
    return None


def _first_layer(places, key) -> int:
    """The first layer stored in a stage leaf (prefix, stage, slot, suffix)."""
    return next(layer for layer, (s, j, _) in enumerate(places) if (s, j) == key[1:3])


def _name(prefix: Keys, suffix: Keys, layer: int) -> str:
    return "/".join(map(str, prefix)) + f"/<layer {layer}>/" + "/".join(map(str, suffix))


def relayout(state, saved_model, target, model, shardings=None):
    """`state`, laid out for `saved_model`'s stages, as a tree shaped like `target` (laid out
    for `model`'s): arrays in, arrays out (in `shardings`, a tree like `target`, when given;
    the state's leaves outside the stages are passed through as they are); ShapeDtypeStructs
    in, ShapeDtypeStructs out. The state's stage arrays are consumed (deleted once moved: the
    caller's checkpoint copy is not needed twice). Raises RelayoutError naming the first leaf
    `target` has and the state lacks (or the state has and `target` lacks), or whose shape or
    dtype differs."""
    saved_places = layer_places(saved_model)
    stages = plan_stages(model)
    plain, staged = {}, {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        sp = _split(path)
        if sp is None:
            plain[plain_path(path)] = x
        else:
            staged[sp] = x
    targets, treedef = jax.tree_util.tree_flatten_with_path(target)
    out_shardings = None if shardings is None else jax.tree.leaves(shardings)
    recipe = []  # per target leaf: a plain key, or [(staged key, repeat), ...] to stack
    for path, t in targets:
        sp = _split(path)
        if sp is None:
            key = plain_path(path)
            x = plain.get(key)
            if x is None or x.shape != t.shape or x.dtype != t.dtype:
                raise RelayoutError(_mismatch(jax.tree_util.keystr(path), x, t))
            recipe.append(key)
            continue
        prefix, s, j, suffix = sp
        pieces = []
        for r in range(stages[s].repeat):
            layer = stages[s].layer_index(r, j)
            s0, j0, r0 = saved_places[layer]
            x = staged.get((prefix, s0, j0, suffix))
            if x is None or x.shape[1:] != t.shape[1:] or x.dtype != t.dtype:
                raise RelayoutError(_mismatch(_name(prefix, suffix, layer), x, t, stacked=True))
            pieces.append(((prefix, s0, j0, suffix), r0))
        recipe.append(pieces)
    used = {r for r in recipe if not isinstance(r, list)}
    used_staged = {k for r in recipe if isinstance(r, list) for k, _ in r}
    left = ["/".join(map(str, k)) for k in set(plain) - used]
    left += [_name(k[0], k[3], _first_layer(saved_places, k)) for k in set(staged) - used_staged]
    if left:
        raise RelayoutError(f"{min(left)}: the checkpoint has it, the requested run does not")
    sources = sorted(staged, key=repr)  # the stage leaves, in a fixed order: the gather's arguments
    index = {k: i for i, k in enumerate(sources)}
    moved = [i for i, r in enumerate(recipe) if isinstance(r, list)]

    def gather(xs):
        return [jnp.stack([xs[index[k]][r] for k, r in recipe[i]]) for i in moved]

    args = [staged[k] for k in sources]
    if all(isinstance(x, jax.ShapeDtypeStruct) for x in args):
        new = jax.eval_shape(gather, args)
    else:
        out_sh = None if out_shardings is None else [out_shardings[i] for i in moved]
        new = jax.jit(gather, out_shardings=out_sh)(args)
        for x in args:
            x.delete()
    leaves = [plain[r] if not isinstance(r, list) else None for r in recipe]
    for i, x in zip(moved, new):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _mismatch(name: str, x, t, stacked: bool = False) -> str:
    want = f"{t.dtype}{list(t.shape[1:] if stacked else t.shape)}"
    if x is None:
        return f"{name}: the requested run has it ({want}), the checkpoint does not"
    have = f"{x.dtype}{list(x.shape[1:] if stacked else x.shape)}"
    return f"{name}: {have} in the checkpoint, {want} in the requested run"


__all__ = ["RelayoutError", "layer_places", "relayout", "stage_layout"]
