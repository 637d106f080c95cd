"""One optimizer step: micro-batch gradient accumulation, z-loss, Quantile Balancing.

The loss is the token-mean cross-entropy over the whole step batch (all micro-batches):
per-micro-batch *sums* are accumulated and divided once, so accumulation gives the same
gradient as one big batch. Routing statistics of all micro-batches are merged and update
each MoE layer's router bias once per step; the new bias is used from the next step.
With `optimizer.qk_clip_tau > 0`, each MLA head's max logit over all micro-batches drives
QK-Clip on the updated weights (train/qk_clip.py); the optimizer state is left as it is.

`make_train_step` returns a pure function (state, batch) -> (state, metrics); `compile_step`
jits it with explicit shardings so a mesh can be plugged in without touching it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from k3jax.layers import qb
from k3jax.ops.chunked_loss import chunked_token_losses
from k3jax.segments import not_padding
from train.optimizer import global_norm
from train.qk_clip import qk_clip

BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


def model_losses(model, batch: dict, cfg, z_loss: float, *, max_logits: bool = False):
    """The model on a batch, then its loss sums (ce, z-loss, correct, tokens) and aux; the LM
    head runs inside the sequence-chunked loss (`train.loss_chunk`)."""
    h, _, aux = model.forward(batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"],
                              token_mask=not_padding(batch["segment_ids"]), mla_max_logits=max_logits,
                              head=False)
    ce, zl, correct, n = chunked_token_losses(h, model.lm_head.kernel[...], batch["targets"], batch["loss_mask"],
                                              z_loss, chunk=cfg.train.loss_chunk, compute_dtype=model.compute)
    return ce, zl, correct, n, aux


def split_micro_batches(batch: dict, micro: int) -> dict:
    """[B, ...] -> [micro, B/micro, ...], micro-batch i = rows i, i+micro, i+2 micro, ...

    Strided, not contiguous: the batch's rows are sharded in contiguous blocks over the data
    devices, and each block holds the same number of rows of every micro-batch this way, so
    the split moves no data (contiguous micro-batches would each live on a subset of the
    devices, and XLA re-shards them with an all-gather and a collective-permute)."""
    return jax.tree.map(lambda x: jnp.moveaxis(x.reshape(x.shape[0] // micro, micro, *x.shape[1:]), 1, 0), batch)


def make_train_step(cfg, spec, tx, schedule):
    """Plain SPMD: the batch and the routing statistics are global arrays, so the statistics
    already cover every device's tokens."""
    model_cfg, moe = cfg.model, cfg.model.moe
    micro = cfg.train.micro_batches
    z_loss = cfg.train.z_loss
    has_moe = any(model_cfg.ffn_kind(i) == "moe" for i in range(model_cfg.num_layers))
    tau = cfg.optimizer.qk_clip_tau
    clip = tau > 0 and "mla" in model_cfg.mixers  # static: the model computes no max logits otherwise

    def loss_fn(params, rest, mb):
        model = spec.model_from(params, rest)
        ce, zl, correct, n, aux = model_losses(model, mb, cfg, z_loss, max_logits=clip)
        return ce + zl, (ce, zl, correct, n, (aux["router_stats"], aux["mla_max_logits"]))

    grad_fn = jax.grad(loss_fn, has_aux=True)

    def step(state, batch):
        params, rest = state["params"], state["rest"]
        mbs = split_micro_batches({k: batch[k] for k in BATCH_KEYS}, micro)

        def accumulate(acc, mb):
            g, (ce, zl, correct, n, stats) = grad_fn(params, rest, mb)
            acc = jax.tree.map(jnp.add, acc, (g, ce, zl, correct, n))
            return acc, stats

        zeros = (jax.tree.map(jnp.zeros_like, params), 0.0, 0.0, 0.0, 0.0)
        (g, ce, zl, correct, n), (stats, max_logits) = jax.lax.scan(accumulate, zeros, mbs)
        n_safe = jnp.maximum(n, 1.0)
        grads = jax.tree.map(lambda x: x / n_safe, g)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)

        metrics = {"loss": ce / n_safe, "z_loss": zl / n_safe, "accuracy": correct / n_safe, "tokens": n,
                   "grad_norm": global_norm(grads), "lr": schedule(state["step"])}
        if clip:
            max_logits = jnp.max(max_logits, axis=0)  # [M, L_mla, H] -> the step's [L_mla, H]
            new_params, clipped = qk_clip(new_params, max_logits, model_cfg, tau)
            metrics["mla_max_logit"] = jnp.max(max_logits, axis=-1)  # [L_mla], before the clip
            metrics["qk_clipped_heads"] = clipped  # [L_mla]
        new_rest = rest
        if has_moe:
            # stacked over micro-batches [M, L, ...] -> the step's [L, ...], micro-batches in order
            stats = functools.reduce(qb.merge_stats, [jax.tree.map(lambda x: x[i], stats) for i in range(micro)])
            bias = rest["router_bias"]
            if moe.balance == "quantile":
                bias = qb.quantile_balance_update_stacked(stats, bias, top_k=moe.top_k, estimator=moe.qb_estimator,
                                                          value_range=moe.qb_range, rate=moe.qb_update_rate)
            new_rest = {**rest, "router_bias": bias}
            metrics["max_violation"] = qb.max_violation(stats["load"])  # [L_moe], of this step's routing
            # dropped pairs count padding tokens' pairs too (the exchange does not know about
            # padding): divide by all routed pairs, not by the valid tokens' load
            metrics["expert_drop_rate"] = stats["dropped"] / jnp.maximum(stats["pairs"], 1.0)
            metrics["bias_spread"] = jnp.max(bias, -1) - jnp.min(bias, -1)
            health = qb.router_health(stats)  # [L_moe] each: what the router gives QB to work with
            metrics.update({"router_score_std": health["score_std"], "router_saturated": health["saturated"],
                            "hot_share": health["hot_share"], "idle_experts": health["idle_experts"],
                            # averaged over a logging window: the share of its steps in which one
                            # expert took more than half of the layer's tokens (train/balance_watch.py)
                            "collapsed": (health["hot_share"] > 0.5).astype(jnp.float32)})
        metrics["finite"] = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        new_state = {**state, "params": new_params, "rest": new_rest, "opt_state": opt_state,
                     "step": state["step"] + 1}
        return new_state, metrics

    return step


def make_eval_step(cfg, spec):
    """(state, batch) -> sums {loss, correct, tokens} over the batch's valid targets.

    The batch runs in the training step's micro-batches (`train.micro_batches`), summed: the
    same shapes as training's forward (so its memory, and the same tuned GPU kernels)."""
    def step(state, batch):
        model = spec.model_from(state["params"], state["rest"])
        mbs = split_micro_batches({k: batch[k] for k in BATCH_KEYS}, cfg.train.micro_batches)

        def accumulate(acc, mb):
            ce, _, correct, n, _ = model_losses(model, mb, cfg, 0.0)
            return jax.tree.map(jnp.add, acc, (ce, correct, n)), None

        (ce, correct, n), _ = jax.lax.scan(accumulate, (0.0, 0.0, 0.0), mbs)
        return {"loss_sum": ce, "correct": correct, "tokens": n}
    return step


def compile_step(fn, state_shardings=None, batch_sharding=None, *, donate: bool = True):
    """jit with explicit shardings (None = let JAX place: one device)."""
    kwargs = {}
    if state_shardings is not None:
        kwargs = {"in_shardings": (state_shardings, batch_sharding), "out_shardings": (state_shardings, None)}
    return jax.jit(fn, donate_argnums=(0,) if donate else (), **kwargs)
