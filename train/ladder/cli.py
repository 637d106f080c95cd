"""k3jax-ladder: the lineage (softmax -> linear -> DeltaNet -> gated DeltaNet -> KDA -> the K3
hybrid), with the papers' baselines (softmax attention with a short conv, full gated MLA),
trained on equal terms and measured on recall, overwrite, language modelling and cost.

    k3jax-ladder --size cpu  --out runs/ladder-cpu      # MQAR recall + overwrite on a CPU
    k3jax-ladder --size h200 --out $OUT/lm --stop-after 480      # language modelling on one H200
    k3jax-ladder --size zoology --out $OUT/mqar --stop-after 480 # MQAR at Zoology's setting on a GPU
    k3jax-ladder --size smoke --out /tmp/ladder         # every rung and task, a few steps (CI)

Every rung of a size trains with the same data, steps, batch, sequence length, optimizer and
(matched) parameter count, once per seed (--seeds; the size's own by default), and where the
size says so at several widths and learning rates; see train/ladder/sizes.py. The output
folder gets ladder.json (results, rewritten after every finished run), ladder.md (the tables,
mean and spread over seeds, and the literature's expectations judged on every seed), ladder_*.png
and ladder.log. Run the same command again to resume: finished runs are skipped, and rows
measured with another config of a rung are refused (train/ladder/fingerprint.py); more --seeds
later only add runs. --stop-after S starts no run likely to end past S seconds (a GPU command's
time limit; the same command resumes). --rungs / --tasks pick a subset; --corpus trains the LM
task on your own text (files or globs: .txt/.jsonl/.parquet, or .array_record shards from
k3jax-data) with --tokenizer; --report-only redraws the table and plots from a ladder.json
(one copied back from a GPU); --parallel N trains the rungs in N processes at once (small models
leave a GPU mostly idle) and merges their ledgers; --merge joins ledgers of launches that split
the rungs between them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import shlex
import sys
import time
from pathlib import Path

from k3jax.config import ConfigError
from k3jax.config.schema import replace
from k3jax.local_platform import cpu_unless_accelerator
from train.kernel_tuning import TokamaxLogFilter, quiet_tokamax, untuned_line
from train.ladder import tasks as T
from train.ladder.fingerprint import fingerprint, function_changes, function_dict
from train.ladder.parallel import ALL_DONE, UNFINISHED, launch
from train.ladder.report import FORMAT, OLD_FORMATS, Ledger, read_ledger, write_report
from train.ladder.runs import RECALL_TASKS, Run, best_lrs, model_key, normalized
from train.ladder.sizes import (COST_CONTEXTS, REFERENCE_RUNG, RUNGS, SIZES, TASKS, Size,
                                configs_dir_from, default_configs_dir, match_ffn, rung_config, rung_file, total_params)


def _csv(kind: str, allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {kind} {', '.join(bad) or '(none)'}; "
                                             f"choose from {', '.join(allowed)}")
        return items
    return parse


def _seed_list(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are comma-separated integers, got {text!r}") from None
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"seeds are comma-separated integers >= 0, got {text!r}")
    return seeds


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, got {text!r}")
    return n


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="k3jax-ladder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="cpu")
    p.add_argument("--out", default=None, help="output folder (default runs/ladder-<size>)")
    p.add_argument("--rungs", type=_csv("rung", RUNGS), default=RUNGS, help="comma-separated subset, in ladder order")
    p.add_argument("--tasks", type=_csv("task", TASKS), default=None,
                   help=f"comma-separated subset of {','.join(TASKS)} (default: the size's own)")
    p.add_argument("--corpus", action="append", default=[],
                   help="LM text (file or glob, repeatable); default: the Python standard library's sources")
    p.add_argument("--tokenizer", default="bytes", help="LM tokenizer: bytes, a tokenizer.json or a .model")
    p.add_argument("--configs", default=None, help="folder of the rung configs (default: configs/ladder)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override applied to every rung and task (e.g. model.kda.impl=xla)")
    p.add_argument("--seeds", type=_seed_list, default=None,
                   help="comma-separated seeds (train.seed = data.seed), e.g. 0,1,2 (default: the size's)")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="start no run likely to end past this many seconds from launch; resume with the same command")
    p.add_argument("--fresh", action="store_true", help="discard ladder.json in --out instead of resuming it")
    p.add_argument("--parallel", type=_positive, default=1, metavar="N",
                   help="train the rungs in N processes at once on this machine (small models leave a GPU mostly "
                        "idle), their ledgers merged into --out at the end (train/ladder/parallel.py)")
    p.add_argument("--shared-device", type=_positive, default=1, help=argparse.SUPPRESS)  # set by --parallel
    p.add_argument("--merge", nargs="+", default=None, metavar="LADDER_JSON",
                   help="train nothing: merge these ladder.json files (launches that split the rungs between "
                        "them, e.g. processes sharing one GPU) and --out's own into --out, rung by rung")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: redraw ladder.md and the plots from --out's ladder.json (e.g. one "
                        "copied back from a GPU machine)")
    return p.parse_args(argv)


# -------------------------------------------------------------------------------------------
# per-task configs


# The table and ladder.json are rewritten after every task; the plots (a second or two each
# time) after a rung once this long has passed since they were last drawn, and at the end.
PLOT_EVERY_S = 60.0


def recall_overrides(size: Size) -> list[str]:
    """One recall model per run, trained on plain and (where the plan has it) overwrite MQAR
    examples in equal token shares (both ask for the latest value of a key; only overwrite ever
    changes it)."""
    rp = size.recall
    if rp.train_mix:  # (pairs, length, token weight) sources: Zoology's easy-to-hard mixture
        sources = [dataclasses.replace(T.mqar_source(p, length, False), weight=float(w)) for p, length, w in rp.train_mix]
    else:
        sources = [T.mqar_source(p, rp.train_length, overwrite) for overwrite in (False, True)[:1 + rp.overwrite]
                   for p in rp.train_pairs]
    text = ", ".join("{type: mqar, weight: %g, mqar_pairs: %d, mqar_queries: %d, mqar_overwrites: %d, mqar_length: %d}"
                     % (s.weight, s.mqar_pairs, s.mqar_queries, s.mqar_overwrites, s.mqar_length) for s in sources)
    return [f"data.sources=[{text}]", f"data.seq_len={rp.train_length}", f"train.batch_size={rp.batch_size}",
            f"train.steps={rp.steps}", "data.eval_fraction=0", f"data.num_workers={rp.num_workers}"]


def lm_overrides(size: Size, corpus: list[str], tokenizer: str) -> list[str]:
    from train.data.tokenizers import load_tokenizer

    lm = size.lm
    if not corpus:
        sources = "[{type: stdlib}]"
    else:
        kind = "arrayrecord" if all(c.endswith(".array_record") for c in corpus) else "text"
        sources = "[{type: %s, paths: %s}]" % (kind, json.dumps(corpus))
    vocab = load_tokenizer(tokenizer).vocab_size
    size_vocab = next((int(o.split("=", 1)[1]) for o in size.model if o.startswith("model.vocab_size=")), 0)
    ov = [f"data.sources={sources}", f"data.tokenizer={tokenizer}", f"data.seq_len={lm.seq_len}",
          f"train.batch_size={lm.batch_size}", f"train.steps={lm.steps}"]
    if lm.shuffle_window is not None:
        ov.append(f"data.shuffle_window={lm.shuffle_window}")
    if vocab > size_vocab:
        ov.append(f"model.vocab_size={-(-vocab // 128) * 128}")
    return ov


def _non_default(plan) -> dict | None:
    """A plan dataclass as a dict without the fields at their default: a field added later at its
    default leaves a resumed ladder.json's settings unchanged."""
    if plan is None:
        return None
    return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
            if f.default is dataclasses.MISSING or getattr(plan, f.name) != f.default}


