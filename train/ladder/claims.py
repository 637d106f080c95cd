"""What the literature expects of each rung, checked against the measured rows, seed by seed.

Each claim compares two quantities per seed (a rung's recall against another's, a loss against
a loss, an accuracy against a fixed threshold) and is judged by one rule (`judge`):

* "agrees": the claim holds in every seed, and the mean difference exceeds the seed spread
  (the larger of the two sides' max - min over seeds) and RESOLUTION, the tables' last digit;
* "disagrees": the same in the other direction;
* "not settled at this budget": anything else, one seed included (fewer than MIN_SEEDS);
* "inconclusive": a precondition failed (a length-extrapolation claim about a rung that never
  learned the task at its trained length, in some seed);
* "not measured": the run lacks the rows (a CPU run has no language-modelling rows).

The thresholds are fixed here and never tuned to a result; `likely_if_not` names what most often
explains a disagreement at small scale. Where a size sweeps the learning rate, each rung's recall
rows are those of its best rate (runs.selected); where it trains several widths, the recall
claims are judged at each width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from train.ladder.runs import MIN_SEEDS, RECALL_TASKS, by_seed, mean, selected, spread

SOLVED = 0.9  # "solves" a recall cell: Zoology's plots separate models at ~0.9 and above
LEARNED = 0.5  # below this at its trained length, a rung's behaviour beyond it says nothing
EXTRAPOLATION_DROP = 0.05  # "degrades beyond the trained length": loses more accuracy than this
# A mean difference below the tables' last printed digit orders nothing. Added 2026-12-06, after
# the zoology table: two rungs both at chance (0.000 with no seed spread) differed by 1e-4 and
# read "disagrees", since any difference exceeds a zero spread. No earlier verdict changes.
RESOLUTION = 1e-3


@dataclass(frozen=True)
class Paired:
    """Per seed, the two sides of a claim; it holds in a seed when `left` `holds_if` `right`."""

    left: dict[int, float]
    right: dict[int, float]
    left_name: str
    right_name: str
    holds_if: str = ">"  # or "<"
    where: str = ""  # what the numbers are, e.g. "at the trained length"


@dataclass(frozen=True)
class Exact:
    """A claim with no seed to it (state sizes by construction)."""

    holds: bool
    evidence: str


@dataclass(frozen=True)
class Inconclusive:
    evidence: str


@dataclass(frozen=True)
class Claim:
    source: str
    text: str
    check: Callable  # Rows -> Paired | Exact | Inconclusive, or None: not measured
    likely_if_not: str
    uses: str = "recall"  # "recall" (judged per width), "lm" or "cost"


def judge(p: Paired) -> tuple[str | None, str]:
    """(verdict, evidence) by the rule in the module docstring; (None, "") with no seed on both sides."""
    seeds = sorted(set(p.left) & set(p.right))
    if not seeds:
        return None, ""
    left, right = [p.left[s] for s in seeds], [p.right[s] for s in seeds]
    sign = 1.0 if p.holds_if == ">" else -1.0
    diffs = [sign * (a - b) for a, b in zip(left, right)]
    d, sp = mean(diffs), max(spread(left), spread(right))
    n, held = len(seeds), sum(x > 0 for x in diffs)
    side = lambda name, v: f"{name} {mean(v):.3f}" + (f" (spread {spread(v):.3f})" if n > 1 and spread(v) else "")  # noqa: E731
    evidence = (f"{side(p.left_name, left)} vs {side(p.right_name, right)}{' ' + p.where if p.where else ''}; "
                f"{n} seed{'s' if n > 1 else ''}, holds in {held}")
    if n < MIN_SEEDS:
        return "not settled at this budget", evidence + " (one seed: no spread to judge against)"
    evidence += f"; mean difference {d:+.3f} against a spread of {sp:.3f}"
    if held == n and d > max(sp, RESOLUTION):
        return "agrees", evidence
    if held == 0 and -d > max(sp, RESOLUTION):
        return "disagrees", evidence
    return "not settled at this budget", evidence


class Rows:
    """Lookups over ladder.json rows (best learning rate already chosen), per seed; recall rows
    of one width (`d_model`) where the size trains several."""

    def __init__(self, rows: list[dict], train_length: int | None, d_model: int | None = None):
        self.rows = [r for r in rows if d_model is None or r["task"] not in RECALL_TASKS or r.get("d_model") == d_model]
        self.train_length = train_length

    def _cells(self, rung: str, task: str) -> list[dict]:
        return [r for r in self.rows if r["rung"] == rung and r["task"] == task]

    def recall(self, rung: str, task: str, *, length: str = "trained") -> dict[int, float]:
        """{seed: mean accuracy over the cells of one length class}: "trained" (= the training
        length), "longer" (the longest length measured beyond it, the pairs of the trained
        length), or "all"."""
        cells = self._cells(rung, task)
        if not cells:
            return {}
        if length == "trained":
            cells = [r for r in cells if r["seq_len"] == self.train_length]
        elif length == "longer":
            pairs = {r["pairs"] for r in cells if r["seq_len"] == self.train_length}
            longest = max(r["seq_len"] for r in cells)
            cells = [r for r in cells if r["seq_len"] == longest and longest > (self.train_length or 0)
                     and r["pairs"] in pairs]
        return by_seed(cells, "accuracy")

    def at_pairs(self, rung: str, task: str, which: str) -> tuple[int | None, dict[int, float]]:
        """The fewest ("min") or most ("max") pairs at the trained length, and {seed: accuracy} there."""
        cells = [r for r in self._cells(rung, task) if r["seq_len"] == self.train_length]
        if not cells:
            return None, {}
        p = (min if which == "min" else max)(r["pairs"] for r in cells)
        return p, by_seed([r for r in cells if r["pairs"] == p], "accuracy")

    def lm_loss(self, rung: str) -> dict[int, float]:
        """{seed: held-out loss at the run's last eval}."""
        last: dict[int, dict] = {}
        for r in self._cells(rung, "lm"):
            s = r.get("seed", 0)
            if s not in last or r["step"] > last[s]["step"]:
                last[s] = r
        return {s: r["eval_loss"] for s, r in sorted(last.items())}

    def cost(self, rung: str) -> dict | None:
        return next(iter(self._cells(rung, "cost")), None)


def _threshold(values: dict[int, float], level: float) -> dict[int, float]:
    """A fixed level, as one side of a Paired: no spread."""
    return {s: level for s in values}


def _attention_solves(rows: Rows):
    acc = rows.recall("softmax_conv", "mqar")
    if not acc:
        return None
    return Paired(acc, _threshold(acc, SOLVED), "softmax_conv", f"solved ({SOLVED})",
                  where="at the trained length")


def _better_recall(a: str, b: str, length: str = "trained", task: str = "mqar"):
    def check(rows: Rows):
        ra, rb = rows.recall(a, task, length=length), rows.recall(b, task, length=length)
        if not ra or not rb:
            return None
        return Paired(ra, rb, a, b, where="at the trained length" if length == "trained" else "over every cell")
    return check


def _linear_falls(rows: Rows):
    few, acc_few = rows.at_pairs("linear", "mqar", "min")
    most, acc_most = rows.at_pairs("linear", "mqar", "max")
    if not acc_few or few == most:
        return None
    return Paired(acc_few, acc_most, f"linear at {few} pairs", f"at {most} pairs", where="(trained length)")


def _overwrite_costs_additive_memory(rows: Rows):
    """recall minus overwrite accuracy at the trained length: what rewriting keys costs a rung."""
    acc = {(r, t): rows.recall(r, t) for r in ("linear", "deltanet") for t in RECALL_TASKS}
    if any(not v for v in acc.values()):
        return None
    drop = {r: {s: acc[r, "mqar"][s] - acc[r, "mqar_overwrite"][s]
                for s in set(acc[r, "mqar"]) & set(acc[r, "mqar_overwrite"])} for r in ("linear", "deltanet")}
    return Paired(drop["linear"], drop["deltanet"], "linear's loss from recall to overwrite", "deltanet's",
                  where="at the trained length")


def _better_loss(a: str, b: str):
    def check(rows: Rows):
        la, lb = rows.lm_loss(a), rows.lm_loss(b)
        if not la or not lb:
            return None
        return Paired(la, lb, a, b, holds_if="<", where="held-out loss at the end")
    return check


def _rope_extrapolation(rows: Rows):
    rung = "softmax_conv"
    inside, beyond = rows.recall(rung, "mqar"), rows.recall(rung, "mqar", length="longer")
    seeds = sorted(set(inside) & set(beyond))
    if not seeds:
        return None
    drop = {s: inside[s] - beyond[s] for s in seeds}
    if any(inside[s] < LEARNED for s in seeds):
        return Inconclusive(f"{rung} {mean(inside.values()):.3f} at the trained length, "
                            f"{mean(beyond.values()):.3f} at the longest (same pairs); in some seed it never "
                            f"learned recall at its trained length (< {LEARNED})")
    return Paired(drop, _threshold(drop, EXTRAPOLATION_DROP), f"{rung}'s accuracy lost beyond its trained length",
                  f"{EXTRAPOLATION_DROP}", where="(same pairs, the longest length)")


RECURRENT = ("linear", "deltanet", "gated_deltanet", "kda")


def _state_sizes(rows: Rows):
    costs = {r: rows.cost(r) for r in ("softmax", *RECURRENT, "hybrid", "mla")}
    costs = {r: c for r, c in costs.items() if c is not None}
    if not all(r in costs for r in ("softmax", *RECURRENT, "hybrid")):
        return None
    growth = {r: c["state_bytes_128k"] / c["state_bytes_4k"] for r, c in costs.items()}
    full = [r for r in ("softmax", "mla") if r in costs]  # full attention: the cache grows with context
    holds = (all(growth[r] < 1.01 for r in RECURRENT) and all(growth[r] > 31 for r in full)
             and all(costs["hybrid"]["state_bytes_128k"] < costs[r]["state_bytes_128k"] for r in full))
    return Exact(holds, "128k/4k: " + ", ".join(f"{r} {g:.1f}x" for r, g in growth.items()))


_CONV_ATTENTION = ("too few steps or too small a model: attention must learn to carry each key onto the value "
                   "after it, which the short conv makes a one-layer job; Zoology trains 32 epochs at the best "
                   "of four learning rates")
_FEW_TOKENS = ("too few tokens for a small difference to show: gating and the finer gate pay off over long "
               "training")
_HYBRID = "too few tokens; at this size MLA in every layer has more attention than the hybrid's quarter"
_LATE = ("too few steps: MQAR training sits on a loss plateau and each rung leaves it at its own step "
         "(training-loss curves); a rung that left it later is still improving at the end")

CLAIMS = (
    Claim("Zoology (Arora et al. 2023)", "attention (with its short conv, as Zoology builds it) solves MQAR at the "
          "lengths it was trained on", _attention_solves, _CONV_ATTENTION),
    Claim("Zoology (Arora et al. 2023)", "attention (with its short conv) recalls better than linear attention",
          _better_recall("softmax_conv", "linear"), _CONV_ATTENTION),
    Claim("this ladder's CPU diagnosis (BENCHMARKS.md section 12)", "the short conv is what lets attention learn "
          "MQAR at this budget: softmax_conv recalls better than plain RoPE softmax",
          _better_recall("softmax_conv", "softmax"), _CONV_ATTENTION),
    Claim("Based (Arora et al. 2024)", "linear attention's fixed-size state recalls less as the pairs grow",
          _linear_falls, "the state is large for so few pairs"),
    Claim("DeltaNet (Yang et al. 2024)", "the delta rule recalls better than linear attention",
          _better_recall("deltanet", "linear", "all"), _LATE),
    Claim("DeltaNet (Yang et al. 2024)",
          "the delta rule edits memories: on overwrite it beats additive memory, which holds both values",
          _better_recall("deltanet", "linear", task="mqar_overwrite"),
          "too few steps; or linear attention separates the two writes by position (short conv)"),
    Claim("DeltaNet (Yang et al. 2024)", "rewriting keys costs additive memory accuracy, the delta rule less",
          _overwrite_costs_additive_memory, _LATE),
    Claim("Gated DeltaNet (Yang et al. 2025)", "a forget gate on top of the delta rule lowers the LM loss",
          _better_loss("gated_deltanet", "deltanet"), _FEW_TOKENS, uses="lm"),
    Claim("Gated DeltaNet (Yang et al. 2025)", "a forget gate on top of the delta rule recalls better",
          _better_recall("gated_deltanet", "deltanet", "all"), _LATE),
    Claim("Kimi Linear (Moonshot AI 2025)", "KDA's per-channel gate lowers the LM loss below gated DeltaNet's",
          _better_loss("kda", "gated_deltanet"), _FEW_TOKENS, uses="lm"),
    Claim("Kimi Linear (Moonshot AI 2025)", "KDA's per-channel gate recalls better than gated DeltaNet's per-head gate",
          _better_recall("kda", "gated_deltanet", "all"), _LATE),
    Claim("Kimi Linear (Moonshot AI 2025)", "KDA mixed 3:1 with MLA beats full MLA at equal training (LM loss)",
          _better_loss("hybrid", "mla"), _HYBRID, uses="lm"),
    Claim("Kimi Linear (Moonshot AI 2025)", "KDA mixed 3:1 with MLA beats full MLA at equal training (recall)",
          _better_recall("hybrid", "mla", "all"), _HYBRID),
    Claim("RoPE extrapolation (Press et al. 2022, ALiBi)",
          "softmax attention with RoPE degrades on sequences longer than it was trained on",
          _rope_extrapolation, "the longer examples only add filler tokens, which the model learned to ignore"),
    Claim("by construction", "recurrent rungs keep a constant state; the KV caches of full attention (softmax, MLA) "
          "grow with context; the hybrid's grows in its MLA layers only, compressed", _state_sizes,
          "a bug in the decode-state sizes (train/ladder/cli.py cost_row)", uses="cost"),
)


def _verdict(result) -> tuple[str, str]:
    if result is None:
        return "not measured", ""
    if isinstance(result, Inconclusive):
        return "inconclusive", result.evidence
    if isinstance(result, Exact):
        return ("agrees" if result.holds else "disagrees"), result.evidence
    verdict, evidence = judge(result)
    return (verdict or "not measured"), evidence


def check_claims(rows: list[dict], train_length: int | None) -> list[dict]:
    """[{source, claim, verdict, evidence, likely_if_not}] in CLAIMS order, the recall claims once
    per width where the rows hold several (the claim's text then names the width)."""
    rows = selected(rows, train_length)
    widths = sorted({r["d_model"] for r in rows if r["task"] in RECALL_TASKS and "d_model" in r})
    out = []
    for c in CLAIMS:
        views = [(None, Rows(rows, train_length))]
        if c.uses == "recall" and len(widths) > 1:
            views = [(w, Rows(rows, train_length, d_model=w)) for w in widths]
        for w, view in views:
            verdict, evidence = _verdict(c.check(view))
            out.append({"source": c.source, "claim": c.text + (f" [d_model {w}]" if w is not None else ""),
                        "verdict": verdict, "evidence": evidence,
                        "likely_if_not": c.likely_if_not if verdict == "disagrees" else ""})
    return out


__all__ = ["CLAIMS", "Claim", "Exact", "Inconclusive", "LEARNED", "Paired", "Rows", "SOLVED", "check_claims", "judge"]
