"""ladder.json (rewritten after every finished run, so a crash loses at most the current one),
the Markdown tables built from it, and the plots.

ladder.json: {"format", "settings" (the size's plan; the parts that shape the rows beyond each
rung's function, `COMPARED`, must match on resume), "rungs" (per model, "rung" or "rung@d128":
params, FFN width, layer pattern, and per kind of model trained the function its rows measured
with its fingerprint, train/ladder/fingerprint.py), "done" (run keys, runs.Run.key), "commands"
(the launches that measured rows), "timing" (per run key: wall / CPU / compile seconds, tokens/s,
training-loss curve), "environment" (of the latest launch that measured), "rows"}.
Rows:
    {"rung", "task": "mqar" | "mqar_overwrite", "seed", "d_model", "lr", "pairs", "seq_len", "accuracy",
     "params", "steps"}
    {"rung", "task": "lm", "seed", "step", "tokens", "eval_loss", "params"}
    {"rung", "task": "cost", "tokens_per_s", "state_bytes_4k", "state_bytes_128k"}
Each table cell is the mean over seeds, with the spread (max - min) beside it where there are
several; recall rows at each rung's best learning rate where the size sweeps it (runs.selected).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from k3jax.config import ConfigError
from train.ladder.claims import check_claims
from train.ladder.fingerprint import flat
from train.ladder.runs import RECALL_TASKS, best_lrs, mean, normalized, recall_score, selected, spread
from train.ladder.sizes import RUNG_ABOUT, RUNGS

FORMAT = "k3jax-ladder-v2"
OLD_FORMATS = ("k3jax-ladder-v1",)  # one seed, whole-config fingerprints: redrawn, never resumed
TASK_TITLES = {"mqar": "Recall (MQAR)", "mqar_overwrite": "Overwrite (MQAR, keys reassigned; answer = latest value)"}
# the settings that shape the rows beyond each rung's function (which fingerprint.py compares)
COMPARED = ("size", "recall.train_length", "recall.eval_pairs", "recall.eval_lengths", "recall.eval_examples",
            "lm.evals", "lm.eval_batches")


def read_ledger(path: Path, *, formats=(FORMAT,), hint: str = "") -> dict:
    """A ladder.json's contents, or a ConfigError naming the file: missing, not JSON, or not one of
    `formats` (`hint` says what to do, e.g. "; pass --fresh to start over")."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such ladder.json{hint}", str(path))
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"not valid JSON ({e}){hint}", str(path)) from None
    if data.get("format") not in formats:
        raise ConfigError(f"not a {FORMAT} results file{hint}", str(path))
    return data