def settings_of(size: Size, a, configs_dir: Path) -> dict:
    """The size's plan as this launch runs it (report.COMPARED names the parts a resume must share;
    what each rung computes is compared per rung, train/ladder/fingerprint.py)."""
    out = {"size": size.name, "depth": size.depth, "recall": _non_default(size.recall), "lm": _non_default(size.lm),
           "corpus": a.corpus or "stdlib", "tokenizer": a.tokenizer, "overrides": list(a.overrides),
           "configs": ("configs/ladder" if configs_dir.resolve() == default_configs_dir().resolve()
                       else str(configs_dir))}
    if size.widths:
        out["widths"] = [w.d_model for w in size.widths]
    if size.lrs:
        out.update(lrs=list(size.lrs), sweep_seeds=size.sweep_seeds)
    return out


def environment() -> dict:
    import jax

    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", "")
    return {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
            "device": f"{dev.platform} ({kind})" if kind and kind != dev.platform else dev.platform,
            "python": sys.version.split()[0]}


# -------------------------------------------------------------------------------------------


class Log:
    def __init__(self, path: Path):
        self.path = path

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        with open(self.path, "a") as f:
            f.write(text + "\n")


def with_run(cfg, run: Run):
    """The rung's config for one run: its seed (the initial weights and the training data's
    order) and, where the size sweeps it, its learning rate."""
    changes = {"train.seed": run.seed, "data.seed": run.seed}
    if run.lr is not None:
        changes["optimizer.lr"] = run.lr
    return replace(cfg, **changes)


