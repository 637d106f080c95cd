"""Figures of the per-step run here (metrics.jsonl, logged every step) and of the CPU damping
pair -> summary.json. From the repository root:

    python benchmarks/results/qb-steps-2026-12-06/summarize.py
"""
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent


def steps(path):
    return [r for r in map(json.loads, open(path)) if "max_violation" in r]


def windows(mv, width=10):
    """10-step means of the per-step values, as a run logging every 10 steps would write them."""
    return {e: mv[e - width:e].mean(0) for e in range(width, len(mv) + 1, width)}


rows = steps(HERE / "metrics.jsonl")
mv = np.array([r["max_violation"] for r in rows])  # [300, 15]
gn = np.array([r["grad_norm"] for r in rows])
tps = np.array([r["tokens_per_s"] for r in rows])
evals = {r["step"]: r["eval_loss"] for r in map(json.loads, open(HERE / "metrics.jsonl")) if "eval_loss" in r}
win = windows(mv)
from50 = {e: w for e, w in win.items() if e >= 50}
worst_window = max(from50, key=lambda e: from50[e].max())
content = json.load(open(HERE / "batch_content.json"))["rows"]
tv = np.array([np.nan if c["tv_vs_previous"] is None else c["tv_vs_previous"] for c in content])
table = np.array([c["codec_table_share"] for c in content])
layer_mean = mv.mean(1)
sel = np.arange(60, 300)  # steps 61-300: past the warmup transient
out = {
    "per_step": {
        "steps_from_50_with_a_layer_above_1": int((mv[49:].max(1) > 1.0).sum()),
        "worst_from_50": float(mv[49:].max()), "worst_step": int(49 + mv[49:].max(1).argmax() + 1),
        "layer_mean_steps_190_199": [round(float(x), 3) for x in layer_mean[189:199]],
        "layer_mean_step_190": float(layer_mean[189]), "layer_mean_step_191": float(layer_mean[190]),
        "grad_norm_188_195": [round(float(x), 2) for x in gn[187:195]],
    },
    "windows": {
        "worst_from_50": float(from50[worst_window].max()), "worst_window_end": worst_window,
        "windows_from_50_with_a_layer_above_1": int(sum(w.max() > 1.0 for w in from50.values())),
        "window_200_worst": float(win[200].max()),
        "mean_over_layers_from_50": float(np.mean([w.mean() for w in from50.values()])),
        "mean_over_layers_last": float(win[300].mean()),
        "mean_over_layers_lowest_late": float(min(win[e].mean() for e in range(250, 301, 10))),
    },
    "eval_loss": evals,
    "tokens_per_s_median_21_300": float(np.median(tps[20:])),
    "content": {
        "corr_layer_mean_vs_byte_shift": float(np.corrcoef(tv[sel], layer_mean[sel])[0, 1]),
        "corr_layer_mean_vs_codec_table_share": float(np.corrcoef(table[sel], layer_mean[sel])[0, 1]),
    },
}
cpu = {}
for name in ("1.0", "0.3"):
    r = steps(HERE / f"cpu_rate{name}_metrics.jsonl")
    m = {x["step"]: np.asarray(x["max_violation"]) for x in r}
    cpu[name] = {"mean_over_layers_50_100": float(np.mean([m[s].mean() for s in (50, 60, 70, 80, 90, 100)])),
                 "mean_over_layers_150_200": float(np.mean([m[s].mean() for s in (150, 160, 170, 180, 190, 200)]))}
out["cpu_update_rate"] = cpu
json.dump(out, open(HERE / "summary.json", "w"), indent=1)
print(json.dumps(out, indent=1))
