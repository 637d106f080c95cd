"""ladder.json (rewritten after every finished task, so a crash loses at most the current one),
the Markdown table built from it, and the plots.

ladder.json: {"format", "settings" (what the rows were measured with; a resumed run must
match them), "rungs" (params, FFN width, layer pattern, config fingerprint per rung), "done"
(["<rung>/<task>"]), "commands" (the launches that measured rows), "timing" (per finished
task: wall / CPU / compile seconds, tokens/s, training-loss curve), "environment" (of the
latest launch that measured), "rows"}.
Rows are exactly the issue's:
    {"rung", "task": "mqar" | "mqar_overwrite", "pairs", "seq_len", "accuracy", "params", "steps"}
    {"rung", "task": "lm", "tokens", "eval_loss", "params"}
    {"rung", "task": "cost", "tokens_per_s", "state_bytes_4k", "state_bytes_128k"}
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from k3jax.config import ConfigError
from train.ladder.claims import check_claims
from train.ladder.sizes import RUNGS

FORMAT = "k3jax-ladder-v1"
TASK_TITLES = {"mqar": "Recall (MQAR)", "mqar_overwrite": "Overwrite (MQAR, keys reassigned; answer = latest value)"}


class Ledger:
    """The results file of one output folder: loaded on start, rewritten atomically."""

    def __init__(self, out: Path, settings: dict, *, fresh: bool = False):
        self.out = Path(out)
        self.path = self.out / "ladder.json"
        settings = json.loads(json.dumps(settings))  # as it reads back (tuples are lists)
        self.data = {"format": FORMAT, "settings": settings, "commands": [], "rungs": {}, "done": [], "timing": {},
                     "environment": {}, "rows": []}
        if self.path.is_file() and not fresh:
            try:
                old = json.loads(self.path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"not valid JSON ({e}); pass --fresh to start over", str(self.path)) from None
            if old.get("format") != FORMAT:
                raise ConfigError(f"not a {FORMAT} results file; pass --fresh to start over", str(self.path))
            keys = sorted(set(settings) | set(old["settings"]))
            changed = [k for k in keys if settings.get(k) != old["settings"].get(k)]
            if changed:
                k = changed[0]
                raise ConfigError(f"the finished rungs here were measured with other settings ({k}: "
                                  f"{old['settings'].get(k)!r}, now {settings.get(k)!r}); resuming would mix them. "
                                  "Use another --out, or --fresh to start over", str(self.path))
            self.data = old

    def done(self, rung: str, task: str) -> bool:
        return f"{rung}/{task}" in self.data["done"]

    def finish(self, rung: str, task: str, rows: list[dict], timing: dict | None = None) -> None:
        key = f"{rung}/{task}"
        self.data["rows"] = [r for r in self.data["rows"] if not (r["rung"] == rung and r["task"] == task)] + rows
        if timing is not None:
            self.data["timing"][key] = timing
        if key not in self.data["done"]:
            self.data["done"].append(key)
        self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


# -------------------------------------------------------------------------------------------
# Markdown


def _num(x, digits=3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}f}"


def _bytes(n) -> str:
    for div, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n} B"


def _tokens(n) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def markdown(data: dict) -> str:
    s, rows = data["settings"], data["rows"]
    rungs = [r for r in RUNGS if any(row["rung"] == r for row in rows)]
    commands = data.get("commands") or [data.get("command", "k3jax-ladder")]  # "command": older files
    out = [f"# The lineage ladder, size `{s['size']}`", "", *(f"`{c}`  " for c in commands), ""]
    env = data.get("environment", {})
    if env:
        out += [", ".join(f"{k}: {v}" for k, v in env.items()), ""]
    if data["rungs"]:
        out += ["| rung | layers | FFN width | parameters |", "|---|---|---|---|"]
        for r in RUNGS:
            if r in data["rungs"]:
                info = data["rungs"][r]
                out.append(f"| {r} | `{info['layer_pattern']}` | {info['ffn_hidden']} | {info['params']:,} |")
        out += ["", "Parameters: one model per rung and size, matched to the kda rung through the FFN width "
                "(totals include embedding and LM head)."]
        if s.get("recall"):
            rp = s["recall"]
            out += [f"Recall and overwrite: one model per rung, trained on MQAR and MQAR-overwrite examples "
                    f"(equal token shares) of {'/'.join(map(str, rp['train_pairs']))} pairs in {rp['train_length']} "
                    f"tokens, {rp['steps']} steps of {rp['batch_size']} examples. Overwrite: half the keys are "
                    "written again with a new value and only those are asked. Accuracy over "
                    f"{rp['eval_examples']} held-out examples per cell; cells longer than {rp['train_length']} "
                    "tokens are longer than trained (the queries sit further from the pairs, across filler)."]
        if s.get("lm") and any(r["task"] == "lm" for r in rows):
            lm = s["lm"]
            corpus = s.get("corpus", "stdlib")
            corpus = ("the Python standard library's sources" if corpus == "stdlib" else ", ".join(corpus))
            out += [f"Language modelling: {corpus} (tokenizer {s.get('tokenizer', 'bytes')}), {lm['steps']} steps of "
                    f"{lm['batch_size']} x {lm['seq_len']} tokens; held-out loss on the same "
                    f"{lm['eval_batches']} eval batches each time."]
        out.append("")
    for task in ("mqar", "mqar_overwrite"):
        cells = sorted({(r["seq_len"], r["pairs"]) for r in rows if r["task"] == task})
        if not cells:
            continue
        out += [f"## {TASK_TITLES[task]}: accuracy", "",
                "| rung | params | steps | " + " | ".join(f"{p} pairs @ {L}" for L, p in cells) + " |",
                "|---|---|---|" + "---|" * len(cells)]
        for r in rungs:
            got = {(x["seq_len"], x["pairs"]): x for x in rows if x["rung"] == r and x["task"] == task}
            if got:
                first = next(iter(got.values()))
                out.append(f"| {r} | {first['params']:,} | {first['steps']} | "
                           + " | ".join(_num(got[c]["accuracy"]) if c in got else "—" for c in cells) + " |")
        out.append("")
    lm = [r for r in rows if r["task"] == "lm"]
    if lm:
        out += ["## Language modelling: held-out loss (nats per token) against target tokens seen", ""]
        # every rung reads the same batches, so the eval points share their token counts
        header = sorted({r["tokens"] for r in lm})
        out += ["| rung | params | " + " | ".join(_tokens(t) for t in header) + " |",
                "|---|---|" + "---|" * len(header)]
        for r in rungs:
            pts = sorted((x["tokens"], x["eval_loss"], x["params"]) for x in lm if x["rung"] == r)
            if pts:
                by = {t: loss for t, loss, _ in pts}
                out.append(f"| {r} | {pts[0][2]:,} | " + " | ".join(_num(by.get(h)) for h in header) + " |")
        out.append("")
    cost = [r for r in rows if r["task"] == "cost"]
    if cost:
        froms = {data.get("timing", {}).get(f"{r['rung']}/cost", {}).get("from") for r in cost} - {None}
        src = f"{'/'.join(sorted(froms))} training" if froms else ""
        out += ["## Cost", "",
                f"| rung | training tokens/s{f' ({src})' if src else ''} | decode state @ 4k | decode state @ 128k |",
                "|---|---|---|---|"]
        for r in rungs:
            c = next((x for x in cost if x["rung"] == r), None)
            if c:
                out.append(f"| {r} | {_num(c['tokens_per_s'], 0)} | {_bytes(c['state_bytes_4k'])} | "
                           f"{_bytes(c['state_bytes_128k'])} |")
        out += ["", "Decode state: the mixers' cache per sequence (`k3jax.info.decode_state_bytes`) in the "
                "model's compute dtype: KV for softmax, the latent for MLA, the recurrent state and short-conv "
                "windows for the linear rungs. k3jax's cache also keeps 4 bytes of segment id per slot for every "
                "model (bookkeeping only attention needs), left out here.", ""]
    claims = check_claims(rows, (s.get("recall") or {}).get("train_length"))
    out += ["## Expectations from the literature", "",
            "| source | expectation | our numbers | agrees? |", "|---|---|---|---|"]
    for c in claims:
        verdict = c["verdict"] + (f" (likeliest: {c['likely_if_not']})" if c["likely_if_not"] else "")
        out.append(f"| {c['source']} | {c['claim']} | {c['evidence'] or '—'} | {verdict} |")
    out += ["", "Thresholds are fixed in `train/ladder/claims.py`, not tuned to these runs.", ""]
    timing = data.get("timing", {})
    runs = {}  # the recall tasks share one trained model: count it once
    for key, v in timing.items():
        rung, task = key.split("/")
        if "wall_s" in v:
            runs.setdefault((rung, "recall" if task in TASK_TITLES else task), v)
    if runs:
        out += ["Time per trained model, wall / CPU seconds (compile and evaluation included): " + ", ".join(
            f"{r} {t} {v['wall_s']:.0f} / {v.get('cpu_s', float('nan')):.0f}" for (r, t), v in runs.items())
            + "; in all " + ", ".join(f"{sum(v['wall_s'] for (_, t), v in runs.items() if t == kind) / 60:.1f} min "
                                      f"wall for the {kind} models" for kind in dict.fromkeys(t for _, t in runs))
            + ". Training-loss curves: `ladder_train_loss.png`.", ""]
    return "\n".join(out)


# -------------------------------------------------------------------------------------------
# Plots


def plot(data: dict, out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:  # a bare GPU machine: the table and ladder.json are what matter there
        print("k3jax-ladder: no matplotlib, plots left out (redraw them elsewhere: k3jax-ladder --report-only)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows, written = data["rows"], []
    colors = {r: f"C{i}" for i, r in enumerate(RUNGS)}
    recall_tasks = [t for t in ("mqar", "mqar_overwrite") if any(r["task"] == t for r in rows)]
    if recall_tasks:
        lengths = sorted({r["seq_len"] for r in rows if r["task"] in recall_tasks})
        fig, axes = plt.subplots(len(recall_tasks), len(lengths), figsize=(3.6 * len(lengths), 3.2 * len(recall_tasks)),
                                 squeeze=False, sharey=True)
        for i, task in enumerate(recall_tasks):
            for j, L in enumerate(lengths):
                ax = axes[i][j]
                for rung in RUNGS:
                    pts = sorted((r["pairs"], r["accuracy"]) for r in rows
                                 if r["task"] == task and r["rung"] == rung and r["seq_len"] == L)
                    if pts:
                        ax.plot(*zip(*pts), "o-", color=colors[rung], label=rung)
                ax.set_xscale("log", base=2)
                # plain labels at the measured pair counts (log2 ticks would go through mathtext,
                # whose first use costs seconds)
                pairs = sorted({r["pairs"] for r in rows if r["task"] in recall_tasks})
                ax.set_xticks(pairs, [str(p) for p in pairs])
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                ax.set_ylim(-0.02, 1.02)
                ax.set_title(f"{'overwrite' if task == 'mqar_overwrite' else 'recall'}, length {L}", fontsize=9)
                ax.set_xlabel("key-value pairs")
                ax.grid(alpha=0.3)
            axes[i][0].set_ylabel("accuracy")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        written.append(_save(fig, out / "ladder_recall.png"))
    lm = [r for r in rows if r["task"] == "lm"]
    if lm:
        fig, ax = plt.subplots(figsize=(6, 4))
        for rung in RUNGS:
            pts = sorted((r["tokens"], r["eval_loss"]) for r in lm if r["rung"] == rung)
            if pts:
                ax.plot(*zip(*pts), "o-", color=colors[rung], label=rung)
        ax.set_xlabel("target tokens seen")
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, out / "ladder_lm.png"))
    timing = data.get("timing", {})
    curves = {(r, t): timing[f"{r}/{t}"]["train_loss"] for r in RUNGS for t in ("mqar", "lm")
              if "train_loss" in timing.get(f"{r}/{t}", {})}
    if curves:
        kinds = [t for t in ("mqar", "lm") if any(k[1] == t for k in curves)]
        fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
        for ax, task in zip(axes[0], kinds):
            for rung in RUNGS:
                if (rung, task) in curves:
                    ax.plot(*zip(*curves[rung, task]), color=colors[rung], label=rung)
            ax.set_title("recall model (MQAR + overwrite)" if task == "mqar" else "language model", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("training loss")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, out / "ladder_train_loss.png"))
    cost = {r["rung"]: r for r in rows if r["task"] == "cost"}
    if cost:
        names = [r for r in RUNGS if r in cost]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
        a.bar(names, [cost[r]["tokens_per_s"] for r in names], color=[colors[r] for r in names])
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