def _timing(t0: float, cpu0: float, compile_s: float, trained: T.Trained, shared_device: int = 1) -> dict:
    """A run's timing; `shared_device`: how many ladder processes shared the device (--parallel),
    whose speeds are then not the rung's own (the cost table leaves them out)."""
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0, "compile_s": compile_s,
            "train_s": trained.train_s, "tokens_per_s": trained.tokens_per_s,
            "train_loss": [[s, round(v, 4)] for s, v in trained.losses],
            **({"shared_device": shared_device} if shared_device > 1 else {})}


def run_recall(size, run: Run, tasks, cfg, programs, log, shared_device: int = 1) -> tuple[dict, dict]:
    """Train one recall model, then evaluate it on each task's grid: {task: rows}, timing."""
    rp = size.recall
    t0, cpu0, compile0 = time.perf_counter(), time.process_time(), programs.compile_s
    trained = T.train(cfg, programs, log=log)
    params = total_params(cfg.model)
    ident = {"rung": run.rung, "seed": run.seed, "d_model": cfg.model.d_model, "lr": cfg.optimizer.lr}
    out = {}
    for task in tasks:
        overwrite = task == "mqar_overwrite"
        rows = []
        for length in rp.eval_lengths:
            for pairs in rp.eval_pairs:
                if not T.cell_fits(pairs, length, overwrite):
                    continue
                cell = T.mqar_cell(cfg, pairs=pairs, length=length, overwrite=overwrite,
                                   batch_size=min(rp.eval_examples, 64))
                acc = T.mqar_accuracy(trained, programs, cell, rp.eval_examples)
                rows.append({**ident, "task": task, "pairs": pairs, "seq_len": length, "accuracy": acc,
                             "params": params, "steps": trained.steps})
        log(f"  {run.key(task)}: " + ", ".join(f"{r['pairs']}@{r['seq_len']} {r['accuracy']:.3f}" for r in rows))
        out[task] = rows
    return out, _timing(t0, cpu0, programs.compile_s - compile0, trained, shared_device)


