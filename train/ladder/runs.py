"""Runs and their rows: the keys ladder.json files them under, the statistics over seeds, and
the choice of each rung's best learning rate where a size sweeps it.

A run trains one model: one rung, at one width, learning rate and seed, for one kind of task
(the recall tasks share one model, the LM task has its own). Its rows carry `seed`, and the
recall rows `d_model` and `lr`, so a table can put seeds side by side and pick learning rates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RECALL_TASKS = ("mqar", "mqar_overwrite")
MIN_SEEDS = 2  # a claim is settled on at least this many seeds (claims.py)


@dataclass(frozen=True)
class Run:
    rung: str
    kind: str  # "recall" | "lm"
    seed: int
    d_model: int | None = None  # the width, where the size trains several
    lr: float | None = None  # the learning rate, where the size sweeps it

    def key(self, task: str) -> str:
        """ladder.json's name for this run's rows of one task: "kda/lm/s0", "kda/mqar/d128/lr0.001/s1"."""
        parts = [self.rung, task]
        if self.d_model is not None:
            parts.append(f"d{self.d_model}")
        if self.lr is not None:
            parts.append(f"lr{self.lr:g}")
        return "/".join(parts + [f"s{self.seed}"])


def model_key(rung: str, d_model: int | None) -> str:
    """ladder.json's "rungs" entry of one model: the rung, or "rung@d128" per width."""
    return rung if d_model is None else f"{rung}@d{d_model}"


def spread(values) -> float:
    """max - min over seeds (0 for one seed): what the tables print beside each mean."""
    values = list(values)
    return float(max(values) - min(values)) if values else 0.0


def mean(values) -> float:
    return float(np.mean(list(values)))


def by_seed(rows: list[dict], value: str) -> dict[int, float]:
    """{seed: mean of `value` over rows of that seed}."""
    out: dict[int, list[float]] = {}
    for r in rows:
        out.setdefault(r.get("seed", 0), []).append(r[value])
    return {s: float(np.mean(v)) for s, v in sorted(out.items())}


def normalized(rows: list[dict]) -> list[dict]:
    """Rows of the first ladder.json format (one seed, no step on LM rows) in this one's shape:
    seed 0, and each LM row's eval index as its step."""
    out, lm_index = [], {}
    for r in rows:
        r = dict(r)
        r.setdefault("seed", 0)
        if r["task"] == "lm" and "step" not in r:
            lm_index[r["rung"]] = lm_index.get(r["rung"], 0) + 1
            r["step"] = lm_index[r["rung"]]
        out.append(r)
    return out


def recall_score(rows: list[dict], train_length: int) -> dict[int, float]:
    """{seed: mean MQAR accuracy at the trained length} (overwrite where a size has no plain MQAR)."""
    for task in RECALL_TASKS:
        mine = [r for r in rows if r["task"] == task and r["seq_len"] == train_length]
        if mine:
            return by_seed(mine, "accuracy")
    return {}


def best_lrs(rows: list[dict], train_length: int | None) -> dict[tuple[str, int], float]:
    """{(rung, d_model): the learning rate with the highest recall score} (ties: the smaller rate).
    Zoology reports each model at its best rate. The score is the mean over the seeds that ran
    every rate of the sweep (the seeds run later at the chosen rate alone do not move the choice;
    where no seed ran them all, over each rate's own seeds)."""
    rates: dict[tuple[str, int], set[float]] = {}
    for r in rows:
        if r["task"] in RECALL_TASKS and "lr" in r:
            rates.setdefault((r["rung"], r["d_model"]), set()).add(r["lr"])
    groups = {key: {lr: recall_score([r for r in rows if (r["rung"], r.get("d_model"), r.get("lr")) == (*key, lr)],
                                     train_length) for lr in lrs} for key, lrs in rates.items()}
    out = {}
    for key, by_lr in groups.items():
        by_lr = {lr: s for lr, s in by_lr.items() if s}
        if not by_lr:
            continue
        common = set.intersection(*(set(s) for s in by_lr.values()))
        scores = {lr: mean(v for seed, v in s.items() if not common or seed in common) for lr, s in by_lr.items()}
        out[key] = min(scores, key=lambda lr: (-scores[lr], lr))
    return out


def selected(rows: list[dict], train_length: int | None) -> list[dict]:
    """The rows a table shows: the recall rows of each rung and width at its best learning rate
    (all of them where only one rate ran), every other row as it is."""
    best = best_lrs(rows, train_length)
    return [r for r in rows if r["task"] not in RECALL_TASKS or "lr" not in r
            or best.get((r["rung"], r["d_model"])) == r["lr"]]


__all__ = ["MIN_SEEDS", "RECALL_TASKS", "Run", "best_lrs", "by_seed", "mean", "model_key", "normalized",
           "recall_score", "selected", "spread"]
