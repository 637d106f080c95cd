"""One-off: issue 47's acceptance figures from this folder's two runs, and layers.png.

    python summarize.py        # writes summary.json (the README's figures) and layers.png beside it

For each run (metrics.jsonl): the worst layer's max_violation from step 50 on, the mean over
layers (at each logged step from 50, then the largest and the last of those means), idle experts,
the eval losses, the mean training loss of the last 50 steps, and tokens/s over steps 21-300
(the tokens over the summed window times, and the median window) with the eval windows left out.
"""
import json
import statistics
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
RUNS = [("before", "before: 4bc07ef (lr 3e-3 / 20 warmup, linear-bin histogram)"),
        ("after", "after: this tree's defaults (lr 1e-3 / 100 warmup, asinh-bin histogram)")]


def load(name):
    rows = [json.loads(x) for x in (HERE / f"{name}_metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "loss" in r], {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}


def summary(name):
    steps, evals = load(name)
    late = [r for r in steps if r["step"] >= 50]
    viol = np.array([r["max_violation"] for r in late])  # [logged steps, layers]
    means = viol.mean(1)
    timed = [r for r in steps if r["step"] > 20 and r["step"] not in evals]  # an eval's window holds its time
    tokens = sum(r["tokens"] for r in timed)
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    return {"last_step": steps[-1]["step"],
            "worst_from_50": float(viol.max()), "worst_at": int(late[int(viol.max(1).argmax())]["step"]),
            "worst_layer_last": float(viol[-1].max()),
            "mean_over_layers_max_from_50": float(means.max()), "mean_over_layers_last": float(means[-1]),
            "mean_over_layers_avg_from_50": float(means.mean()),
            "idle_experts_max_from_50": float(max(max(r["idle_experts"]) for r in late)) if "idle_experts" in late[0] else None,
            "hot_share_max_from_50": float(max(max(r["hot_share"]) for r in late)) if "hot_share" in late[0] else None,
            "evals": evals, "train_loss_last50": statistics.fmean(r["loss"] for r in steps if r["step"] > steps[-1]["step"] - 50),
            "tokens_per_s": tokens / seconds,
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in timed)}


def plot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(RUNS), 1, figsize=(11, 2.8 * len(RUNS)), sharex=True)
    for ax, (name, title) in zip(axes, RUNS):
        steps, _ = load(name)
        s = np.array([r["step"] for r in steps])
        v = np.array([r["max_violation"] for r in steps]).T
        im = ax.imshow(v, aspect="auto", cmap="magma", vmin=0, vmax=7, interpolation="nearest",
                       extent=(s[0] - 0.5, s[-1] + 0.5, v.shape[0] - 0.5, -0.5))
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("MoE layer")
    fig.colorbar(im, ax=axes, label="max_violation (7 = one expert in every token's top-8)")
    axes[-1].set_xlabel("step")
    fig.savefig(HERE / "layers.png", dpi=90)


if __name__ == "__main__":
    out = {name: summary(name) for name, _ in RUNS}
    out["after_over_before_tokens_per_s"] = out["after"]["tokens_per_s"] / out["before"]["tokens_per_s"]
    (HERE / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    plot()