def run_lm(size, run: Run, cfg, programs, log, shared_device: int = 1) -> tuple[list[dict], dict]:
    lm = size.lm
    t0, cpu0, compile0 = time.perf_counter(), time.process_time(), programs.compile_s
    evaluate, data = T.lm_evaluator(cfg, programs, lm.eval_batches)
    try:
        trained = T.train(cfg, programs, eval_at=T.eval_steps(lm.steps, lm.evals), on_eval=evaluate, log=log)
    finally:
        data.close()
    params = total_params(cfg.model)
    rows = [{"rung": run.rung, "task": "lm", "seed": run.seed, "step": step, "tokens": tokens, "eval_loss": loss,
             "params": params} for step, tokens, loss in trained.curve]
    log(f"  {run.key('lm')}: " + ", ".join(f"{r['tokens']:,} tokens {r['eval_loss']:.4f}" for r in rows))
    return rows, _timing(t0, cpu0, programs.compile_s - compile0, trained, shared_device)


def decode_state_bytes(model_cfg, context: int) -> int:
    """Bytes per sequence of the model's mixer caches at `context` tokens (the segment ids and
    positions every cache keeps left out)."""
    from k3jax.model_sizes import abstract_model
    from k3jax.model_sizes import decode_state_bytes as by_kind

    return sum(v for k, v in by_kind(abstract_model(model_cfg), context).items() if k != "positions")


def cost_row(rung: str, ledger: Ledger, model_cfg) -> tuple[dict, dict]:
    """Training throughput of the rung in this size (the mean over its LM runs, else over its
    recall runs: at the widest width), and the decode state at COST_CONTEXTS of `model_cfg`."""
    rates = {}
    for key, v in ledger.data["timing"].items():
        parts = key.split("/")
        if v.get("shared_device", 1) > 1:  # measured beside other ladder processes: not the rung's speed
            continue
        if parts[0] == rung and parts[1] in ("lm", RECALL_TASKS[0]) and math.isfinite(v.get("tokens_per_s", math.nan)):
            rates.setdefault("lm" if parts[1] == "lm" else "recall", {}).setdefault(parts[2] if len(parts) > 3 else "",
                                                                                    []).append(v["tokens_per_s"])
    kind = "lm" if "lm" in rates else "recall" if "recall" in rates else None
    tok_s = None
    if kind:  # recall keys name the width (d128): the widest, as the decode state below
        by_width = rates[kind]
        widest = max(by_width, key=lambda w: int(w[1:]) if w.startswith("d") and w[1:].isdigit() else 0)
        tok_s = sum(by_width[widest]) / len(by_width[widest])
    states = [decode_state_bytes(model_cfg, ctx) for ctx in COST_CONTEXTS]
    row = {"rung": rung, "task": "cost", "tokens_per_s": tok_s, "state_bytes_4k": states[0],
           "state_bytes_128k": states[1]}
    return row, {"from": kind}


def report_only(out: Path) -> int:
    data = read_ledger(out / "ladder.json", formats=(FORMAT, *OLD_FORMATS),
                       hint=" (run k3jax-ladder with this --out first, or copy one here)")
    print("wrote " + ", ".join(str(p) for p in write_report(data, out)))
    return 0


def _check_overrides(size: Size, overrides) -> None:
    keys = {o.split("=", 1)[0].strip().lstrip("-") for o in overrides}
    for key in ("train.seed", "data.seed"):
        if key in keys:
            raise ConfigError("the seeds are the ladder's own (train.seed = data.seed = each of --seeds); "
                              "pass --seeds instead", f"--set {key}")
    if size.lrs and "optimizer.lr" in keys:
        raise ConfigError(f"the {size.name} size sweeps the learning rate ({', '.join(map(str, size.lrs))})",
                          "--set optimizer.lr")


