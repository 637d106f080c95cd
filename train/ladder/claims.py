"""What the literature expects of each rung, checked against the measured rows.

Each claim is a predicate over `ladder.json`'s rows. It says "agrees" or "disagrees" with the
figures it compared, "inconclusive" when a precondition failed (a length-extrapolation claim
about a rung that never learned the task at its trained length), or "not measured" when the
run lacks the rows (e.g. a CPU run has no language-modelling rows). The thresholds are fixed
here and never tuned to a result; `likely_if_not` names what most often explains a
disagreement at small scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

SOLVED = 0.9  # "solves" a recall cell: Zoology's plots separate models at ~0.9 and above
LEARNED = 0.5  # below this at its trained length, a rung's behaviour beyond it says nothing


@dataclass(frozen=True)
class Claim:
    source: str
    text: str
    check: Callable  # Rows -> (True, False or None = inconclusive; evidence), or None: not measured
    likely_if_not: str


class Rows:
    """Lookups over ladder.json rows, plus the trained length of the recall tasks."""

    def __init__(self, rows: list[dict], train_length: int | None):
        self.rows, self.train_length = rows, train_length

    def recall(self, rung: str, task: str, *, length: str = "trained") -> float | None:
        """Mean accuracy over the cells of one length class: "trained" (= the training
        length), "longer" (the longest length measured beyond it), or "all"."""
        cells = [r for r in self.rows if r["rung"] == rung and r["task"] == task]
        if not cells:
            return None
        if length == "trained":
            cells = [r for r in cells if r["seq_len"] == self.train_length]
        elif length == "longer":  # the same numbers of pairs as at the trained length, further apart
            pairs = {r["pairs"] for r in cells if r["seq_len"] == self.train_length}
            longest = max(r["seq_len"] for r in cells)
            cells = [r for r in cells if r["seq_len"] == longest and longest > (self.train_length or 0)
                     and r["pairs"] in pairs]
        return float(np.mean([r["accuracy"] for r in cells])) if cells else None

    def by_pairs(self, rung: str, task: str) -> list[tuple[int, float]]:
        """(pairs, accuracy) at the trained length, by pairs."""
        return sorted((r["pairs"], r["accuracy"]) for r in self.rows if r["rung"] == rung and r["task"] == task
                      and r["seq_len"] == self.train_length)

    def lm_loss(self, rung: str) -> float | None:
        pts = [r for r in self.rows if r["rung"] == rung and r["task"] == "lm"]
        return max(pts, key=lambda r: r["tokens"])["eval_loss"] if pts else None

    def cost(self, rung: str) -> dict | None:
        return next((r for r in self.rows if r["rung"] == rung and r["task"] == "cost"), None)


def _f(x) -> str:
    return "—" if x is None else f"{x:.3f}"


def _attention_solves(rows: Rows):
    acc = rows.recall("softmax", "mqar")
    if acc is None:
        return None
    return acc >= SOLVED, f"softmax {_f(acc)} at the trained length (solved = {SOLVED})"


def _attention_beats_linear(rows: Rows):
    lin, soft = rows.recall("linear", "mqar"), rows.recall("softmax", "mqar")
    if lin is None or soft is None:
        return None
    return soft > lin, f"softmax {_f(soft)} vs linear {_f(lin)} at the trained length"


def _linear_falls(rows: Rows):
    curve = rows.by_pairs("linear", "mqar")
    if len(curve) < 2:
        return None
    return curve[-1][1] < curve[0][1], (f"linear from {_f(curve[0][1])} at {curve[0][0]} pairs to "
                                        f"{_f(curve[-1][1])} at {curve[-1][0]} (trained length)")


def _delta_beats_linear(rows: Rows):
    d, lin = rows.recall("deltanet", "mqar", length="all"), rows.recall("linear", "mqar", length="all")
    if d is None or lin is None:
        return None
    return d > lin, f"deltanet {_f(d)} vs linear {_f(lin)}, mean over every cell"


def _delta_overwrites(rows: Rows):
    d, lin = rows.recall("deltanet", "mqar_overwrite"), rows.recall("linear", "mqar_overwrite")
    if d is None or lin is None:
        return None
    return d > lin, f"deltanet {_f(d)} vs linear {_f(lin)} at the trained length"


def _overwrite_costs_additive_memory(rows: Rows):
    """recall minus overwrite accuracy at the trained length: what rewriting keys costs a rung."""
    acc = {(r, t): rows.recall(r, t) for r in ("linear", "deltanet") for t in ("mqar", "mqar_overwrite")}
    if any(v is None for v in acc.values()):
        return None
    drop = {r: acc[r, "mqar"] - acc[r, "mqar_overwrite"] for r in ("linear", "deltanet")}
    return drop["linear"] > drop["deltanet"], (
        f"recall minus overwrite accuracy: linear {_f(acc['linear', 'mqar'])} - {_f(acc['linear', 'mqar_overwrite'])}"
        f" = {drop['linear']:+.3f}, deltanet {_f(acc['deltanet', 'mqar'])} - "
        f"{_f(acc['deltanet', 'mqar_overwrite'])} = {drop['deltanet']:+.3f}")


def _better_loss(a: str, b: str):
    def check(rows: Rows):
        la, lb = rows.lm_loss(a), rows.lm_loss(b)
        if la is None or lb is None:
            return None
        return la < lb, f"held-out loss {a} {_f(la)} vs {b} {_f(lb)}"
    return check


def _better_recall(a: str, b: str):
    def check(rows: Rows):
        ra, rb = rows.recall(a, "mqar", length="all"), rows.recall(b, "mqar", length="all")
        if ra is None or rb is None:
            return None
        return ra > rb, f"{a} {_f(ra)} vs {b} {_f(rb)}, MQAR mean over every cell"
    return check


def _rope_extrapolation(rows: Rows):
    inside, beyond = rows.recall("softmax", "mqar"), rows.recall("softmax", "mqar", length="longer")
    if inside is None or beyond is None:
        return None
    evidence = f"softmax {_f(inside)} at the trained length, {_f(beyond)} at the longest (same pairs)"
    if inside < LEARNED:
        return None, evidence + f"; it never learned recall at its trained length (< {LEARNED})"
    return beyond < inside - 0.05, evidence


def _state_sizes(rows: Rows):
    costs = {r: rows.cost(r) for r in ("softmax", "linear", "deltanet", "gated_deltanet", "kda", "hybrid")}
    if any(c is None for c in costs.values()):
        return None
    growth = {r: c["state_bytes_128k"] / c["state_bytes_4k"] for r, c in costs.items()}
    recurrent = all(growth[r] < 1.01 for r in ("linear", "deltanet", "gated_deltanet", "kda"))
    hybrid = costs["hybrid"]["state_bytes_128k"] < costs["softmax"]["state_bytes_128k"]
    return recurrent and growth["softmax"] > 31 and hybrid, (
        "128k/4k: " + ", ".join(f"{r} {g:.1f}x" for r, g in growth.items()))


_SLOW_ATTENTION = ("too few steps for attention: it must learn to carry each key onto the value after it "
                   "(an induction circuit); the other rungs' short convolution hands them that, so they learn "
                   "first (Zoology's MQAR models put one in front of attention too)")
_FEW_TOKENS = ("too few tokens for a small difference to show: gating and the finer gate pay off over long "
               "training; one seed")
_HYBRID = "our full-attention rung is RoPE softmax (Kimi's baseline is MLA); too few tokens; one seed"
_LATE = ("too few steps, one seed: MQAR training sits on a loss plateau and each rung leaves it at its own "
         "step (training-loss curves); a rung that left it later is still improving at the end")

CLAIMS = (
    Claim("Zoology (Arora et al. 2023)", "attention solves MQAR at the lengths it was trained on",
          _attention_solves, _SLOW_ATTENTION),
    Claim("Zoology (Arora et al. 2023)", "attention recalls better than linear attention", _attention_beats_linear,
          _SLOW_ATTENTION),
    Claim("Based (Arora et al. 2024)", "linear attention's fixed-size state recalls less as the pairs grow",
          _linear_falls, "the state is large for so few pairs"),
    Claim("DeltaNet (Yang et al. 2024)", "the delta rule recalls better than linear attention",
          _delta_beats_linear, _LATE),
    Claim("DeltaNet (Yang et al. 2024)",
          "the delta rule edits memories: on overwrite it beats additive memory, which holds both values",
          _delta_overwrites, "too few steps; or linear attention separates the two writes by position (short conv)"),
    Claim("DeltaNet (Yang et al. 2024)", "rewriting keys costs additive memory accuracy, the delta rule less",
          _overwrite_costs_additive_memory, _LATE),
    Claim("Gated DeltaNet (Yang et al. 2025)", "a forget gate on top of the delta rule lowers the LM loss",
          _better_loss("gated_deltanet", "deltanet"), _FEW_TOKENS),
    Claim("Gated DeltaNet (Yang et al. 2025)", "a forget gate on top of the delta rule recalls better",
          _better_recall("gated_deltanet", "deltanet"), _LATE),
    Claim("Kimi Linear (Moonshot AI 2025)", "KDA's per-channel gate lowers the LM loss below gated DeltaNet's",
          _better_loss("kda", "gated_deltanet"), _FEW_TOKENS),
    Claim("Kimi Linear (Moonshot AI 2025)", "KDA's per-channel gate recalls better than gated DeltaNet's per-head gate",
          _better_recall("kda", "gated_deltanet"), _LATE),
    Claim("Kimi Linear (Moonshot AI 2025)", "KDA mixed 3:1 with MLA beats full attention at equal training (LM loss)",
          _better_loss("hybrid", "softmax"), _HYBRID),
    Claim("Kimi Linear (Moonshot AI 2025)", "KDA mixed 3:1 with MLA beats full attention at equal training (recall)",
          _better_recall("hybrid", "softmax"), _HYBRID),
    Claim("RoPE extrapolation (Press et al. 2022, ALiBi)",
          "softmax attention with RoPE degrades on sequences longer than it was trained on",
          _rope_extrapolation, "the longer examples only add filler tokens, which the model learned to ignore"),
    Claim("by construction", "recurrent rungs keep a constant state; the KV cache grows with context; the hybrid's "
          "cache grows in its MLA layers only, compressed", _state_sizes, "a bug in k3jax.info's decode-state sizes"),
)


def check_claims(rows: list[dict], train_length: int | None) -> list[dict]:
    """[{source, claim, verdict, evidence, likely_if_not}] in CLAIMS order."""
    view = Rows(rows, train_length)
    out = []
    for c in CLAIMS:
        res = c.check(view)
        if res is None:
            verdict, evidence = "not measured", ""
        else:
            verdict = {True: "agrees", False: "disagrees", None: "inconclusive"}[res[0]]
            evidence = res[1]
        out.append({"source": c.source, "claim": c.text, "verdict": verdict, "evidence": evidence,
                    "likely_if_not": c.likely_if_not if verdict == "disagrees" else ""})
    return out
