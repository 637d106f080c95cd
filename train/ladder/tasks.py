"""Train one rung on one task with the training machinery (train/setup.py, train/step.py), and
evaluate it: MQAR accuracy on a grid of (pairs, length) cells, held-out LM loss, throughput.

Compiled programs are shared: a train step is compiled once per (model, train, optimizer,
sequence length) and reused by every task and seed that trains that program (recall and
overwrite at one size are the same program on different data; the seed only draws the initial
weights and the data order), and one jitted eval step per model serves every eval length.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import jax

from k3jax.config.schema import DataSourceConfig, replace
from train.cli import global_batch
from train.data.pipeline import build_pipeline
from train.data.sharded import ShardedData
from train.setup import StepSetup, prepare
from train.state import init_train_state

# Steps left out of the throughput figure: the first ones pay for transfers and warm-up.
WARMUP_STEPS = 2


def _program_key(cfg):
    """What a compiled train step depends on: not the seed, the data only through its shape."""
    return cfg.model, dataclasses.replace(cfg.train, seed=0), cfg.optimizer, cfg.mesh, cfg.data.seq_len


@dataclass
class Programs:
    """Compiled train steps and jitted eval steps, shared across rungs' tasks."""

    setups: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)
    evals: dict = field(default_factory=dict)
    initial: dict = field(default_factory=dict)
    compile_s: float = 0.0

    def setup(self, cfg) -> StepSetup:
        key = _program_key(cfg)
        if key not in self.setups:
            self.setups[key] = prepare(cfg)
        return self.setups[key]

    def train_step(self, cfg):
        key = _program_key(cfg)
        if key not in self.steps:
            setup = self.setup(cfg)
            t0 = time.perf_counter()
            with jax.set_mesh(setup.mesh):
                self.steps[key] = setup.train_step(cfg).lower(*setup.abstract_args(cfg)).compile()
            self.compile_s += time.perf_counter() - t0
        return self.steps[key]

    def initial_state(self, cfg) -> dict:
        """A fresh train state (cfg.train.seed): drawn once per program and seed and kept on the
        host, so every task of a rung and seed starts from the same weights."""
        key = (_program_key(cfg), cfg.train.seed)
        setup = self.setup(cfg)
        if key not in self.initial:
            with jax.set_mesh(setup.mesh):
                self.initial[key] = jax.device_get(init_train_state(cfg, setup.spec, setup.tx,
                                                                    shardings=setup.shardings))
        return jax.device_put(self.initial[key], setup.shardings)

    def eval_step(self, cfg):
        """One jitted eval step per model (it retraces per sequence length by itself)."""
        key = (cfg.model, cfg.mesh)
        if key not in self.evals:
            self.evals[key] = self.setup(cfg).eval_step(cfg)
        return self.evals[key]


@dataclass
class Trained:
    state: dict
    setup: StepSetup
    steps: int
    tokens: int  # target tokens trained on (loss_mask), all steps
    tokens_per_s: float  # batch x seq_len per second, compile and evals excluded
    train_s: float
    curve: list = field(default_factory=list)  # [(step, target tokens seen, eval loss)]
    losses: list = field(default_factory=list)  # [(step, training loss)] at every logged step