class Budget:
    """--stop-after: start no run that would likely end past it (each command of a GPU plan stays
    inside its time limit; the same command again resumes). A run's likely length is the longest
    of its rung and kind in this launch, else NEW_RUNG_MARGIN x the longest of its kind in
    ladder.json (compiles included; the rungs differ in speed by up to 2x). The first run of a
    launch always starts."""

    NEW_RUNG_MARGIN = 1.5

    def __init__(self, seconds: float | None, ledger: Ledger):
        self.seconds, self.ledger, self.t0 = seconds, ledger, time.perf_counter()
        self.last: dict[tuple[str, str], float] = {}
        self.started = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def estimate(self, rung: str, kind: str) -> float:
        if (rung, kind) in self.last:
            return self.last[rung, kind]
        first = ("lm",) if kind == "lm" else RECALL_TASKS
        walls = [v["wall_s"] for k, v in self.ledger.data["timing"].items()
                 if "wall_s" in v and k.split("/")[1] in first]
        return self.NEW_RUNG_MARGIN * max(walls, default=0.0)

    def allows(self, rung: str, kind: str) -> bool:
        if self.seconds is None or not self.started:
            return True
        return self.elapsed() + self.estimate(rung, kind) <= self.seconds

    def ran(self, rung: str, kind: str, wall_s: float) -> None:
        self.started = True
        self.last[rung, kind] = max(wall_s, self.last.get((rung, kind), 0.0))


def runs_of(size: Size, rung: str, kind: str, width, seeds, ledger: Ledger, d_model: int):
    """The runs of one rung, width (of `d_model`) and kind, in order: the learning-rate sweep
    (each rate's seeds in a row, so they share one compiled program), then the seeds after the
    sweep at the best rate found (chosen when they are reached, from ladder.json's rows)."""
    d = width.d_model if width else None
    if not (size.lrs and kind == "recall"):
        for seed in seeds:
            yield Run(rung, kind, seed, d)
        return
    sweep = seeds[:size.sweep_seeds] if size.sweep_seeds else seeds
    for lr in size.lrs:
        for seed in sweep:
            yield Run(rung, kind, seed, d, lr)
    later = [s for s in seeds if s not in sweep]
    if later:
        rows = [r for r in normalized(ledger.data["rows"]) if r["rung"] == rung]
        best = best_lrs(rows, size.recall.train_length).get((rung, d_model))
        for seed in later if best is not None else ():
            yield Run(rung, kind, seed, d, best)


def unfinished(size: Size, rungs, kinds: dict, tasks, seeds, ledger: Ledger, configs_of) -> list[str]:
    """The rungs with a run (or cost row) still to do (a seed after an unfinished sweep counts)."""
    left = []
    for rung in rungs:
        todo = "cost" in tasks and not ledger.done(f"{rung}/cost")
        for width in size.width_list():
            for kind, kind_tasks in kinds.items():
                d_model = configs_of(rung, width)[kind].model.d_model
                runs = list(runs_of(size, rung, kind, width, seeds, ledger, d_model))
                todo |= len(runs) < size.runs_per_width(kind, seeds) or any(not ledger.done(r.key(t)) for r in runs for t in kind_tasks)
        if todo:
            left.append(rung)
    return left


def measured(ledger: Ledger, rung: str, d: int | None, kind: str) -> bool:
    """Whether ladder.json holds finished runs of this rung, width and kind."""
    for key in ledger.data["done"]:
        parts = key.split("/")
        task_kind = "recall" if parts[1] in RECALL_TASKS else parts[1]
        if parts[0] == rung and task_kind == kind and (d is None or f"d{d}" in parts):
            return True
    return False


