"""Quantile Balancing (Su; K3 report Eq. 14) and routing statistics. Pure JAX.

Per MoE layer and optimizer step: route a batch with bias b, collect statistics, then
    alpha_i = (k+1)-th largest of s_i + b          (per-token cutoff)
    m_ij    = s_ij - alpha_i                        (margins)
    q       = m*k // n                              (m valid tokens, n experts)
    b~_j    = -((q+1)-th largest of m_.j),   b' = b~ - mean(b~)
and use b' on the *next* batch only.

Two estimators of the per-expert quantile:
- "exact": keeps the scores [N,E] (and the token mask) and sorts the margins.
- "histogram": per-expert counts [E, bins] of the *biased* margins mu_ij = s_ij + b_j - alpha_i
  (so b~_j = b_j - (q+1)-th largest of mu_.j: the same rule, shifted by the bias each expert
  was routed with). mu_ij > 0 exactly when token i took expert j, so near balance every
  expert's quantile sits near 0 whatever its bias. The bins are equal in asinh(mu / LINEAR)
  over [-value_range, value_range]: ~2e-6 wide at 0 and a constant ~2 % of |mu| away from
  it (1024 bins, range 4), where equal bins were 8/1024 = 0.008 wide everywhere: coarser than
  the spread of a trained router's scores near its quantile, which the histogram then
  could not resolve (k3-small on an H200 stayed at max_violation 2-7; BENCHMARKS.md, issue 47).
  Counts add across micro-batches and data-parallel ranks (one all-reduce of E*bins
  numbers); the quantile is read from the cumulative counts and interpolated within its bin.

Stats dicts (`routing_stats`): always `load` [E] f32 (valid tokens given to each expert),
`tokens` f32 [] (valid tokens) and the router's health (`score_sum`, `score_sq` [E]: sums of the
valid tokens' scores and squares; `saturated` []: valid (token, expert) scores within 2^-12 of 0
or 1, where the sigmoid no longer separates tokens; `router_health` turns them into per-layer
figures); "exact" adds `scores` [N,E] f32 and `mask` [N] bool;
"histogram" adds `hist` [E, bins] f32; "load" (no balancing) adds nothing. Counts are f32 and exact up to 2^24 per entry.
Stacked stats (a leading layer axis on every leaf, bias [L,E]) go through
`quantile_balance_update_stacked`; `merge_stats` and `max_violation` take either form.
Everything is jit-able: static shapes, masks instead of boolean indexing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _cutoff(scores, bias, top_k: int):
    """alpha [N]: the (k+1)-th largest of scores + bias per token (needs k < E)."""
    vals, _ = jax.lax.top_k(scores.astype(jnp.float32) + bias.astype(jnp.float32), top_k + 1)
    return vals[..., top_k]


def _quota(tokens, top_k: int, num_experts: int):
    """q = m*k // n as int32, written to avoid overflowing m*k for large global batches."""
    m = jnp.round(tokens).astype(jnp.int32)
    return (m // num_experts) * top_k + ((m % num_experts) * top_k) // num_experts


LINEAR = 1e-4  # the histogram's bins are linear within ~LINEAR of 0, logarithmic beyond


def _to_unit(margins, value_range: float):
    """[-R, R] -> [-1, 1], equal steps in asinh(margin / LINEAR)."""
    return jnp.arcsinh(margins / LINEAR) / jnp.arcsinh(value_range / LINEAR)


def _from_unit(u, value_range: float):
    return LINEAR * jnp.sinh(u * jnp.arcsinh(value_range / LINEAR))


def _bin_index(margins, bins: int, value_range: float):
    """Bins equal in asinh(margin / LINEAR) over [-R, R]; margins outside are clamped into the
    end bins, so every token is still counted and the rank q stays right; only a quantile that
    itself lies outside the range is misread (read at the range's end: the bias then moves by
    at most R in one step)."""
    idx = jnp.floor((_to_unit(margins, value_range) + 1.0) * (0.5 * bins)).astype(jnp.int32)
    return jnp.clip(idx, 0, bins - 1)


def routing_stats(scores, topk_idx, bias, mask, *, top_k: int, estimator: str, bins: int,
                  value_range: float, cutoff=None) -> dict:
    """scores [N,E] (unbiased sigmoid), topk_idx [N,k], bias [E] (the one used to route),
    mask [N] bool (False = padding); cutoff [N]: the (k+1)-th largest of scores + bias when the
    router already has it (`Router(..., with_cutoff=True)`), else computed here. Returns the
    stats dict described in the module doc."""
    scores = jax.lax.stop_gradient(scores.astype(jnp.float32))
    bias = jax.lax.stop_gradient(bias.astype(jnp.float32))
    n_tok, n_exp = scores.shape
    valid = mask.astype(jnp.float32)
    per_pair = jnp.broadcast_to(valid[:, None], topk_idx.shape).reshape(-1)
    load = jnp.zeros((n_exp,), jnp.float32).at[topk_idx.reshape(-1)].add(per_pair)
    stats = {"load": load, "tokens": jnp.sum(valid), **_health_sums(scores, valid)}
    if estimator == "exact":
        stats["scores"] = scores
        stats["mask"] = mask.astype(bool)
    elif estimator == "load":  # nothing to balance (balance=none): only what the metrics read
        pass
    elif estimator == "histogram":
        alpha = _cutoff(scores, bias, top_k) if cutoff is None else jax.lax.stop_gradient(cutoff)
        margins = scores + bias[None, :] - alpha[:, None]  # biased: > 0 where the token took the expert
        flat = jnp.arange(n_exp, dtype=jnp.int32)[None, :] * bins + _bin_index(margins, bins, value_range)
        weights = jnp.broadcast_to(valid[:, None], (n_tok, n_exp))
        hist = jnp.zeros((n_exp * bins,), jnp.float32).at[flat.reshape(-1)].add(weights.reshape(-1))
        stats["hist"] = hist.reshape(n_exp, bins)
    else:
        raise ValueError(f"unknown QB estimator {estimator!r} (expected 'exact', 'histogram' or 'load')")
    return stats


SATURATED = 2.0 ** -12  # a score this close to 0 or 1 has |logit| > 8.3: ties across tokens


def _health_sums(scores, valid):
    """scores [N,E] f32, valid [N] f32 -> the sums `router_health` reads (they add across
    micro-batches and devices like the load)."""
    w = valid[:, None]
    sat = (jnp.minimum(scores, 1.0 - scores) < SATURATED).astype(jnp.float32)
    return {"score_sum": jnp.sum(scores * w, axis=0), "score_sq": jnp.sum(jnp.square(scores) * w, axis=0),
            "saturated": jnp.sum(sat * w)}


def router_health(stats: dict) -> dict:
    """Per-layer figures of merged stats (leaves [..., E] or [...]; a leading layer axis is kept):
    score_std: the across-token standard deviation of each expert's score, averaged over the
      experts (what a bias can split tokens by; 0 = every token scores the experts alike);
    saturated: the share of valid (token, expert) scores within 2^-12 of 0 or 1;
    hot_share: the busiest expert's share of the valid tokens (1 = it took every token);
    idle_experts: experts that received no token."""
    tokens = jnp.maximum(stats["tokens"], 1.0)[..., None]
    mean = stats["score_sum"] / tokens
    var = jnp.maximum(stats["score_sq"] / tokens - jnp.square(mean), 0.0)
    load = stats["load"]
    n_exp = load.shape[-1]
    return {"score_std": jnp.mean(jnp.sqrt(var), axis=-1),
            "saturated": stats["saturated"] / (tokens[..., 0] * n_exp),
            "hot_share": jnp.max(load, axis=-1) / tokens[..., 0],
            "idle_experts": jnp.sum((load == 0).astype(jnp.float32), axis=-1)}


def merge_stats(a: dict, b: dict) -> dict:
    """Combine two stats dicts of one estimator: counts add, exact scores/mask concatenate
    along the token axis (negative axes, so stacked [L, ...] stats merge too)."""
    if a.keys() != b.keys():
        raise ValueError(f"cannot merge stats with keys {sorted(a)} and {sorted(b)}")
    out = {}
    for key in a:
        if key == "scores":
            out[key] = jnp.concatenate([a[key], b[key]], axis=-2)
        elif key == "mask":
            out[key] = jnp.concatenate([a[key], b[key]], axis=-1)
        else:
            out[key] = a[key] + b[key]
    return out


def _exact_target(stats, bias, top_k: int):
    scores = stats["scores"].astype(jnp.float32)
    n_tok, n_exp = scores.shape
    margins = scores - _cutoff(scores, bias, top_k)[:, None]
    # padding sorts below every real margin; since q < m it is never the one picked
    margins = jnp.where(stats["mask"][:, None], margins, -jnp.inf)
    q = _quota(jnp.sum(stats["mask"].astype(jnp.int32)), top_k, n_exp)
    ascending = jnp.sort(margins, axis=0)
    return -jax.lax.dynamic_index_in_dim(ascending, n_tok - 1 - q, axis=0, keepdims=False)


def _histogram_quantile(hist, q, value_range: float):
    """hist [E, bins] of biased margins, q the quota -> the (q+1)-th largest margin of each
    expert [E], interpolated within its bin as if the bin's counts were spread evenly (in the
    bins' asinh scale)."""
    n_exp, bins = hist.shape
    # at_or_above[j, i] = margins of expert j in bins >= i (non-increasing in i); the
    # (q+1)-th largest lies in the highest bin where that count still reaches q+1
    at_or_above = jnp.cumsum(hist[:, ::-1], axis=1)[:, ::-1]
    rank = (q + 1).astype(hist.dtype)
    idx = jnp.clip(jnp.sum(at_or_above >= rank, axis=1) - 1, 0, bins - 1)
    count = jnp.take_along_axis(hist, idx[:, None], axis=1)[:, 0]
    above = jnp.take_along_axis(at_or_above, idx[:, None], axis=1)[:, 0] - count  # in higher bins
    # the rank-th largest is the (rank - above)-th from the bin's top of its `count` margins
    frac = jnp.clip((rank - above - 0.5) / jnp.maximum(count, 1.0), 0.0, 1.0)
    unit = (idx.astype(jnp.float32) + 1.0 - frac) * (2.0 / bins) - 1.0
    return _from_unit(unit, value_range)


def _histogram_target(stats, bias, top_k: int, value_range: float):
    q = _quota(stats["tokens"], top_k, stats["hist"].shape[0])
    return bias - _histogram_quantile(stats["hist"], q, value_range)


def quantile_balance_update(stats: dict, bias, *, top_k: int, estimator: str,
                            value_range: float = 4.0, rate: float = 1.0):
    """One QB step for one layer: stats from `routing_stats` (merged over the step's
    micro-batches), bias [E] the bias they were routed with -> new bias [E], mean zero.
    rate = 1 is Su's rule (the new bias balances the batch just seen); rate < 1 moves that share
    of the way, b + rate * (b~ - b) (a damping: the bias becomes an exponential average over the
    last ~1/rate batches' targets; both terms have mean zero, so the result does too).
    With no valid token the bias is returned unchanged (nothing to balance)."""
    bias = jax.lax.stop_gradient(bias.astype(jnp.float32))
    if estimator == "exact":
        target = _exact_target(stats, bias, top_k)
    elif estimator == "histogram":
        target = _histogram_target(stats, bias, top_k, value_range)
    else:
        raise ValueError(f"unknown QB estimator {estimator!r} (expected 'exact' or 'histogram')")
    new_bias = target - jnp.mean(target)
    if rate != 1.0:
        new_bias = bias + rate * (new_bias - bias)
    return jnp.where(stats["tokens"] > 0, new_bias, bias)


def quantile_balance_update_stacked(stats: dict, bias, *, top_k: int, estimator: str,
                                    value_range: float = 4.0, rate: float = 1.0):
    """`quantile_balance_update` over a leading layer axis: every stats leaf [L, ...],
    bias [L,E] -> [L,E]."""
    fn = functools.partial(quantile_balance_update, top_k=top_k, estimator=estimator,
                           value_range=value_range, rate=rate)
    return jax.vmap(fn)(stats, bias)


def max_violation(load):
    """max(load)/mean(load) - 1 over the expert (last) axis: 0 when perfectly balanced."""
    load = jnp.asarray(load, jnp.float32)
    return jnp.max(load, axis=-1) / jnp.mean(load, axis=-1) - 1.0
