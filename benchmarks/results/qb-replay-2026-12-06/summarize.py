"""One-off: this folder's figures (summary.json) and layers.png.

    python summarize.py

Live runs (metrics.jsonl here: qb_update_rate 0.5; ../qb-accept-2026-12-06/after_metrics.jsonl:
the defaults, logged every 10; ../qb-steps-2026-12-06/metrics.jsonl: the defaults, every step):
the worst layer and the mean over layers of each 10-step window from step 50, as the issue's goal
reads them. Replays (replay.jsonl): per checkpoint and rate, the same figures from the per-step
values (averaged into the same 10-step windows), the episode's steps 191-201 against the rest,
and the per-step correlation with the live per-step run (replay.jsonl and replay_b.jsonl: two
calls on the same checkpoints). CPU (cpu_tiny64_*.jsonl): k3-tiny with k3-small's routing,
frozen after 200 steps, replayed at 8, 32 and 128 rows a batch:

    python -m train --config configs/k3-tiny.yaml model.moe.num_experts=64 model.moe.top_k=8 \
        model.moe.expert_hidden=32 model.moe.qb_estimator=histogram train.steps=200 checkpoint.every=200 run_dir=R
    python replay_frozen.py R cpu_tiny64_replay_bB.jsonl --steps 60 --replays 200:1 --set train.batch_size=B
"""
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
# key in summary.json: (label, metrics file)
LIVE = {"live_rate05": ("live, qb_update_rate 0.5 (this folder)", HERE / "metrics.jsonl"),
        "live_defaults": ("live, defaults: rate 1 (../qb-accept-2026-12-06 after)",
                          HERE.parent / "qb-accept-2026-12-06/after_metrics.jsonl"),
        "live_defaults_every_step": ("live, defaults, logged every step (../qb-steps-2026-12-06)",
                                     HERE.parent / "qb-steps-2026-12-06/metrics.jsonl")}


def rows(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def windows(per_step: dict) -> dict:
    """{window end: [layers] mean over its 10 steps} from {step: [layers]}."""
    out = {}
    for end in range(10, max(per_step) + 1, 10):
        got = [per_step[s] for s in range(end - 9, end + 1) if s in per_step]
        if got:
            out[end] = np.mean(got, 0)
    return out


def figures(win: dict, evals=None, tps=None) -> dict:
    late = {s: v for s, v in win.items() if s >= 50}
    worst_step = max(late, key=lambda s: late[s].max())
    means = {s: float(v.mean()) for s, v in late.items()}
    return {"worst_layer_from_50": float(late[worst_step].max()), "worst_window": worst_step,
            "windows_above_1": [s for s, v in late.items() if v.max() > 1.0],
            "mean_over_layers_avg_from_50": float(np.mean(list(means.values()))),
            "mean_over_layers_max_from_50": max(means.values()),
            "mean_over_layers_last": means[max(means)], **({"evals": evals} if evals else {}),
            **({"tokens_per_s_median_21_300": tps} if tps else {})}


def live(path):
    rs = rows(path)
    steps = [r for r in rs if isinstance(r.get("max_violation"), list)]
    every = steps[1]["step"] - steps[0]["step"]
    if every == 1:
        win = windows({r["step"]: r["max_violation"] for r in steps})
    else:  # each logged line is already its window's mean
        win = {r["step"]: np.asarray(r["max_violation"]) for r in steps}
    evals = {r["step"]: round(r["eval_loss"], 4) for r in rs if "eval_loss" in r}
    timed = [r["tokens_per_s"] for r in steps if r["step"] > 20 and r["step"] not in evals and "tokens_per_s" in r]
    return figures(win, evals, float(np.median(timed)) if timed else None), win


def main():
    out, wins = {"live": {}, "replay": {}}, {}
    for key, (label, path) in LIVE.items():
        out["live"][key], wins[label] = live(path)
        out["live"][key]["label"] = label
    per_step_live = {r["step"]: float(np.mean(r["max_violation"])) for r in rows(LIVE["live_defaults_every_step"][1])
                     if isinstance(r.get("max_violation"), list)}
    out["live"]["live_defaults_every_step"].update({
        "step191_mean": per_step_live[191],
        "episode_191_201_mean": float(np.mean([per_step_live[s] for s in range(191, 202)])),
        "outside_episode_mean_from_50": float(np.mean([v for s, v in per_step_live.items()
                                                       if s >= 50 and not 191 <= s <= 201]))})
    rep = [r for f in ("replay.jsonl", "replay_b.jsonl") for r in rows(HERE / f)]
    for key in sorted({(r["checkpoint"], r["rate"]) for r in rep}):
        per = {r["step"]: r["max_violation"] for r in rep if (r["checkpoint"], r["rate"]) == key}
        name = f"frozen step-{key[0]} checkpoint, rate {key[1]:g}"
        jkey = f"frozen{key[0]}_rate{key[1]:g}".replace(".", "")
        f = figures(windows(per))
        m = {s: float(np.mean(v)) for s, v in per.items()}
        ep = [m[s] for s in range(191, 202) if s in m]
        rest = [m[s] for s in m if s >= 50 and not 191 <= s <= 201]
        common = [s for s in m if s >= 50 and s in per_step_live]
        f.update({"steps": max(per), "step191_mean": m.get(191), "per_step_mean_from_50": float(np.mean([m[s] for s in m if s >= 50])),
                  "per_step_worst_from_50": float(max(max(v) for s, v in per.items() if s >= 50)),
                  "episode_191_201_mean": float(np.mean(ep)) if ep else None,
                  "outside_episode_mean_from_50": float(np.mean(rest)),
                  "corr_with_live_per_step": float(np.corrcoef([m[s] for s in common],
                                                               [per_step_live[s] for s in common])[0, 1])})
        f["label"] = name
        out["replay"][jkey], wins[name] = f, windows(per)
    # CPU: k3-tiny with k3-small's routing (64 experts, top-8), frozen after 200 steps, replayed
    # at 8, 32 and 128 rows a batch (more documents per batch): steps 11-60
    out["cpu_tiny64"] = {}
    for b in (8, 32, 128):
        v = [np.mean(r["max_violation"]) for r in rows(HERE / f"cpu_tiny64_replay_b{b}.jsonl")][10:]
        out["cpu_tiny64"][f"b{b}"] = {"mean_over_layers_avg": float(np.mean(v)), "per_step_worst_mean": float(np.max(v))}
    (HERE / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    plot(wins)


def plot(wins):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(wins), 1, figsize=(11, 2.3 * len(wins)), sharex=True)
    for ax, (name, win) in zip(np.atleast_1d(axes), wins.items()):
        s = np.array(sorted(win))
        v = np.array([win[k] for k in s]).T
        im = ax.imshow(v, aspect="auto", cmap="magma", vmin=0, vmax=2, interpolation="nearest",
                       extent=(s[0] - 5, s[-1] + 5, v.shape[0] - 0.5, -0.5))
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("MoE layer")
    fig.colorbar(im, ax=axes, label="max_violation, 10-step means (goal: <= 1 from step 50)")
    np.atleast_1d(axes)[-1].set_xlabel("step")
    fig.savefig(HERE / "layers.png", dpi=90)


if __name__ == "__main__":
    main()