def run(a) -> int:
    if a.parallel > 1 and (a.merge or a.report_only):
        raise ConfigError("--parallel trains; --merge and --report-only train nothing: pass one of them", "--parallel")
    if a.merge:
        from train.ladder.merge import merge_into

        merge_into(Path(a.out or f"runs/ladder-{a.size}"), a.merge)
        return 0
    if a.report_only:
        return report_only(Path(a.out or f"runs/ladder-{a.size}"))
    size = SIZES[a.size]
    tasks = a.tasks or size.tasks
    for t in tasks:
        if size.plan(t) is None and t != "cost":
            raise ConfigError(f"the {size.name} size has no {t} plan; its tasks are {','.join(size.tasks)}", "--tasks")
    if "mqar_overwrite" in tasks and not size.recall.overwrite:
        raise ConfigError(f"the {size.name} size trains on plain MQAR only (Zoology's); it has no overwrite task",
                          "--tasks")
    _check_overrides(size, a.overrides)
    tasks = [t for t in TASKS if t in tasks]
    rungs = [r for r in RUNGS if r in a.rungs]
    seeds = list(dict.fromkeys(a.seeds if a.seeds is not None else size.seeds))
    kinds = {"recall": [t for t in tasks if t in RECALL_TASKS], "lm": [t for t in tasks if t == "lm"]}
    kinds = {k: v for k, v in kinds.items() if v}
    configs_dir = configs_dir_from(a.configs)
    out = Path(a.out or f"runs/ladder-{size.name}")
    if a.parallel > 1:
        return launch(a, size, rungs, tasks, seeds, out)
    ledger = Ledger(out, settings_of(size, a, configs_dir), fresh=a.fresh)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "ladder.log")
    log(f"k3jax-ladder: size {size.name} ({size.about}); rungs {','.join(rungs)}; tasks {','.join(tasks)}; "
        f"seeds {','.join(map(str, seeds))}; results in {out}")

    extra = tuple(a.overrides)
    need = tuple(dict.fromkeys((*rungs, REFERENCE_RUNG)))
    matched = {}
    for width in size.width_list():
        m = match_ffn(size, configs_dir, extra, rungs=need, width=width)
        ref = m[REFERENCE_RUNG][1]
        log(f"parameters{f' at d_model {width.d_model}' if width else ''} (matched to kda through the FFN width): "
            + ", ".join(f"{r} {m[r][1]:,} ({100 * (m[r][1] / ref - 1):+.1f}%)" for r in rungs))
        matched.update({(r, width): v for r, v in m.items()})

    def configs_of(rung, width) -> dict:
        ffn = matched[rung, width][0]
        out = {"any": rung_config(size, rung, configs_dir, extra=extra, ffn_hidden=ffn, width=width)}
        if "recall" in kinds:
            out["recall"] = rung_config(size, rung, configs_dir, recall_overrides(size), extra, ffn_hidden=ffn,
                                        width=width)
        if "lm" in kinds:
            out["lm"] = rung_config(size, rung, configs_dir, lm_overrides(size, a.corpus, a.tokenizer), extra,
                                    ffn_hidden=ffn, width=width)
        return out

    # rows measured with another function of a rung are never mixed with new ones
    for rung in rungs:
        for width in size.width_list():
            d = width.d_model if width else None
            key = model_key(rung, d)
            cfgs = configs_of(rung, width)
            info = ledger.data["rungs"].get(key, {})
            for kind in kinds:
                stored = info.get("function", {}).get(kind)
                if stored is None or not measured(ledger, rung, d, kind):
                    continue
                changes = function_changes(stored, cfgs[kind])
                if changes:
                    what = "; ".join(f"{k}: {x!r} -> {y!r}" for k, x, y in changes[:3])
                    raise ConfigError(f"the {key} rung's finished {kind} runs here were measured with another config "
                                      f"({what}{'; ...' if len(changes) > 3 else ''}: its file, "
                                      f"{rung_file(rung, configs_dir)}, one it includes, the size or --set changed); "
                                      "resuming would mix them. Use another --out, or --fresh to start over",
                                      str(ledger.path))
            ffn, params = matched[rung, width]
            info = {"rung": rung, **({"d_model": d} if d is not None else {}), "ffn_hidden": ffn, "params": params,
                    "layer_pattern": cfgs["any"].model.layer_pattern,
                    "fingerprint": {**info.get("fingerprint", {}),
                                    **{k: fingerprint(function_dict(cfgs[k])) for k in kinds}},
                    "function": {**info.get("function", {}), **{k: function_dict(cfgs[k]) for k in kinds}}}
            ledger.data["rungs"][key] = info
    ledger.save()

    budget = Budget(a.stop_after, ledger)
    plotted, stopped, measured_any = time.perf_counter(), False, False
    for rung in rungs:
        if stopped:
            break
        programs = T.Programs()  # compiled steps live as long as one rung (all its widths, rates and seeds)
        for width in size.width_list():
            cfgs = configs_of(rung, width)
            for kind, kind_tasks in kinds.items():
                for r in runs_of(size, rung, kind, width, seeds, ledger, cfgs[kind].model.d_model):
                    left = [t for t in kind_tasks if not ledger.done(r.key(t))]
                    if not left:
                        continue
                    if not budget.allows(rung, kind):
                        stopped = True
                        break
                    if not measured_any:  # a launch that measures something
                        measured_any = True
                        ledger.data["environment"] = environment()
                        command = "k3jax-ladder " + " ".join(shlex.quote(x) for x in a.argv)
                        if command not in ledger.data.setdefault("commands", []):
                            ledger.data["commands"].append(command)
                    log(f"{r.key('lm' if kind == 'lm' else 'recall')}: training")
                    cfg = with_run(cfgs[kind], r)
                    if kind == "recall":
                        by_task, timing = run_recall(size, r, left, cfg, programs, log, a.shared_device)
                        for task, rows in by_task.items():
                            ledger.finish(r.key(task), rows, timing)
                    else:
                        rows, timing = run_lm(size, r, cfg, programs, log, a.shared_device)
                        ledger.finish(r.key("lm"), rows, timing)
                    budget.ran(rung, kind, timing["wall_s"])
                    write_report(ledger.data, out, plots=False)
                if stopped:
                    break
            if stopped:
                break
        if "cost" in tasks and not ledger.done(f"{rung}/cost") and not stopped:
            widest = size.width_list()[-1]
            cfgs = configs_of(rung, widest)
            row, timing = cost_row(rung, ledger, cfgs.get("lm", cfgs.get("recall", cfgs["any"])).model)
            ledger.finish(f"{rung}/cost", [row], timing)
            write_report(ledger.data, out, plots=False)
        if rung != rungs[-1] and time.perf_counter() - plotted > PLOT_EVERY_S:
            write_report(ledger.data, out)
            plotted = time.perf_counter()
    paths = write_report(ledger.data, out)
    log("wrote " + ", ".join(str(p) for p in [ledger.path, *paths]))
    if stopped:
        log(f"stopped after {budget.elapsed():.0f} s: the next run would likely end past --stop-after "
            f"{a.stop_after:.0f} s. Run the same command again (with this ladder.json in --out) to resume.")
    left = unfinished(size, rungs, kinds, tasks, seeds, ledger, configs_of)
    log(f"{UNFINISHED}: {', '.join(left)}" if left else ALL_DONE)
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else list(argv)
    cpu_unless_accelerator()  # no GPU or TPU here: keep JAX's plugins from probing (k3jax/local_platform.py)
    # tokamax logs a ~1,000-character absl warning per kernel shape without a tuned config for
    # this GPU (every shape on an H200); the ladder reports their count once, as `train` does
    log_filter = TokamaxLogFilter()
    try:
        with quiet_tokamax(log_filter):
            return run(a)
    except ConfigError as e:
        print(f"k3jax-ladder: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"k3jax-ladder: {e}", file=sys.stderr)
        return 3
    finally:
        if log_filter.missed():  # kernels ran, so JAX is imported and its backend up
            import jax

            print(f"k3jax-ladder: {untuned_line(log_filter, jax.devices()[0].device_kind)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