def write_ledger(path: Path, data: dict) -> None:
    """ladder.json written atomically (a crash leaves the old file or the new one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def settings_change(then: dict, now: dict) -> tuple[str, object, object] | None:
    """The first of the COMPARED settings that differs between two ledgers' settings, as
    (key, then, now); None when their rows can share a table."""
    a, b = flat(then), flat(now)
    changed = [k for k in sorted(set(a) | set(b)) if k.startswith(COMPARED) and a.get(k) != b.get(k)]
    return (changed[0], a.get(changed[0]), b.get(changed[0])) if changed else None


class Ledger:
    """The results file of one output folder: loaded on start, rewritten atomically."""

    def __init__(self, out: Path, settings: dict, *, fresh: bool = False):
        self.out = Path(out)
        self.path = self.out / "ladder.json"
        settings = json.loads(json.dumps(settings))  # as it reads back (tuples are lists)
        self.data = {"format": FORMAT, "settings": settings, "commands": [], "rungs": {}, "done": [], "timing": {},
                     "environment": {}, "rows": []}
        if self.path.is_file() and not fresh:
            old = read_ledger(self.path, formats=(FORMAT, *OLD_FORMATS), hint="; pass --fresh to start over")
            if old.get("format") in OLD_FORMATS:
                raise ConfigError("written by an earlier k3jax-ladder (one seed, whole-config fingerprints): its rows "
                                  "cannot be resumed. Redraw it with --report-only, or use another --out, or --fresh",
                                  str(self.path))
            change = settings_change(old["settings"], settings)
            if change:
                k, then, now = change
                raise ConfigError(f"the rows here were measured with other settings ({k}: {then!r}, now "
                                  f"{now!r}); resuming would mix them. Use another --out, or --fresh to "
                                  "start over", str(self.path))
            old["settings"] = settings  # the description of the plan, as of this launch
            self.data = old

    def done(self, key: str) -> bool:
        return key in self.data["done"]

    def finish(self, key: str, rows: list[dict], timing: dict | None = None) -> None:
        """The rows of one finished run (task) and its timing, saved with the key in one write."""
        if key in self.data["done"]:
            raise ValueError(f"{key} is finished already")
        self.data["rows"] += rows
        if timing is not None:
            self.data["timing"][key] = timing
        self.data["done"].append(key)
        self.save()

    def save(self) -> None:
        write_ledger(self.path, self.data)


# -------------------------------------------------------------------------------------------
# Markdown


def _num(x, digits=3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}f}"


def cell(values, digits: int = 3) -> str:
    """A table cell: the mean over seeds, and the spread (max - min) in brackets where several."""
    values = list(values)
    if not values:
        return "—"
    if len(values) == 1:
        return _num(values[0], digits)
    return f"{mean(values):.{digits}f} ({spread(values):.{digits}f})"


def _bytes(n) -> str:
    for div, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n} B"


def _tokens(n) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


def _seeds(rows) -> list[int]:
    return sorted({r.get("seed", 0) for r in rows})


def _widths(rows) -> list[int | None]:
    ds = sorted({r["d_model"] for r in rows if r["task"] in RECALL_TASKS and "d_model" in r})
    return ds if len(ds) > 1 else [None]


def _rung_table(data: dict) -> list[str]:
    models = data["rungs"]
    several = any("@" in k for k in models)
    out = ["| rung | " + ("width | " if several else "") + "layers | FFN width | parameters |",
           "|---|" + ("---|" if several else "") + "---|---|---|"]
    for r in RUNGS:
        for key, info in models.items():
            if info.get("rung", key) == r:
                out.append(f"| {r} | " + (f"{info.get('d_model')} | " if several else "")
                           + f"`{info['layer_pattern']}` | {info['ffn_hidden']} | {info['params']:,} |")
    return out


def _plan_text(s: dict, rows) -> list[str]:
    out = []
    if s.get("recall"):
        rp = s["recall"]
        overwrite = rp.get("overwrite", True)
        what = "MQAR and MQAR-overwrite examples (equal token shares)" if overwrite else "MQAR examples"
        per = ["rung"] + (["width"] if s.get("widths") else []) + (["learning rate"] if s.get("lrs") else []) + ["seed"]
        out.append(f"Recall: one model per {', '.join(per[:-1])} and {per[-1]}, "
                   f"trained on {what} of {'/'.join(map(str, rp['train_pairs']))} pairs in {rp['train_length']} "
                   f"tokens, {rp['steps']} steps of {rp['batch_size']} examples."
                   + (" Overwrite: half the keys are written again with a new value and only those are asked."
                      if overwrite else "")
                   + f" Accuracy over {rp['eval_examples']} held-out examples per cell; cells longer than "
                   f"{rp['train_length']} tokens are longer than trained (the queries sit further from the pairs, "
                   "across filler).")
    if s.get("lrs"):
        sweep = s.get("sweep_seeds") or 0
        where = ("at every seed" if not sweep else
                 f"at the first {'seed' if sweep == 1 else f'{sweep} seeds'}; the other seeds run at each rung and "
                 "width's best rate from it")
        out.append(f"Learning rates swept: {', '.join(f'{x:g}' for x in s['lrs'])}, {where}. Each rung and width is "
                   "shown at its best rate (the highest mean MQAR accuracy at the trained length), as Zoology "
                   "reports its models.")
    if s.get("lm") and any(r["task"] == "lm" for r in rows):
        lm = s["lm"]
        corpus = s.get("corpus", "stdlib")
        corpus = "the Python standard library's sources" if corpus == "stdlib" else ", ".join(corpus)
        out.append(f"Language modelling: {corpus} (tokenizer {s.get('tokenizer', 'bytes')}), {lm['steps']} steps of "
                   f"{lm['batch_size']} x {lm['seq_len']} tokens; held-out loss on the same {lm['eval_batches']} eval "
                   "batches at each point.")
    seeds = _seeds([r for r in rows if r["task"] != "cost"])
    if seeds:
        out.append(f"Seeds: {', '.join(map(str, seeds))} (train.seed = data.seed: the initialisation and the order "
                   "of the training data; the eval rows are the same for every seed). Each cell: the mean over "
                   "seeds, and in brackets the spread, max - min." if len(seeds) > 1 else
                   f"One seed ({seeds[0]}): no spread, so no claim can be settled (claims.py).")
    return out


def _recall_tables(rows, s) -> list[str]:
    out = []
    for width in _widths(rows):
        mine = [r for r in rows if width is None or r.get("d_model") == width]
        for task in RECALL_TASKS:
            cells = sorted({(r["seq_len"], r["pairs"]) for r in mine if r["task"] == task})
            if not cells:
                continue
            title = TASK_TITLES[task] + (f", d_model {width}" if width else "")
            lr_col = any("lr" in r for r in mine) and bool(s.get("lrs"))
            out += [f"## {title}: accuracy", "",
                    "| rung | params | steps | " + ("lr | " if lr_col else "") + "seeds | "
                    + " | ".join(f"{p} pairs @ {L}" for L, p in cells) + " |",
                    "|---|---|---|" + ("---|" if lr_col else "") + "---|" + "---|" * len(cells)]
            for rung in RUNGS:
                got = [x for x in mine if x["rung"] == rung and x["task"] == task]
                if not got:
                    continue
                first = got[0]
                out.append(f"| {rung} | {first['params']:,} | {first['steps']} | "
                           + (f"{first['lr']:g} | " if lr_col else "") + f"{len(_seeds(got))} | "
                           + " | ".join(cell([x["accuracy"] for x in got if (x["seq_len"], x["pairs"]) == c])
                                        for c in cells) + " |")
            out.append("")
    return out


def _sweep_table(all_rows, s) -> list[str]:
    """Every learning rate's recall score (mean MQAR accuracy at the trained length, per seed)."""
    lrs = s.get("lrs")
    train_length = (s.get("recall") or {}).get("train_length")
    recall = [r for r in all_rows if r["task"] in RECALL_TASKS and "lr" in r]
    if not lrs or not recall:
        return []
    best = best_lrs(all_rows, train_length)
    out = ["## The learning-rate sweep: mean MQAR accuracy at the trained length (* = the rate shown)", "",
           "| rung | width | " + " | ".join(f"lr {x:g}" for x in lrs) + " |", "|---|---|" + "---|" * len(lrs)]
    for rung in RUNGS:
        for d in sorted({r["d_model"] for r in recall if r["rung"] == rung}):
            scores = []
            for lr in lrs:
                per_seed = recall_score([r for r in recall if (r["rung"], r["d_model"], r["lr"]) == (rung, d, lr)],
                                        train_length)
                mark = "*" if best.get((rung, d)) == lr else ""
                scores.append(cell(per_seed.values()) + mark)
            out.append(f"| {rung} | {d} | " + " | ".join(scores) + " |")
    return out + [""]


