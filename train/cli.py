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
from k3jax.config.schema import replace
from k3jax.flops import mfu
from k3jax.interchange.rundir import imported_model_config, load_imported
from k3jax.kernel_paths import kernel_lines
from k3jax.sharding import make_mesh
from train import distributed
from train.checkpoint import Checkpointer, abstract_with_shardings, check_resumable
from train.compile_cache import enable_compile_cache
from train.data.sharded import ShardedData
from train.evaluation import EvalSet
from train.kernel_tuning import KernelTuner
from train.metrics import RunLogger, guess_peak_tflops
from train.optimizer import partition_summary
from train.setup import compile_steps, prepare
from train.state import init_train_state, train_state_from_weights
from train.step import BATCH_KEYS
from train.timing import TrainClock
from train.xla_flags import set_gpu_scheduler_flags

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


def _should_stop(stop, step: int) -> bool:
    """Single process: our SIGTERM/SIGINT flag. Several processes: JAX's preemption service,
    which makes every process stop (and save collectively) at the same step."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        return multihost_utils.reached_preemption_sync_point(step)
    return stop is not None and stop.signal is not None


def _scalar_metrics(m: dict) -> dict:
    """Per-layer arrays keep their values and gain a `_max`; `lr` etc. pass through."""
    out = {}
    for k, v in m.items():
        v = np.asarray(v)
        out[k] = v
        if v.ndim == 1:  # per MoE layer
            out[k + "_max"] = v.max()
    return out


def check_batch_fits_mesh(cfg, mesh) -> None:
    """Every micro-batch must split evenly over the data x fsdp x expert devices."""
    shards = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    rows = cfg.train.batch_size // cfg.train.micro_batches
    if rows % shards:
        raise ConfigError(f"a micro-batch of {rows} rows (train.batch_size / train.micro_batches) does not split "
                          f"over the {shards} data x fsdp x expert devices of mesh {dict(mesh.shape)}",
                          "train.batch_size")


def global_batch(local: dict, sharding) -> dict:
    """This host's rows -> global arrays laid out by `sharding` (rows over data x fsdp x expert)."""
    return {k: jax.make_array_from_process_local_data(sharding, local[k]) for k in BATCH_KEYS}


def check_imported(run_dir: Path, cfg) -> bool:
    """Whether run_dir holds weights written by k3jax-import; a ConfigError if they belong to
    another model than cfg.model."""
    from train.checkpoint import model_changes

    model = imported_model_config(run_dir)
    if model is None:
        return False
    diff = model_changes(model, cfg.model)
    if diff:
        k, a, b = diff[0]
        raise ConfigError(f"the imported weights were written for {k}={a!r}, the config says {b!r}",
                          str(run_dir / "imported" / "model.json"))
    return True


