"""K3's training recipe at k3-small scale: what MXFP4 QAT, and the whole recipe, cost in loss.

K2 and K3 train with MXFP4/MXFP8 quantization-aware training on the premise that it costs next
to nothing in quality. Three runs of configs/k3-small.yaml on the standard library's sources,
same seed, batch and data order, >= 10 M tokens each, one variant per command (each fits a
10-minute GPU call; k3jax-train runs them, this module names them and collects the results):

    python -m train.ladder.recipe --variant bf16   --out $OUT/recipe   # AdamW, bf16 compute
    python -m train.ladder.recipe --variant qat    --out $OUT/recipe   # + model.qat=mxfp4
    python -m train.ladder.recipe --variant recipe --out $OUT/recipe   # + per-head Muon + QK-Clip
    python -m train.ladder.recipe --report --out DIR   # DIR holding the three: eval_loss.png, recipe.md

Each run trains in a scratch run_dir (its final checkpoint is ~18 GB: deleted once the run ends)
and leaves DIR/<variant>/ with metrics.jsonl, config.yaml and train.log. The report draws the
three eval-loss curves on one plot with k3jax-plot and writes the gaps at the last eval.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from k3jax.config import ConfigError, load_config

CONFIG = "configs/k3-small.yaml"
MIN_TOKENS = 10_000_000
EVAL_EVERY = 20  # eval-loss points: 8 over 160 steps
VARIANTS = {
    "bf16": ("bf16 compute, AdamW (k3-small as configured)", ()),
    "qat": ("+ MXFP4 QAT of the routed experts (model.qat=mxfp4), AdamW", ("model.qat=mxfp4",)),
    # tau = 100, Kimi K2's; whether K3 keeps QK-Clip is unconfirmed (configs: optimizer.qk_clip_tau)
    "recipe": ("+ MXFP4 QAT, per-head Muon and QK-Clip (tau 100): K3's recipe",
               ("model.qat=mxfp4", "optimizer.name=muon", "optimizer.muon_per_head=true", "optimizer.qk_clip_tau=100")),
}
KEPT = ("metrics.jsonl", "config.yaml")


def steps_for(cfg, tokens: int = MIN_TOKENS, every: int = EVAL_EVERY) -> int:
    """The fewest steps (a multiple of `every`) that train on at least `tokens` tokens."""
    per_step = cfg.train.batch_size * cfg.data.seq_len
    return -(-math.ceil(tokens / per_step) // every) * every


def overrides(variant: str, run_dir: Path, steps: int, extra=()) -> list[str]:
    """The same run for every variant but its own switches: seed, data order, batch, steps,
    schedule and evals alike; one checkpoint, at the end (k3jax-train always writes that one).
    `extra` (--set) comes last: a smaller test run may shorten it."""
    return [f"run_dir={run_dir}", f"train.steps={steps}", "train.seed=0", "data.seed=0",
            f"logging.eval_every={EVAL_EVERY}", "logging.tensorboard=false", "logging.progress=false",
            f"checkpoint.every={steps}", "checkpoint.keep_last=1", *VARIANTS[variant][1], *extra]


def train_variant(variant: str, out: Path, config: str, extra=(), scratch: str | None = None) -> int:
    """k3jax-train for one variant (a subprocess, its output streamed and kept in train.log);
    metrics.jsonl and config.yaml into out/<variant>/, the scratch run_dir removed. Returns its rc."""
    base = load_config(config, list(extra))
    steps = base.train.steps if any(o.startswith("train.steps=") for o in extra) else steps_for(base)
    tokens = steps * base.train.batch_size * base.data.seq_len
    dest = Path(out) / variant
    if dest.exists():
        raise ConfigError("holds this variant's results already; use another --out", str(dest))
    dest.mkdir(parents=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"k3jax-recipe-{variant}-", dir=scratch))
    shutil.rmtree(run_dir)  # k3jax-train makes it (an empty one would look like a resume)
    cmd = [sys.executable, "-m", "train", "--config", config, *overrides(variant, run_dir, steps, extra)]
    print(f"recipe {variant}: {VARIANTS[variant][0]}; {steps} steps of {base.train.batch_size} x {base.data.seq_len} "
          f"= {tokens:,} tokens\n  {' '.join(cmd)}", flush=True)
    with open(dest / "train.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
            for name in KEPT:
                if (run_dir / name).is_file():
                    shutil.copy(run_dir / name, dest / name)
            shutil.rmtree(run_dir, ignore_errors=True)
    print(f"recipe {variant}: k3jax-train exited {rc}; results in {dest}", flush=True)
    return rc


def read_runs(out: Path) -> dict[str, list[dict]]:
    from train.plot import read_metrics

    runs = {}
    for v in VARIANTS:
        if (Path(out) / v / "metrics.jsonl").is_file():
            runs[v] = read_metrics(Path(out) / v)
    if "bf16" not in runs:
        raise ConfigError("no bf16/metrics.jsonl: the gaps are measured against the bf16 run", str(out))
    return runs


def summary(runs: dict[str, list[dict]]) -> dict:
    """Per variant: the eval-loss curve, the last eval, the gap to bf16 there (and at every
    common eval step), the last 20 steps' mean training loss, tokens/s, QK-Clip's activity."""
    evals = {v: {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r} for v, rows in runs.items()}
    common = sorted(set.intersection(*(set(e) for e in evals.values())))
    out = {"common_eval_steps": common, "variants": {}}
    for v, rows in runs.items():
        train = [r for r in rows if "loss" in r and "eval_loss" not in r]
        last = max(train, key=lambda r: r["step"])["step"] if train else 0
        tail = [r["loss"] for r in train if r["step"] > last - 20]
        rates = sorted(r["tokens_per_s"] for r in train if "tokens_per_s" in r and r["step"] > 1)
        clip = [r for r in rows if "qk_clipped_heads_max" in r]
        info = {"about": VARIANTS[v][0], "eval_loss": evals[v], "steps": last,
                "train_loss_last20": sum(tail) / len(tail) if tail else None,
                "tokens_per_s_median": rates[len(rates) // 2] if rates else None,
                "gap_to_bf16": {s: evals[v][s] - evals["bf16"][s] for s in common}}
        if clip:
            info["qk_clip"] = {"max_logit": max(r.get("mla_max_logit_max", 0.0) for r in clip),
                               "logged_steps_with_a_clipped_head": sum(r["qk_clipped_heads_max"] > 0 for r in clip),
                               "logged_steps": len(clip)}
        out["variants"][v] = info
    return out


def markdown(s: dict) -> str:
    common = s["common_eval_steps"]
    last = common[-1] if common else None
    lines = ["# K3's recipe at k3-small scale", "",
             "configs/k3-small.yaml on the standard library's sources, seed 0, 16 x 4096 tokens per step, the same "
             "data order; eval loss on the same held-out batches (`python -m train.ladder.recipe`).", "",
             "| variant | what | eval loss at step " + " / ".join(map(str, common)) + f" | gap to bf16 at step {last} "
             "| train loss, last 20 steps | tokens/s (median) |", "|---|---|---|---|---|---|"]
    fmt = lambda x, spec: "—" if x is None else format(x, spec)  # noqa: E731
    for v, info in s["variants"].items():
        curve = " / ".join(fmt(info["eval_loss"].get(st), ".3f") for st in common)
        lines.append(f"| {v} | {info['about']} | {curve} | {fmt(info['gap_to_bf16'].get(last), '+.4f')} | "
                     f"{fmt(info['train_loss_last20'], '.4f')} | {fmt(info['tokens_per_s_median'], ',.0f')} |")
    for v, info in s["variants"].items():
        if "qk_clip" in info:
            q = info["qk_clip"]
            lines += ["", f"QK-Clip ({v}): the largest MLA logit logged was {q['max_logit']:.1f}; "
                      f"{q['logged_steps_with_a_clipped_head']} of {q['logged_steps']} logged steps clipped a head."]
    lines += ["", "One seed per variant: a gap smaller than the run-to-run spread of GPU training (BENCHMARKS.md "
              "section 4c: two launches of one config differ by up to 0.7 at step 10, less later) says only that "
              "the switch costs less than that.", ""]
    return "\n".join(lines)


def report(out: Path) -> int:
    from train.plot import main as plot_main

    runs = read_runs(out)
    s = summary(runs)
    (Path(out) / "recipe.json").write_text(json.dumps(s, indent=1) + "\n")
    (Path(out) / "recipe.md").write_text(markdown(s))
    rc = plot_main([str(Path(out) / v) for v in runs] + ["--metric", "eval_loss", "-o",
                                                          str(Path(out) / "eval_loss.png")])
    print(f"wrote {out}/recipe.md, recipe.json, eval_loss.png")
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.ladder.recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=list(VARIANTS))
    p.add_argument("--report", action="store_true", help="plot and tabulate the variants found in --out")
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--scratch", default=None, help="where the run_dir (and its checkpoint) lives meanwhile")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for this variant (keep the variants alike)")
    a = p.parse_args(argv)
    try:
        if a.report:
            return report(Path(a.out))
        if a.variant is None:
            p.error("pass --variant NAME or --report")
        return train_variant(a.variant, Path(a.out), a.config, tuple(a.overrides), a.scratch)
    except ConfigError as e:
        print(f"recipe: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