def _lm_table(rows) -> list[str]:
    lm = [r for r in rows if r["task"] == "lm"]
    if not lm:
        return []
    steps = sorted({r["step"] for r in lm})
    # every seed of every rung evaluates at the same steps; the target tokens seen by then differ
    # a little between seeds (packing), so the header shows their mean
    header = [_tokens(mean(r["tokens"] for r in lm if r["step"] == st)) for st in steps]
    out = ["## Language modelling: held-out loss (nats per token) against target tokens seen", "",
           "| rung | params | seeds | " + " | ".join(header) + " |", "|---|---|---|" + "---|" * len(steps)]
    for rung in RUNGS:
        mine = [r for r in lm if r["rung"] == rung]
        if mine:
            out.append(f"| {rung} | {mine[0]['params']:,} | {len(_seeds(mine))} | "
                       + " | ".join(cell([r["eval_loss"] for r in mine if r["step"] == st]) for st in steps) + " |")
    return out + [""]


def _cost_table(data, rows) -> list[str]:
    cost = [r for r in rows if r["task"] == "cost"]
    if not cost:
        return []
    froms = {data.get("timing", {}).get(f"{r['rung']}/cost", {}).get("from") for r in cost} - {None}
    src = f"{'/'.join(sorted(froms))} training" if froms else ""
    out = ["## Cost", "",
           f"| rung | training tokens/s{f' ({src})' if src else ''} | decode state @ 4k | decode state @ 128k |",
           "|---|---|---|---|"]
    for rung in RUNGS:
        c = next((x for x in cost if x["rung"] == rung), None)
        if c:
            out.append(f"| {rung} | {_num(c['tokens_per_s'], 0)} | {_bytes(c['state_bytes_4k'])} | "
                       f"{_bytes(c['state_bytes_128k'])} |")
    return out + ["", "Training tokens/s: the mean over the rung's runs (batch x sequence per second, compile and "
                  "evals excluded). Decode state: the mixers' cache per sequence in the model's compute dtype: KV "
                  "for softmax, the latent for MLA, the recurrent state and short-conv windows for the linear rungs "
                  "(and softmax_conv's windows). k3jax's cache also keeps 4 bytes of segment id per slot for every "
                  "model (bookkeeping only attention needs), left out here.", ""]


