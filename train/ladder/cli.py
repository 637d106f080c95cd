"""k3jax-ladder: the lineage (softmax -> linear -> DeltaNet -> gated DeltaNet -> KDA -> the K3
hybrid) trained on equal terms and measured on recall, overwrite, language modelling and cost.

    k3jax-ladder --size cpu  --out runs/ladder-cpu      # MQAR recall + overwrite on a CPU
    k3jax-ladder --size h200 --out $OUT/ladder          # language modelling on one H200
    k3jax-ladder --size smoke --out /tmp/ladder         # every rung and task, a few steps (CI)

Every rung of a size trains with the same data, steps, batch, sequence length, optimizer,
seed and (matched) parameter count; see train/ladder/sizes.py. The output folder gets
ladder.json (results, rewritten after every finished task), ladder.md (the tables and the
literature's expectations beside them, likewise), ladder_*.png (redrawn as rungs finish) and
ladder.log. Run the same command again to resume: finished rungs' tasks are skipped.
--rungs / --tasks pick a subset; --corpus trains the LM task on your own text (files or globs:
.txt/.jsonl/.parquet, or .array_record shards from k3jax-data) with --tokenizer;
--report-only redraws the table and plots from a ladder.json (one copied back from a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path

from k3jax.config import ConfigError, config_to_dict
from k3jax.local_platform import cpu_unless_accelerator
from train.kernel_tuning import TokamaxLogFilter, miss_summary, quiet_tokamax
from train.ladder import tasks as T
from train.ladder.report import FORMAT, Ledger, write_report
from train.ladder.sizes import (COST_CONTEXTS, REFERENCE_RUNG, RUNGS, SIZES, TASKS, Size, configs_dir_from,
                                default_configs_dir, match_ffn, rung_config, rung_file, total_params)


def _csv(kind: str, allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {kind} {', '.join(bad) or '(none)'}; "
                                             f"choose from {', '.join(allowed)}")
        return items
    return parse


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
    p.add_argument("--fresh", action="store_true", help="discard ladder.json in --out instead of resuming it")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: redraw ladder.md and the plots from --out's ladder.json (e.g. one "
                        "copied back from a GPU machine)")
    return p.parse_args(argv)


# -------------------------------------------------------------------------------------------
# per-task configs


RECALL_TASKS = ("mqar", "mqar_overwrite")
# The table and ladder.json are rewritten after every task; the plots (a second or two each
# time) after a rung once this long has passed since they were last drawn, and at the end.
PLOT_EVERY_S = 60.0


def recall_overrides(size: Size) -> list[str]:
    """One recall model per rung, trained on plain and overwrite MQAR examples in equal token
    shares (both ask for the latest value of a key; only overwrite ever changes it)."""
    rp = size.recall
    sources = [T.mqar_source(p, rp.train_length, overwrite) for overwrite in (False, True) for p in rp.train_pairs]
    text = ", ".join("{type: mqar, mqar_pairs: %d, mqar_queries: %d, mqar_overwrites: %d, mqar_length: %d}"
                     % (s.mqar_pairs, s.mqar_queries, s.mqar_overwrites, s.mqar_length) for s in sources)
    return [f"data.sources=[{text}]", f"data.seq_len={rp.train_length}", f"train.batch_size={rp.batch_size}",
            f"train.steps={rp.steps}", "data.eval_fraction=0"]


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


def fingerprint(cfg) -> str:
    """A hash of a resolved config (the rung files with the size and --set applied): an edit
    to configs/ladder between two launches must not resume into the same table."""
    return hashlib.sha256(json.dumps(config_to_dict(cfg), sort_keys=True).encode()).hexdigest()[:16]


def settings_of(size: Size, a, configs_dir: Path) -> dict:
    """What the rows depend on: a resumed run must have the same."""
    return {"size": size.name, "depth": size.depth, "model": list(size.model), "optimizer": list(size.optimizer),
            "recall": dataclasses.asdict(size.recall) if size.recall else None,
            "lm": dataclasses.asdict(size.lm) if size.lm else None,
            "corpus": a.corpus or "stdlib", "tokenizer": a.tokenizer, "overrides": list(a.overrides),
            "configs": ("configs/ladder" if configs_dir.resolve() == default_configs_dir().resolve()
                        else str(configs_dir))}


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


def run_recall(size, rung, tasks, cfg, programs, log) -> tuple[dict, dict]:
    """Train the rung's recall model, then evaluate it on each task's grid: {task: rows}, timing."""
    rp = size.recall
    t0, cpu0 = time.perf_counter(), time.process_time()
    compile0 = programs.compile_s
    trained = T.train(cfg, programs, log=log)
    params = total_params(cfg.model)
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
                rows.append({"rung": rung, "task": task, "pairs": pairs, "seq_len": length, "accuracy": acc,
                             "params": params, "steps": trained.steps})
        log(f"  {rung} {task}: " + ", ".join(f"{r['pairs']}@{r['seq_len']} {r['accuracy']:.3f}" for r in rows))
        out[task] = rows
    timing = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
              "compile_s": programs.compile_s - compile0,
              "train_s": trained.train_s, "tokens_per_s": trained.tokens_per_s,
              "train_loss": [[s, round(v, 4)] for s, v in trained.losses]}
    return out, timing


def run_lm(size, rung, cfg, programs, log) -> tuple[list[dict], dict]:
    lm = size.lm
    t0, cpu0 = time.perf_counter(), time.process_time()
    compile0 = programs.compile_s
    evaluate, data = T.lm_evaluator(cfg, programs, lm.eval_batches)
    try:
        trained = T.train(cfg, programs, eval_at=T.eval_steps(lm.steps, lm.evals), on_eval=evaluate, log=log)
    finally:
        data.close()
    params = total_params(cfg.model)
    rows = [{"rung": rung, "task": "lm", "tokens": tokens, "eval_loss": loss, "params": params}
            for tokens, loss in trained.curve]
    log(f"  {rung} lm: " + ", ".join(f"{r['tokens']:,} tokens {r['eval_loss']:.4f}" for r in rows))
    timing = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
              "compile_s": programs.compile_s - compile0,
              "train_s": trained.train_s, "tokens_per_s": trained.tokens_per_s,
              "train_loss": [[s, round(v, 4)] for s, v in trained.losses]}
    return rows, timing


def cost_row(rung: str, ledger: Ledger, configs: dict) -> tuple[dict, dict]:
    """Throughput of the rung's LM training (else its recall training) in this size, and its
    decode state at COST_CONTEXTS from the same model."""
    from k3jax.info import abstract_model, decode_state_bytes

    source = next((t for t in ("lm", "mqar", "mqar_overwrite") if f"{rung}/{t}" in ledger.data["timing"]), None)
    tok_s = ledger.data["timing"][f"{rung}/{source}"]["tokens_per_s"] if source else None
    model = abstract_model(configs["lm" if source == "lm" else "recall" if source else "any"].model)
    states = []
    for ctx in COST_CONTEXTS:
        by_kind = decode_state_bytes(model, ctx)
        states.append(sum(v for k, v in by_kind.items() if k != "positions"))
    row = {"rung": rung, "task": "cost", "tokens_per_s": tok_s, "state_bytes_4k": states[0],
           "state_bytes_128k": states[1]}
    return row, {"from": source}


def report_only(out: Path) -> int:
    path = out / "ladder.json"
    if not path.is_file():
        raise ConfigError("no ladder.json here to redraw; run k3jax-ladder with this --out first", str(path))
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"not valid JSON ({e})", str(path)) from None
    if data.get("format") != FORMAT:
        raise ConfigError(f"not a {FORMAT} results file", str(path))
    print("wrote " + ", ".join(str(p) for p in write_report(data, out)))
    return 0


def run(a) -> int:
    if a.report_only:
        return report_only(Path(a.out or f"runs/ladder-{a.size}"))
    size = SIZES[a.size]
    tasks = a.tasks or size.tasks
    for t in tasks:
        if size.plan(t) is None and t != "cost":
            raise ConfigError(f"the {size.name} size has no {t} plan; its tasks are {','.join(size.tasks)}", "--tasks")
    tasks = [t for t in TASKS if t in tasks]
    rungs = [r for r in RUNGS if r in a.rungs]
    configs_dir = configs_dir_from(a.configs)
    out = Path(a.out or f"runs/ladder-{size.name}")
    ledger = Ledger(out, settings_of(size, a, configs_dir), fresh=a.fresh)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "ladder.log")
    if any(not ledger.done(r, t) for r in rungs for t in tasks):  # a launch that measures something
        ledger.data["environment"] = environment()
        command = "k3jax-ladder " + " ".join(shlex.quote(x) for x in a.argv)
        commands = ledger.data.setdefault("commands", [])
        if command not in commands:
            commands.append(command)
    log(f"k3jax-ladder: size {size.name} ({size.about}); rungs {','.join(rungs)}; tasks {','.join(tasks)}; "
        f"results in {out}")

    extra = tuple(a.overrides)
    matched = match_ffn(size, configs_dir, extra, rungs=tuple(dict.fromkeys((*rungs, REFERENCE_RUNG))))
    for rung in rungs:
        ffn, params = matched[rung]
        cfg = rung_config(size, rung, configs_dir, extra=extra, ffn_hidden=ffn)
        before = ledger.data["rungs"].get(rung, {}).get("config")
        if before is not None and before != fingerprint(cfg) and any(ledger.done(rung, t) for t in TASKS):
            raise ConfigError(f"the {rung} rung's finished tasks here were measured with another config (its "
                              f"file, {rung_file(rung, configs_dir)}, or one it includes has changed); resuming "
                              "would mix them. Use another --out, or --fresh to start over", str(ledger.path))
        ledger.data["rungs"][rung] = {"ffn_hidden": ffn, "params": params, "layer_pattern": cfg.model.layer_pattern,
                                      "config": fingerprint(cfg)}
    ledger.save()
    ref = matched[REFERENCE_RUNG][1]
    log("parameters (matched to kda through the FFN width): " + ", ".join(
        f"{r} {matched[r][1]:,} ({100 * (matched[r][1] / ref - 1):+.1f}%)" for r in rungs))

    plotted = time.perf_counter()
    for rung in rungs:
        ffn = matched[rung][0]
        programs = T.Programs()  # compiled steps live as long as one rung
        cfg = {"any": rung_config(size, rung, configs_dir, extra=extra, ffn_hidden=ffn)}
        if size.recall is not None:
            cfg["recall"] = rung_config(size, rung, configs_dir, recall_overrides(size), extra, ffn_hidden=ffn)
        if size.lm is not None:
            cfg["lm"] = rung_config(size, rung, configs_dir, lm_overrides(size, a.corpus, a.tokenizer), extra,
                                    ffn_hidden=ffn)
        for task in tasks:
            if ledger.done(rung, task):
                log(f"{rung} {task}: done before, skipped")
        recall = [t for t in tasks if t in RECALL_TASKS and not ledger.done(rung, t)]
        if recall:
            log(f"{rung} recall ({', '.join(recall)}): training")
            by_task, timing = run_recall(size, rung, recall, cfg["recall"], programs, log)
            for task, rows in by_task.items():
                ledger.finish(rung, task, rows, timing)
            write_report(ledger.data, out, plots=False)
        if "lm" in tasks and not ledger.done(rung, "lm"):
            log(f"{rung} lm: training")
            rows, timing = run_lm(size, rung, cfg["lm"], programs, log)
            ledger.finish(rung, "lm", rows, timing)
            write_report(ledger.data, out, plots=False)
        if "cost" in tasks and not ledger.done(rung, "cost"):
            row, timing = cost_row(rung, ledger, cfg)
            ledger.finish(rung, "cost", [row], timing)
            write_report(ledger.data, out, plots=False)
        if rung != rungs[-1] and time.perf_counter() - plotted > PLOT_EVERY_S:
            write_report(ledger.data, out)
            plotted = time.perf_counter()
    paths = write_report(ledger.data, out)
    log("wrote " + ", ".join(str(p) for p in [ledger.path, *paths]))
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
        if log_filter.missed():
            print(f"k3jax-ladder: tokamax had no tuned config for {miss_summary(log_filter.misses)}: "
                  "its heuristic configs ran (per-shape warnings left out)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
