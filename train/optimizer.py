"""Optimizers and learning-rate schedules.

- AdamW (default): decoupled weight decay, global-norm clip.
- Muon for the hidden matrices (Newton-Schulz orthogonalised momentum; optax.contrib.muon's
  update with its Newton-Schulz batched over all matrices of one shape and run in bf16 by
  default: train/muon.py) with AdamW for embeddings, lm_head, the router gate, norms, convs
  and 1-D parameters. Stacked (scanned) layers and experts are batch dimensions: each matrix
  is orthogonalised on its own. Updates use Moonlight's consistent RMS scaling (0.2 sqrt(max(m, n))).
- Per-Head Muon (optimizer.muon_per_head): the attention projections (kernels with `heads`
  metadata: MLA q_b/kv_b/g/o, KDA q/k/v/g/o, softmax q/k/v/o) are orthogonalised head by
  head, each head's slice its own matrix ([in, K] on the output side, [K, out] for o_proj)
  scaled by its own 0.2 sqrt(max(m, n)). Flat [.., H*K] kernels (KDA) are viewed as
  [.., H, K] inside the optimizer only: stored shapes, checkpoints and the optimizer state's
  layout are the same either way.
- No weight decay on norms, biases, A_log, dt_bias, short convs or AttnRes vectors: decay
  applies to matrices only (embeddings and lm_head included).

Which parameter is which is read from its logical axis names (`axes` metadata), never from
a model name.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import traversals

from jax.sharding import PartitionSpec as P

from k3jax.layers.common import EMBED, EXPERT, HEAD_DIM, HEADS
from k3jax.sharding.rules import logical_to_spec
from k3jax.tree_paths import plain_path
from train.muon import muon as batched_muon


def schedule_steps(cfg) -> int:
    """The LR schedule's length: optimizer.decay_steps, or train.steps when it is 0 (a run
    resolves 0 at its first launch and keeps that length on resume: train.checkpoint)."""
    return cfg.optimizer.decay_steps or cfg.train.steps


def lr_schedule(opt_cfg, total_steps: int):
    """Linear warmup to lr over warmup_steps (lr * (t+1) / warmup), then over the remaining
    steps: cosine down to lr * min_lr_ratio, WSD (constant, then a linear decay over the last
    decay_fraction), or constant."""
    peak = opt_cfg.lr
    floor = peak * opt_cfg.min_lr_ratio
    warm = max(min(opt_cfg.warmup_steps, total_steps - 1), 0)
    rest = max(total_steps - warm, 1)
    decay = max(int(round(rest * opt_cfg.decay_fraction)), 1)
    kind = opt_cfg.schedule

    def schedule(step):
        t = jnp.asarray(step, jnp.float32)
        s = t - warm
        if kind == "cosine":
            main = floor + (peak - floor) * 0.5 * (1 + jnp.cos(jnp.pi * jnp.clip(s / rest, 0.0, 1.0)))
        elif kind == "wsd":
            main = peak + (floor - peak) * jnp.clip((s - (rest - decay)) / decay, 0.0, 1.0)
        else:
            main = jnp.full_like(t, peak)
        return jnp.where(t < warm, peak * (t + 1) / max(warm, 1), main)

    return schedule


def _path_keys(path) -> list[str]:
    return [str(k) for k in path]


def _is_matrix(path, var) -> bool:
    """A weight matrix (or a stack of them): at least two named non-expert axes, and not
    a depthwise conv, an AttnRes pseudo-query or a norm."""
    keys = _path_keys(path)
    if any(k.endswith("_res") or k.endswith("conv1d") or "norm" in k for k in keys):
        return False
    axes = var.get_metadata().get("axes", ())
    return len([a for a in axes if a != EXPERT]) >= 2


def _heads(var) -> int:
    """How many attention heads the parameter's HEADS axis holds (0: not a per-head projection)."""
    return int(var.get_metadata().get("heads", 0) or 0)