def _timing_text(data) -> list[str]:
    timing = data.get("timing", {})
    per_rung: dict[str, list[float]] = {}
    seen = set()
    for key, v in timing.items():
        if "wall_s" not in v:
            continue
        parts = key.split("/")
        model = (parts[0], "recall" if parts[1] in RECALL_TASKS else parts[1], *parts[2:])
        if model in seen:  # the recall tasks share one trained model: count it once
            continue
        seen.add(model)
        per_rung.setdefault(parts[0], []).append(v["wall_s"])
    if not per_rung:
        return []
    total = sum(sum(v) for v in per_rung.values())
    shared = sorted({v["shared_device"] for v in timing.values() if v.get("shared_device", 1) > 1})
    note = (f" Runs marked as sharing the device ran beside {' or '.join(str(n - 1) for n in shared)} other ladder "
            f"process(es) (`--parallel`): their times are not the rungs' own." if shared else "")
    return ["Wall time per trained model (compile, when the run compiled its program, and evaluation included): "
            + ", ".join(f"{r} {len(v)} x {mean(v):.0f} s" for r, v in per_rung.items())
            + f"; {total / 60:.1f} min in all.{note} Training-loss curves: `ladder_train_loss.png`.", ""]


def markdown(data: dict) -> str:
    s = data["settings"]
    train_length = (s.get("recall") or {}).get("train_length")
    all_rows = normalized(data["rows"])
    rows = selected(all_rows, train_length)
    commands = data.get("commands") or [data.get("command", "k3jax-ladder")]  # "command": older files
    out = [f"# The lineage ladder, size `{s['size']}`", "", *(f"`{c}`  " for c in commands), ""]
    env = data.get("environment", {})
    if env:
        out += [", ".join(f"{k}: {v}" for k, v in env.items()), ""]
    if data["rungs"]:
        out += _rung_table(data)
        out += ["", "Parameters: one model per rung (and width), matched to the kda rung through the FFN width "
                "(totals include embedding and LM head). The rungs: "
                + "; ".join(f"{r}, {RUNG_ABOUT[r]}" for r in RUNGS
                            if any(info.get("rung", k) == r for k, info in data["rungs"].items())) + "."]
        out += _plan_text(s, all_rows)
        out.append("")
    out += _recall_tables(rows, s) + _sweep_table(all_rows, s) + _lm_table(rows) + _cost_table(data, rows)
    claims = check_claims(all_rows, train_length)
    out += ["## Expectations from the literature", "",
            "| source | expectation | our numbers | verdict |", "|---|---|---|---|"]
    for c in claims:
        verdict = c["verdict"] + (f" (likeliest: {c['likely_if_not']})" if c["likely_if_not"] else "")
        out.append(f"| {c['source']} | {c['claim']} | {c['evidence'] or '—'} | {verdict} |")
    out += ["", "Verdicts (`train/ladder/claims.py`, thresholds fixed before the runs): *agrees* when the claim holds "
            "in every seed and the mean difference exceeds the seed spread (the larger max - min of the two sides) "
            "and 0.001, the tables' last digit (a floor added 2026-12-06); *disagrees* the same the other way; "
            "otherwise *not settled at this budget*.", ""]
    return "\n".join(out + _timing_text(data))


# -------------------------------------------------------------------------------------------
# Plots


def _band(ax, xs, per_x: list[list[float]], color, label, marker="o-"):
    """The mean over seeds as a line, min..max as error bars."""
    import numpy as np

    m = np.array([np.mean(v) for v in per_x])
    lo = m - np.array([np.min(v) for v in per_x])
    hi = np.array([np.max(v) for v in per_x]) - m
    if any(len(v) > 1 for v in per_x):
        ax.errorbar(xs, m, yerr=[lo, hi], fmt=marker, color=color, label=label, capsize=2, ms=4)
    else:
        ax.plot(xs, m, marker, color=color, label=label, ms=4)