def train(cfg, programs: Programs, *, eval_at=(), on_eval=None, log=print) -> Trained:
    """cfg.train.steps steps from a fresh init (cfg.train.seed). At each step in `eval_at`,
    `on_eval(state, setup)` -> loss is recorded against the step and the target tokens seen so far.

    Throughput counts batch x seq_len tokens per step (padding included, as k3jax-train does)
    over the steps after the first WARMUP_STEPS, with the evals left out."""
    setup = programs.setup(cfg)
    step_fn = programs.train_step(cfg)
    data = ShardedData(cfg, split="train")
    state = programs.initial_state(cfg)
    steps = cfg.train.steps
    warmup = min(WARMUP_STEPS, steps - 1)
    every = max(steps // 10, 1)
    curve, losses, tokens, m = [], [], 0, None
    timed_s, timed_steps, seg_start, seg_steps = 0.0, 0, None, 0
    t_start = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            if step == warmup + 1:
                jax.block_until_ready(state)
                seg_start, seg_steps = time.perf_counter(), 0
            batch = next(data)
            tokens += int(batch["num_tokens"])
            with jax.set_mesh(setup.mesh):
                state, m = step_fn(state, global_batch(batch, setup.rows))
            seg_steps += seg_start is not None
            if step % every == 0 or step == steps:
                loss = float(m["loss"])
                if not math.isfinite(loss):
                    raise FloatingPointError(f"the training loss is {loss} at step {step}")
                losses.append((step, loss))
                log(f"  step {step}/{steps}: loss {loss:.4f}")
            if step in eval_at and on_eval is not None:
                if seg_start is not None:
                    jax.block_until_ready(state)
                    timed_s, timed_steps = timed_s + time.perf_counter() - seg_start, timed_steps + seg_steps
                curve.append((step, tokens, on_eval(state, setup)))
                if seg_start is not None:
                    seg_start, seg_steps = time.perf_counter(), 0
        if seg_start is not None and seg_steps:
            jax.block_until_ready(state)
            timed_s, timed_steps = timed_s + time.perf_counter() - seg_start, timed_steps + seg_steps
    finally:
        data.close()
    rows_tokens = cfg.train.batch_size * cfg.data.seq_len
    tok_s = timed_steps * rows_tokens / timed_s if timed_s > 0 and timed_steps > 0 else float("nan")
    return Trained(state, setup, steps, tokens, tok_s, time.perf_counter() - t_start, curve, losses)


def evaluate(eval_fn, state, pipeline, initial_state: dict, batches: int, sharding) -> dict:
    """Mean loss / accuracy per target token over the first `batches` batches of `pipeline`
    from `initial_state`: every call reads the same rows (k3jax-train keeps its eval set on the
    devices instead, train/evaluation.py; the ladder evaluates many (pairs, length) cells once
    each, so it streams them)."""
    pipeline.set_state(initial_state)
    tot = {"loss_sum": 0.0, "correct": 0.0, "tokens": 0.0}
    for _ in range(batches):
        out = jax.device_get(eval_fn(state, global_batch(next(pipeline), sharding)))
        for k in tot:
            tot[k] += float(out[k])
    n = max(tot["tokens"], 1.0)
    return {"loss": tot["loss_sum"] / n, "accuracy": tot["correct"] / n}


def mqar_source(pairs: int, length: int, overwrite: bool) -> DataSourceConfig:
    """`pairs` pairs in examples of `length` tokens. Overwrite: pairs // 2 of the keys are
    written twice and asked (once each); plain: every key asked once."""
    r = pairs // 2 if overwrite else 0
    return DataSourceConfig(type="mqar", mqar_pairs=pairs, mqar_queries=r if overwrite else pairs,
                            mqar_overwrites=r, mqar_length=length)


def mqar_cell(cfg, *, pairs: int, length: int, overwrite: bool, batch_size: int):
    """cfg with one MQAR source (mqar_source), one example per row of `length` tokens, read in this
    process (a cell's few batches would not pay for starting data workers)."""
    src = mqar_source(pairs, length, overwrite)
    return replace(cfg, **{"data.sources": (src,), "data.seq_len": length, "train.batch_size": batch_size,
                           "data.eval_fraction": 0.0, "data.num_workers": 0})


def cell_fits(pairs: int, length: int, overwrite: bool) -> bool:
    r = pairs // 2 if overwrite else 0
    return 2 * (pairs + r + (r if overwrite else pairs)) <= length


def mqar_accuracy(trained: Trained, programs: Programs, cell_cfg, examples: int) -> float:
    """Answer accuracy over `examples` held-out examples (MQAR's eval seed) of one cell."""
    eval_fn = programs.eval_step(cell_cfg)
    data = build_pipeline(cell_cfg, split="eval")
    try:
        batches = -(-examples // cell_cfg.train.batch_size)
        with jax.set_mesh(trained.setup.mesh):
            return evaluate(eval_fn, trained.state, data, data.get_state(), batches, trained.setup.rows)["accuracy"]
    finally:
        data.close()


def lm_evaluator(cfg, programs: Programs, batches: int):
    """state, setup -> held-out loss over the first `batches` eval batches (the same each time)."""
    data = build_pipeline(cfg, split="eval", rows=cfg.train.batch_size)
    start = data.get_state()
    eval_fn = programs.eval_step(cfg)

    def run(state, setup):
        with jax.set_mesh(setup.mesh):
            return evaluate(eval_fn, state, data, start, batches, setup.rows)["loss"]

    return run, data


def eval_steps(total: int, points: int) -> list[int]:
    """`points` eval steps spread evenly over a run, the last one at its end."""
    points = max(1, min(points, total))
    return sorted({int(round(total * (i + 1) / points)) for i in range(points)})


__all__ = ["Programs", "Trained", "cell_fits", "eval_steps", "evaluate", "lm_evaluator", "mqar_accuracy", "mqar_cell",
           "mqar_source", "train"]