def muon_view(var, per_head: bool) -> tuple[tuple[int, ...], tuple]:
    """(shape, logical axes) Muon sees a parameter in: as stored, except that with `per_head`
    a flat HEADS axis of a per-head projection ([.., H*K]) is split into [.., H, K]."""
    shape, axes = tuple(var.get_value().shape), tuple(var.get_metadata().get("axes", ()))
    H = _heads(var)
    if not (per_head and H and HEADS in axes):
        return shape, axes
    i = axes.index(HEADS)
    j = len(shape) - len(axes) + i
    if shape[j] == H:  # already [.., H, K]
        return shape, axes
    return shape[:j] + (H, shape[j] // H) + shape[j + 1:], axes[:i] + (HEADS, HEAD_DIM) + axes[i + 1:]


def muon_partition_spec(var, per_head: bool):
    """The logical PartitionSpec (k3jax.sharding.rules' names, not yet fitted to a mesh) of a
    parameter in the shape Muon sees it (`muon_view`); replicated without axis metadata."""
    if "axes" not in var.get_metadata():
        return P()
    shape, axes = muon_view(var, per_head)
    return logical_to_spec(axes, len(shape))


def muon_dimension_numbers(path, var, per_head: bool = False):
    """MuonDimensionNumbers for a hidden matrix (on its `muon_view`), None for AdamW-handled
    parameters.

    Batch axes: leading stacked dims and the expert axis. Kernels are [in, *out], except
    heads-merging output projections [H, E, d], whose output is the trailing embed axis.
    Per head (`per_head` and `heads` metadata) the head axis is a batch axis too: each head's
    [in, K] (head axis on the output side) or [K, out] (o_proj: head axis first) is one matrix.
    """
    keys = _path_keys(path)
    if not _is_matrix(path, var) or keys[0] in ("embed_tokens", "lm_head") or "gate" in keys:
        return None
    shape, axes = muon_view(var, per_head)
    lead = len(shape) - len(axes)
    named = [lead + i for i, a in enumerate(axes) if a != EXPERT]
    if per_head and _heads(var):
        head = lead + axes.index(HEADS)
        rest = [i for i in named if i != head]
        if head == named[0]:
            reduction, output = tuple(rest[:-1]), (rest[-1],)
        else:
            reduction, output = (rest[0],), tuple(rest[1:])
    elif len(named) >= 3 and axes[-1] == EMBED:
        reduction, output = tuple(named[:-1]), (named[-1],)
    else:
        reduction, output = (named[0],), tuple(named[1:])
    return optax.contrib.MuonDimensionNumbers(reduction_axis=reduction, output_axis=output)


def optimizer_label(opt_cfg, path, var) -> str:
    """Which update a parameter gets: "muon" (whole matrix), "muon per-head (H)" or "adamw"."""
    if opt_cfg.name != "muon" or muon_dimension_numbers(path, var) is None:
        return "adamw"
    if opt_cfg.muon_per_head and _heads(var):
        return f"muon per-head ({_heads(var)})"
    return "muon"


def partition_summary(opt_cfg, params) -> str:
    """One line: how many parameter tensors (and parameters) each update takes."""
    groups: dict[str, list[int]] = {}
    for path, var in nnx.to_flat_state(params):
        label = optimizer_label(opt_cfg, path, var)
        label = "muon per-head" if label.startswith("muon per-head") else label
        n = groups.setdefault(label, [0, 0])
        n[0] += 1
        n[1] += math.prod(var.get_value().shape)
    names = {"muon": "whole-matrix Muon", "muon per-head": "per-head Muon", "adamw": "AdamW"}
    parts = [f"{groups[k][0]} tensors ({_count(groups[k][1])} parameters) {names[k]}" for k in names if k in groups]
    return f"optimizer {opt_cfg.name}: " + ", ".join(parts)


def _count(n: int) -> str:
    for div, suffix in ((1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return str(n)


def _reshape_matching(tree, shapes: dict):
    """Reshape every leaf whose key path ends with a path of `shapes` and whose shape is that
    entry's first shape to its second; other leaves pass through."""
    def fn(path, x):
        keys = plain_path(path)
        for i in range(len(keys)):
            pair = shapes.get(keys[i:])
            if pair is not None and tuple(getattr(x, "shape", ())) == pair[0]:
                return x.reshape(pair[1])
        return x
    return jax.tree_util.tree_map_with_path(fn, tree)


def viewed(inner, views: dict) -> optax.GradientTransformationExtraArgs:
    """`inner` run on some parameters seen in another shape: views = {parameter path: (stored
    shape, viewed shape)}. Updates and params are reshaped on the way in and back on the way
    out, and so is every leaf of inner's state stored like one of those parameters (same
    key-path suffix, viewed shape): the state keeps the stored shapes, so checkpoints and the
    state's sharding (k3jax.sharding.rules.state_shardings) do not depend on the view.
    Reshapes of a contiguous axis move no data."""
    inner = optax.with_extra_args_support(inner)
    fwd = {p: (a, b) for p, (a, b) in views.items()}
    back = {p: (b, a) for p, (a, b) in views.items()}

    def init(params):
        return _reshape_matching(inner.init(_reshape_matching(params, fwd)), back)

    def update(updates, state, params=None, **extra):
        params = None if params is None else _reshape_matching(params, fwd)
        updates, state = inner.update(_reshape_matching(updates, fwd), _reshape_matching(state, fwd), params, **extra)
        return _reshape_matching(updates, back), _reshape_matching(state, back)

    return optax.GradientTransformationExtraArgs(init, update)


def per_param(fn, params) -> dict:
    """fn(path, Variable) for every entry of an nnx.State -> a nested dict shaped like
    `nnx.to_pure_dict(params)` (the tree the optimizer works on)."""
    return traversals.unflatten_mapping({p: fn(p, v) for p, v in nnx.to_flat_state(params)})


def build_optimizer(opt_cfg, total_steps: int, params) -> tuple[optax.GradientTransformation, callable]:
    """Returns (optax transformation over the params' *values*, schedule).

    `params` is an nnx.State of Params (with metadata); the transformation is applied to
    the pure value tree `nnx.to_pure_dict(params)`.
    """
    schedule = lr_schedule(opt_cfg, total_steps)
    decay_mask = per_param(_is_matrix, params)
    if opt_cfg.name == "adamw":
        opt = optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                          weight_decay=opt_cfg.weight_decay, mask=decay_mask)
    else:
        # optax.contrib.muon's (and batched_muon's) own AdamW branch takes one weight decay for
        # all its leaves (no mask) and muon's eps: it would decay norms, A_log, convs and AttnRes vectors. So the
        # matrices Muon handles and the rest are split here, each with the decay mask.
        per_head = opt_cfg.muon_per_head
        dims = per_param(lambda p, v: muon_dimension_numbers(p, v, per_head), params)
        labels = per_param(lambda p, v: "adam" if muon_dimension_numbers(p, v) is None else "muon", params)
        muon = batched_muon(
            schedule, ns_steps=opt_cfg.muon_ns_steps, beta=opt_cfg.muon_momentum,
            weight_decay=opt_cfg.weight_decay, weight_decay_mask=decay_mask,
            dimension_numbers=dims, consistent_rms=0.2, dtype=jnp.dtype(opt_cfg.muon_dtype),
            partition_specs=per_param(lambda p, v: muon_partition_spec(v, per_head), params))
        views = {p: (tuple(v.get_value().shape), muon_view(v, per_head)[0]) for p, v in nnx.to_flat_state(params)
                 if muon_dimension_numbers(p, v) is not None and muon_view(v, per_head)[0] != v.get_value().shape}
        if views:  # per head: flat [.., H*K] kernels seen as [.., H, K]
            muon = viewed(muon, views)
        # Nesterov AdamW, as optax.contrib.muon's AdamW branch
        adam = optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                           weight_decay=opt_cfg.weight_decay, mask=decay_mask, nesterov=True)
        opt = optax.partition({"muon": muon, "adam": adam}, labels)
    if opt_cfg.grad_clip > 0:
        opt = optax.chain(optax.clip_by_global_norm(opt_cfg.grad_clip), opt)
    return opt, schedule


def global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))
