"""k3jax-train: launch, watch, stop and resume a pretraining run.

    k3jax-train --config configs/k3-tiny.yaml [key.sub=value ...]
    python -m train --config ...            (the same)

A run_dir that already holds checkpoints is resumed from the newest one, with its data
iterator, QB biases and RNG: the losses continue exactly as if it had never stopped.
SIGTERM / SIGINT save a checkpoint and exit (preemption).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ConfigError, dump_config, load_config
from k3jax.flops import train_flops_per_token
from train.checkpoint import Checkpointer, abstract_with_shardings, check_resumable
from train.data.pipeline import build_pipeline
from train.metrics import RunLogger, guess_peak_tflops
from train.optimizer import build_optimizer
from train.state import abstract_train_state, init_train_state, model_spec
from train.step import compile_step, make_eval_step, make_train_step

EXIT_CONFIG, EXIT_NONFINITE = 2, 3


class NonFiniteError(RuntimeError):
    pass


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop saves a checkpoint and exits at the next step."""

    def __init__(self):
        self.signal = None

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name


def _scalar_metrics(m: dict) -> dict:
    """Per-layer arrays keep their values and gain a `_max`; `lr` etc. pass through."""
    out = {}
    for k, v in m.items():
        v = np.asarray(v)
        out[k] = v
        if v.ndim == 1:  # per MoE layer
            out[k + "_max"] = v.max()
    return out


def evaluate(eval_fn, state, pipeline, initial_state: dict, batches: int) -> dict:
    """Mean loss / accuracy over the first `batches` eval batches (the same ones every time)."""
    pipeline.set_state(initial_state)
    tot = {"loss_sum": 0.0, "correct": 0.0, "tokens": 0.0}
    for _ in range(batches):
        out = jax.device_get(eval_fn(state, next(pipeline)))
        for k in tot:
            tot[k] += float(out[k])
    n = max(tot["tokens"], 1.0)
    return {"loss": tot["loss_sum"] / n, "accuracy": tot["correct"] / n}


def train(cfg, *, stop: _StopFlag | None = None) -> dict:
    """Run (or resume) training to cfg.train.steps. Returns the final metrics."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(run_dir, cfg.checkpoint)
    latest = ckpt.latest_step()
    if latest is not None:
        check_resumable(ckpt, latest, cfg)
    dump_config(cfg, run_dir / "config.yaml")

    train_data = build_pipeline(cfg, split="train")
    eval_data = build_pipeline(cfg, split="eval") if cfg.logging.eval_every else None
    eval_start = eval_data.get_state() if eval_data is not None else None

    spec = model_spec(cfg.model, cfg.train.seed)
    tx, schedule = build_optimizer(cfg.optimizer, cfg.train.steps, spec.params)
    if latest is None:
        state = init_train_state(cfg, spec, tx)
    else:
        abstract = abstract_with_shardings(abstract_train_state(cfg, spec, tx), None)
        state, data_state = ckpt.restore(latest, abstract)
        train_data.set_state(data_state)
    step_fn = compile_step(make_train_step(cfg, spec, tx, schedule))
    eval_fn = jax.jit(make_eval_step(cfg, spec))

    start = int(state["step"])
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    flops = train_flops_per_token(cfg.model, cfg.data.seq_len)
    peak = cfg.logging.peak_tflops or guess_peak_tflops(jax.devices()[0])
    log = RunLogger(run_dir, cfg.logging, total_steps=cfg.train.steps, start_step=start,
                    enabled=jax.process_index() == 0)
    log.message(f"{'resuming from step ' + str(start) if latest is not None else 'starting'}: "
                f"{cfg.train.steps} steps of {tokens_per_step:,} tokens, run_dir={run_dir}")

    step, last_saved, metrics = start, latest, {}
    t_last, step_last = time.perf_counter(), start
    interval, finite = None, None  # on-device sums over the steps since the last log line
    try:
        while step < cfg.train.steps:
            state, m = step_fn(state, next(train_data))
            step += 1
            finite = m["finite"] if finite is None else finite & m["finite"]
            m = {k: v for k, v in m.items() if k != "finite"}
            interval = m if interval is None else jax.tree.map(jnp.add, interval, m)
            stopping = stop is not None and stop.signal is not None
            log_now = step % cfg.logging.every == 0 or step in (start + 1, cfg.train.steps) or stopping
            save_now = step % cfg.checkpoint.every == 0 or step == cfg.train.steps or stopping
            if log_now or save_now:
                if not bool(jax.device_get(finite)):  # never save or continue past a NaN
                    last = jax.device_get(m)
                    raise NonFiniteError(
                        f"loss or gradients are not finite at or before step {step} (loss={float(last['loss'])}, "
                        f"grad_norm={float(last['grad_norm'])}); stopping. The last good checkpoint "
                        f"(step {last_saved}) is kept in {ckpt.directory}")
            if log_now:
                now = time.perf_counter()
                n_steps = step - step_last
                tok_s = n_steps * tokens_per_step / max(now - t_last, 1e-9)
                metrics = _scalar_metrics({k: v / n_steps for k, v in jax.device_get(interval).items()})
                t_last, step_last, interval = now, step, None
                metrics["tokens_per_s"] = tok_s
                if peak:
                    metrics["mfu"] = flops * tok_s / (peak * 1e12 * jax.device_count())
                log.scalars(step, metrics)
                log.progress(step, float(metrics["loss"]), tok_s)
            if eval_data is not None and step % cfg.logging.eval_every == 0:
                ev = evaluate(eval_fn, state, eval_data, eval_start, cfg.logging.eval_batches)
                log.scalars(step, ev, prefix="eval_")
                log.message(f"step {step}: eval loss {ev['loss']:.4f}, accuracy {ev['accuracy']:.3f}")
                t_last = time.perf_counter()  # keep eval out of tokens/s
            if save_now:
                ckpt.save(step, state, train_data.get_state(), cfg)
                last_saved = step
            if stopping:
                log.message(f"{stop.signal}: saved a checkpoint at step {step}; exiting")
                break
    finally:
        ckpt.close()
        log.close()
    return {k: float(np.asarray(v).mean()) for k, v in metrics.items()} | {"step": step}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="k3jax-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (may name a `base:` file)")
    p.add_argument("overrides", nargs="*", help="key.sub=value, e.g. run_dir=runs/x train.steps=500")
    a = p.parse_args(argv)
    try:
        cfg = load_config(a.config, a.overrides)
        stop = _StopFlag()
        stop.install()
        train(cfg, stop=stop)
    except ConfigError as e:
        print(f"k3jax-train: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except NonFiniteError as e:
        print(f"k3jax-train: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    return 0


if __name__ == "__main__":
    sys.exit(main())