def train(cfg, *, stop: _StopFlag | None = None) -> dict:
    """Run (or resume) training to cfg.train.steps. Returns the final metrics."""
    # Everything that can refuse the config runs before anything is written: a config error
    # leaves no run_dir, config.yaml or checkpoints/ behind.
    run_dir = Path(cfg.run_dir)
    cache_dir = enable_compile_cache(cfg.train.compile_cache_dir)  # before anything compiles
    hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())
    train_data = ShardedData(cfg, split="train", **hosts)
    eval_data = ShardedData(cfg, split="eval", **hosts) if cfg.logging.eval_every else None
    mesh = make_mesh(cfg.mesh)
    check_batch_fits_mesh(cfg, mesh)
    kernels = kernel_lines(cfg.model)  # a kernel asked for where it cannot run is refused here
    setup = prepare(cfg, mesh)
    ckpt = Checkpointer(run_dir, cfg.checkpoint) if (run_dir / "checkpoints").is_dir() else None
    latest = ckpt.latest_step() if ckpt is not None else None
    if latest is not None:  # the checkpoint's model, state layout and schedule, or a ConfigError
        cfg = check_resumable(ckpt, latest, cfg, abstract_state=setup.abstract)
    elif cfg.optimizer.decay_steps == 0:
        cfg = replace(cfg, **{"optimizer.decay_steps": cfg.train.steps})  # the run's schedule length, kept on resume
    imported = latest is None and check_imported(run_dir, cfg)  # weights from k3jax-import: start from them
    setup = setup.with_schedule(cfg)

    run_dir.mkdir(parents=True, exist_ok=True)
    if ckpt is None:
        ckpt = Checkpointer(run_dir, cfg.checkpoint)
    dump_config(cfg, run_dir / "config.yaml")
    shardings, rows = setup.shardings, setup.rows
    with jax.set_mesh(mesh):
        if imported:
            w = load_imported(run_dir, {k: setup.abstract[k] for k in ("params", "rest")},
                              {k: shardings[k] for k in ("params", "rest")})
            state = train_state_from_weights(cfg, setup.tx, w["params"], w["rest"], shardings=shardings)
        elif latest is None:
            state = init_train_state(cfg, setup.spec, setup.tx, shardings=shardings)
        else:
            state, data_state = ckpt.restore(latest, abstract_with_shardings(setup.abstract, shardings))
            train_data.set_state(data_state)
    eval_set = None
    if eval_data is not None:
        eval_set = EvalSet(eval_data, cfg.logging.eval_batches, lambda b: global_batch(b, rows))
        eval_data.close()

    start = int(state["step"])
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    peak = cfg.logging.peak_tflops or guess_peak_tflops(jax.devices()[0])
    log = RunLogger(run_dir, cfg.logging, total_steps=cfg.train.steps, start_step=start,
                    enabled=jax.process_index() == 0)
    how = f"resuming from step {start}" if latest is not None else ("starting from imported weights" if imported
                                                                      else "starting")
    log.message(f"{how}: "
                f"{cfg.train.steps} steps of {tokens_per_step:,} tokens on {mesh.size} "
                f"{jax.devices()[0].platform} device(s), mesh {dict(mesh.shape)}, run_dir={run_dir}")
    log.message(train_data.describe())
    if eval_set is not None:
        log.message(eval_set.describe(cfg.logging.eval_every))
    log.message(partition_summary(cfg.optimizer, setup.spec.params))  # k3jax-info lists it by parameter
    for line in kernels:
        log.message(line)
    step, last_saved, metrics = start, latest, {}
    interval, finite = None, None  # on-device sums over the steps since the last log line
    try:
        # compile before the clock starts: tokens/s never includes it, and the wait is announced
        where = f" (compilation cache: {cache_dir})" if cache_dir is not None else ""
        log.message(f"compiling the train{' and eval steps' if eval_set is not None else ' step'}{where} ...")
        tuner = KernelTuner.for_run(cache_dir, enabled=cfg.train.autotune, processes=jax.process_count(),
                                    say=log.message, budget_s=cfg.train.autotune_budget_s)
        t0 = time.perf_counter()
        step_fn, eval_fn = compile_steps(cfg, setup, tuner, with_eval=eval_set is not None)
        compile_s = time.perf_counter() - t0 - tuner.tuned_s
        log.message(f"compiled in {compile_s:.1f} s")
        log.scalars(start, {"compile_s": compile_s} | ({"autotune_s": tuner.tuned_s} if tuner.tuned_s else {}))
        clock, step_last = TrainClock(), start  # training time only: eval and checkpoints are set aside
        clock.start()
        while step < cfg.train.steps:
            with jax.set_mesh(mesh):
                state, m = step_fn(state, global_batch(next(train_data), rows))
            step += 1
            finite = m["finite"] if finite is None else finite & m["finite"]
            m = {k: v for k, v in m.items() if k != "finite"}
            interval = m if interval is None else jax.tree.map(jnp.add, interval, m)
            stopping = _should_stop(stop, step)
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
                metrics = _scalar_metrics({k: v / (step - step_last) for k, v in jax.device_get(interval).items()})
                tok_s = (step - step_last) * tokens_per_step / clock.lap()  # the interval's training time
                step_last, interval = step, None
                metrics["tokens_per_s"] = tok_s
                if peak:  # k3jax.flops.mfu: model FLOPs against the chip's dense bf16 peak
                    metrics["mfu"] = mfu(cfg.model, cfg.data.seq_len, tok_s, peak, mesh.size)
                log.scalars(step, metrics)
                log.progress(step, metrics)
            if eval_set is not None and step % cfg.logging.eval_every == 0:
                jax.block_until_ready(state)  # the queued steps finish on the training clock
                with clock.aside("eval"), jax.set_mesh(mesh):
                    ev = eval_set.evaluate(eval_fn, state)
                eval_s = clock.aside_seconds["eval"]
                log.scalars(step, ev | {"s": eval_s}, prefix="eval_")
                log.message(f"step {step}: eval loss {ev['loss']:.4f}, accuracy {ev['accuracy']:.3f} "
                            f"({eval_s:.1f} s)")
            if save_now:
                jax.block_until_ready(state)
                with clock.aside("checkpoint"):
                    ckpt.save(step, state, train_data.get_state(), cfg)
                log.scalars(step, {"checkpoint_s": clock.aside_seconds["checkpoint"]})
                last_saved = step
            if stopping:
                log.message(f"{getattr(stop, 'signal', None) or 'preemption'}: saved a checkpoint at step {step}; exiting")
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
    set_gpu_scheduler_flags()  # before JAX starts its backend: overlap collectives on GPUs
    try:
        cfg = load_config(a.config, a.overrides)
        distributed.initialize(cfg.distributed)
        stop = _StopFlag()
        if jax.process_count() == 1:  # several processes: JAX's preemption service owns SIGTERM
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
