"""One-off: the table in this folder's README, from the three runs' metrics.jsonl."""
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
for name in ("default_lr3e-3_w20", "lr3e-3_w100", "lr1.5e-3_w50"):
    rows = [json.loads(x) for x in (HERE / f"{name}_metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    worst = max(steps, key=lambda r: max(r["hot_share"]))
    collapsed = [r["step"] for r in steps if max(r["hot_share"]) > 0.5]
    after = [max(r["max_violation"]) for r in steps if r["step"] >= 100]
    ev = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    last10 = sum(r["loss"] for r in steps[-10:]) / 10
    print(f"| {name} | {max(worst['hot_share']):.2f} at step {worst['step']} "
          f"(max_violation {max(worst['max_violation']):.2f}) | {min(collapsed)}-{max(collapsed)} | "
          f"{max(after):.2f} | {ev[100]:.3f} / {ev[200]:.3f} / {ev[300]:.3f} | {last10:.3f} |")
