"""Optimizers and learning-rate schedules.

- AdamW (default): decoupled weight decay, global-norm clip.
- Muon for the hidden matrices (Newton-Schulz orthogonalised momentum; optax.contrib.muon)
  with AdamW for embeddings, lm_head, the router gate, norms, convs and 1-D parameters.
  Stacked (scanned) layers and experts are batch dimensions: each matrix is orthogonalised
  on its own. Updates use Moonlight's consistent RMS scaling (0.2 sqrt(max(m, n))).
- No weight decay on norms, biases, A_log, dt_bias, short convs or AttnRes vectors: decay
  applies to matrices only (embeddings and lm_head included).

Which parameter is which is read from its logical axis names (`axes` metadata), never from
a model name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import traversals

from k3jax.layers.common import EMBED, EXPERT


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


def muon_dimension_numbers(path, var):
    """MuonDimensionNumbers for a hidden matrix, None for AdamW-handled parameters.

    Batch axes: leading stacked dims and the expert axis. Kernels are [in, *out], except
    heads-merging output projections [H, E, d], whose output is the trailing embed axis.
    """
    keys = _path_keys(path)
    if not _is_matrix(path, var) or keys[0] in ("embed_tokens", "lm_head") or "gate" in keys:
        return None
    axes = tuple(var.get_metadata().get("axes", ()))
    ndim = len(var.get_value().shape)
    lead = ndim - len(axes)
    named = [lead + i for i, a in enumerate(axes) if a != EXPERT]
    if len(named) >= 3 and axes[-1] == EMBED:
        reduction, output = tuple(named[:-1]), (named[-1],)
    else:
        reduction, output = (named[0],), tuple(named[1:])
    return optax.contrib.MuonDimensionNumbers(reduction_axis=reduction, output_axis=output)


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
        # optax.contrib.muon's own AdamW branch takes one weight decay for all its leaves (no
        # mask) and muon's eps: it would decay norms, A_log, convs and AttnRes vectors. So the
        # matrices Muon handles and the rest are split here, each with the decay mask.
        dims = per_param(muon_dimension_numbers, params)
        labels = per_param(lambda p, v: "adam" if muon_dimension_numbers(p, v) is None else "muon", params)
        muon = optax.contrib.muon(
            schedule, ns_steps=opt_cfg.muon_ns_steps, beta=opt_cfg.muon_momentum, nesterov=True,
            weight_decay=opt_cfg.weight_decay, weight_decay_mask=decay_mask,
            muon_weight_dimension_numbers=dims, consistent_rms=0.2)
        # Nesterov AdamW, as optax.contrib.muon's AdamW branch
        adam = optax.adamw(schedule, b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                           weight_decay=opt_cfg.weight_decay, mask=decay_mask, nesterov=True)
        opt = optax.partition({"muon": muon, "adam": adam}, labels)
    if opt_cfg.grad_clip > 0:
        opt = optax.chain(optax.clip_by_global_norm(opt_cfg.grad_clip), opt)
    return opt, schedule


def global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))