def plot(data: dict, out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:  # a bare GPU machine: the table and ladder.json are what matter there
        print("k3jax-ladder: no matplotlib, plots left out (redraw them elsewhere: k3jax-ladder --report-only)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    s = data["settings"]
    all_rows = normalized(data["rows"])
    rows = selected(all_rows, (s.get("recall") or {}).get("train_length"))
    written = []
    colors = {r: f"C{i}" for i, r in enumerate(RUNGS)}
    recall_tasks = [t for t in RECALL_TASKS if any(r["task"] == t for r in rows)]
    if recall_tasks:
        lengths = sorted({r["seq_len"] for r in rows if r["task"] in recall_tasks})
        panels = [(t, w) for t in recall_tasks for w in _widths(rows)]
        fig, axes = plt.subplots(len(panels), len(lengths), figsize=(3.6 * len(lengths), 3.2 * len(panels)),
                                 squeeze=False, sharey=True)
        pairs_all = sorted({r["pairs"] for r in rows if r["task"] in recall_tasks})
        for i, (task, width) in enumerate(panels):
            for j, L in enumerate(lengths):
                ax = axes[i][j]
                for rung in RUNGS:
                    mine = [r for r in rows if r["task"] == task and r["rung"] == rung and r["seq_len"] == L
                            and (width is None or r.get("d_model") == width)]
                    ps = sorted({r["pairs"] for r in mine})
                    if ps:
                        _band(ax, ps, [[r["accuracy"] for r in mine if r["pairs"] == p] for p in ps], colors[rung], rung)
                ax.set_xscale("log", base=2)
                # plain labels at the measured pair counts (log2 ticks would go through mathtext,
                # whose first use costs seconds)
                ax.set_xticks(pairs_all, [str(p) for p in pairs_all])
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                ax.set_ylim(-0.02, 1.02)
                ax.set_title(f"{'overwrite' if task == 'mqar_overwrite' else 'recall'}, length {L}"
                             + (f", d_model {width}" if width else ""), fontsize=9)
                ax.set_xlabel("key-value pairs")
                ax.grid(alpha=0.3)
            axes[i][0].set_ylabel("accuracy (mean, min-max over seeds)")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        written.append(_save(fig, out / "ladder_recall.png"))
    lm = [r for r in rows if r["task"] == "lm"]
    if lm:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for rung in RUNGS:
            mine = [r for r in lm if r["rung"] == rung]
            steps = sorted({r["step"] for r in mine})
            if steps:
                xs = [mean(r["tokens"] for r in mine if r["step"] == st) for st in steps]
                _band(ax, xs, [[r["eval_loss"] for r in mine if r["step"] == st] for st in steps], colors[rung], rung)
        _axes(ax, "target tokens seen", "held-out loss (nats/token; mean, min-max over seeds)")
        fig.tight_layout()
        written.append(_save(fig, out / "ladder_lm.png"))
    curves: dict[tuple[str, str], list] = {}
    for key, v in data.get("timing", {}).items():
        parts = key.split("/")
        if "train_loss" in v and parts[1] in ("mqar", "lm"):
            curves.setdefault((parts[1], parts[0]), []).append(v["train_loss"])
    if curves:
        kinds = [t for t in ("mqar", "lm") if any(k[0] == t for k in curves)]
        fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
        for ax, task in zip(axes[0], kinds):
            for rung in RUNGS:
                for i, c in enumerate(curves.get((task, rung), [])):
                    if c:
                        ax.plot(*zip(*c), color=colors[rung], label=rung if i == 0 else None, lw=1, alpha=0.8)
            ax.set_title(("recall models" if task == "mqar" else "language models") + " (every run)", fontsize=9)
            _axes(ax, "step", "training loss")
        fig.tight_layout()
        written.append(_save(fig, out / "ladder_train_loss.png"))
    cost = {r["rung"]: r for r in rows if r["task"] == "cost"}
    if cost:
        names = [r for r in RUNGS if r in cost]
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
        a.bar(names, [cost[r]["tokens_per_s"] or 0 for r in names], color=[colors[r] for r in names])
        a.set_ylabel("training tokens/s")
        x = range(len(names))
        b.bar([i - 0.2 for i in x], [cost[r]["state_bytes_4k"] for r in names], 0.4, label="4k tokens")
        b.bar([i + 0.2 for i in x], [cost[r]["state_bytes_128k"] for r in names], 0.4, label="128k tokens")
        b.set_xticks(list(x), names)
        b.set_yscale("log")
        b.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=32))  # 32 KiB, 1 MiB, 32 MiB, ...
        b.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: _bytes(int(v))))
        b.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        b.set_ylabel("decode state per sequence")
        b.legend(fontsize=8)
        for ax in (a, b):
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        fig.tight_layout()
        written.append(_save(fig, out / "ladder_cost.png"))
    return written


def _axes(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_report(data: dict, out: Path, *, plots: bool = True) -> list[Path]:
    """ladder.md, and unless told not to the plots, from the results so far."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "ladder.md"
    md.write_text(markdown(data))
    return [md, *(plot(data, out) if plots else [])]
