"""Per-layer max_violation of each run in this folder, one panel per run (layers as rows, steps as
columns): `python plot_layers.py` writes layers.png here."""
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

HERE = Path(__file__).parent
RUNS = [("lease1_before_lr3e-3_linear_hist_metrics.jsonl", "before: lr 3e-3 / 20 warmup, linear-bin histogram"),
        ("lease2_lr3e-3_asinh_hist_metrics.jsonl", "asinh-bin histogram, lr 3e-3 / 20"),
        ("lease2_lr1e-3_w20_asinh_hist_metrics.jsonl", "asinh-bin histogram, lr 1e-3 / 20"),
        ("lease3_lr1e-3_w100_asinh_hist_metrics.jsonl", "after: asinh-bin histogram, lr 1e-3 / 100 warmup")]
fig, axes = plt.subplots(len(RUNS), 1, figsize=(11, 2.6 * len(RUNS)), sharex=True)
for ax, (name, title) in zip(axes, RUNS):
    rows = [json.loads(l) for l in open(HERE / name)]
    rows = [r for r in rows if isinstance(r.get("max_violation"), list)]
    steps = np.array([r["step"] for r in rows])
    viol = np.array([r["max_violation"] for r in rows]).T  # [layers, logged steps]
    im = ax.imshow(viol, aspect="auto", cmap="magma", vmin=0, vmax=7, interpolation="nearest",
                   extent=(steps[0] - 0.5, steps[-1] + 0.5, viol.shape[0] - 0.5, -0.5))
    ax.set_title(title, fontsize=9)
    ax.set_ylabel("MoE layer")
fig.colorbar(im, ax=axes, label="max_violation (7 = one expert in every token's top-8)")
axes[-1].set_xlabel("step")
fig.savefig(HERE / "layers.png", dpi=90)
