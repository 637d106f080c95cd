"""k3jax-train: launch, watch, stop and resume a pretraining run.

    k3jax-train --config configs/k3-tiny.yaml [key.sub=value ...]
    python -m train --config ...            (the same)

A run_dir that already holds checkpoints is resumed from the newest one that restores, with
its data iterator, QB biases and RNG: the losses continue exactly as if it had never stopped.
A damaged newest checkpoint is moved aside with a warning (train/resume.py). One launch owns a
run_dir at a time (train/run_lock.py): a second is refused with exit 2.
SIGTERM / SIGINT save a checkpoint and exit (preemption); a second one stops at once, exit 130.
Every failure ends in one line on stderr: exit 2 for a config error or a refusal, 3 for a loss
that is not finite, 130 for an interrupt.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from k3jax.config import ConfigError, dump_config, load_config
from k3jax.config.schema import replace
from k3jax.flops import mfu_from_flops, train_flops_per_token
from k3jax.model_sizes import param_counts
from k3jax.kernel_paths import kernel_lines
from k3jax.local_platform import cpu_unless_accelerator
from k3jax.sharding import make_mesh
from train import distributed
from train.balance_watch import CollapseWatch
from train.checkpoint import Checkpointer
from train.compile_cache import enable_compile_cache
from train.data.sharded import ShardedData
from train.evaluation import EvalSet
from train.interchange.rundir import imported_model_config, load_imported
from train.kernel_tuning import KernelTuner
from train.log_window import PEAK_STEPS, LogWindow
from train.metrics import RunLogger, constant_metrics, guess_peak_tflops, peak_device_gib
from train.optimizer import partition_summary
from train.resume import restore_newest
from train.run_lock import hold_run_dir
from train.setup import compile_steps, prepare
from train.state import init_train_state, train_state_from_weights
from train.step import BATCH_KEYS
from train.timing import TrainClock, launch_time
from train.xla_flags import set_gpu_xla_flags

EXIT_CONFIG, EXIT_NONFINITE, EXIT_INTERRUPTED = 2, 3, 130


class NonFiniteError(RuntimeError):
    pass


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop saves a checkpoint and exits at the next step.

    A second signal ends the process at once (exit 130), after `on_exit_now` (the run
    directory's lock). Not by raising KeyboardInterrupt: it would land wherever the main thread
    is, e.g. inside Orbax's wait for a save, which logs it as a traceback; a save under way is
    left half-written, invisible to the next launch."""

    def __init__(self):
        self.signal = None
        self.on_exit_now: list = []

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal is not None:  # a second signal: stop now
            print(f"k3jax-train: {name} again: stopped now, without a checkpoint; the run resumes from its "
                  f"last complete checkpoint", file=sys.stderr, flush=True)
            for release in self.on_exit_now:
                with contextlib.suppress(Exception):
                    release()
            os._exit(EXIT_INTERRUPTED)
            return
        self.signal = name
        print(f"k3jax-train: {name}: stopping after the next step, with a checkpoint "
              f"(send it again to stop now, without one)", file=sys.stderr, flush=True)


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
        if v.ndim == 1 and k not in PEAK_STEPS.values():  # per MoE layer (a largest step number means nothing)
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
    from k3jax.config import model_changes

    model = imported_model_config(run_dir)
    if model is None:
        return False
    diff = model_changes(model, cfg.model)
    if diff:
        k, a, b = diff[0]
        raise ConfigError(f"the imported weights were written for {k}={a!r}, the config says {b!r}",
                          str(run_dir / "imported" / "model.json"))
    return True


def evals_ahead(start: int, steps: int, every: int) -> int:
    """How many evals a launch from `start` to `steps` runs (one at each multiple of `every`)."""
    return steps // every - start // every if every else 0


def train(cfg, *, stop: _StopFlag | None = None, launched_at: float | None = None) -> dict:
    """Run (or resume) training to cfg.train.steps. Returns the final metrics.
    launched_at: when the launch began, on time.perf_counter's clock (main(): the process's
    start); the start lines count their seconds from it. Default: now.

    The run directory is owned for the whole run (train/run_lock.py: taken before anything in
    it is created or touched, released on every exit), and the checkpoint manager is closed on
    every exit, so none of Orbax's background threads outlives the run."""
    launched_at = time.perf_counter() if launched_at is None else launched_at
    say = print if jax.process_index() == 0 else (lambda text: None)
    with hold_run_dir(Path(cfg.run_dir), say=say) as lock, contextlib.ExitStack() as closing:
        if lock is not None and hasattr(stop, "on_exit_now"):  # a second signal releases it before exiting
            stop.on_exit_now.append(lock.release)
        return _train(cfg, stop=stop, launched_at=launched_at, closing=closing)


def _train(cfg, *, stop, launched_at: float, closing: contextlib.ExitStack) -> dict:
    # Everything that can refuse the config runs before anything is written: a config error
    # leaves no run_dir, config.yaml or checkpoints/ behind (the lock of a run_dir the launch
    # created goes with it).
    run_dir = Path(cfg.run_dir)
    cache_dir = enable_compile_cache(cfg.train.compile_cache_dir)  # before anything compiles
    hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())
    train_data = ShardedData(cfg, split="train", **hosts)
    eval_data = ShardedData(cfg, split="eval", **hosts) if cfg.logging.eval_every else None
    mesh = make_mesh(cfg.mesh)
    check_batch_fits_mesh(cfg, mesh)
    kernels = kernel_lines(cfg.model)  # a kernel asked for where it cannot run is refused here
    setup = prepare(cfg, mesh)
    ckpt = None
    if (run_dir / "checkpoints").is_dir():
        ckpt = closing.enter_context(Checkpointer(run_dir, cfg.checkpoint, owner=True))
    t_state = time.perf_counter()
    # the newest checkpoint that restores (damaged newer ones moved aside), checked against the
    # request (the model, state layout and schedule), or a ConfigError
    resumed = restore_newest(ckpt, cfg, setup) if ckpt is not None else None
    latest = resumed.step if resumed is not None else None
    if resumed is not None:
        cfg = resumed.cfg
    elif cfg.optimizer.decay_steps == 0:
        cfg = replace(cfg, **{"optimizer.decay_steps": cfg.train.steps})  # the run's schedule length, kept on resume
    imported = latest is None and check_imported(run_dir, cfg)  # weights from k3jax-import: start from them
    setup = setup.with_schedule(cfg)

    run_dir.mkdir(parents=True, exist_ok=True)
    if ckpt is None:
        ckpt = closing.enter_context(Checkpointer(run_dir, cfg.checkpoint, owner=True))
    dump_config(cfg, run_dir / "config.yaml")
    shardings, rows = setup.shardings, setup.rows
    with jax.set_mesh(mesh):
        if imported:
            w = load_imported(run_dir, setup, cfg)
            state = train_state_from_weights(cfg, setup.tx, w["params"], w["rest"], shardings=shardings)
        elif latest is None:
            state = init_train_state(cfg, setup.spec, setup.tx, shardings=shardings)
        else:
            state, data_state = resumed.state, resumed.data
            resumed.state = None  # no second reference to the buffers the first step donates
            train_data.set_state(data_state)
        jax.block_until_ready(state)
    state_s = time.perf_counter() - t_state
    eval_set = None
    if eval_data is not None:
        eval_set = EvalSet(eval_data, cfg.logging.eval_batches, lambda b: global_batch(b, rows))
        eval_data.close()

    start = int(state["step"])
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    peak = cfg.logging.peak_tflops or guess_peak_tflops(jax.devices()[0])
    # once, from the spec the run already built, not at each line: counting the parameters
    # without it builds the abstract model again (~1 s for k3-small unrolled), and at every line,
    # with the device idle, that cost ~7 % of k3-small's tokens/s on an H100
    # (benchmarks/results/unrolled-h100-2026-12-07/5-train-beside-bench)
    flops_per_token = (train_flops_per_token(cfg.model, cfg.data.seq_len, param_counts(setup.spec.abstract_model()))
                       if peak else None)
    constant = constant_metrics(cfg, mesh.size)  # the metrics no line logs (the logger's and the window's)
    log = RunLogger(run_dir, cfg.logging, total_steps=cfg.train.steps, start_step=start,
                    enabled=jax.process_index() == 0, launched_at=launched_at,
                    constant=constant)
    how = f"resuming from step {start}" if latest is not None else ("starting from imported weights" if imported
                                                                      else "starting")
    log.message(f"{how}: "
                f"{cfg.train.steps} steps of {tokens_per_step:,} tokens on {mesh.size} "
                f"{jax.devices()[0].platform} device(s), mesh {dict(mesh.shape)}, run_dir={run_dir}")
    made = ("restored from the checkpoint" if latest is not None else "loaded from the imported weights" if imported
            else "initialized")
    log.message(f"train state {made} in {state_s:.1f} s")
    if resumed is not None:  # which step this launch continued from, and the damaged steps it passed
        log.scalars(start, {"resumed_from": start})
        for bad, _, _ in resumed.damaged:
            log.scalars(start, {"damaged_checkpoint": bad})
    log.message(train_data.describe())
    if eval_set is not None:
        log.message(eval_set.describe(cfg.logging.eval_every))
    log.message(partition_summary(cfg.optimizer, setup.spec.params))  # k3jax-info lists it by parameter
    for line in kernels:
        log.message(line)
    step, last_saved, metrics = start, latest, {}
    # train/log_window.py: what a line averages (the metrics no line logs left out of a resumed window)
    window, finite = LogWindow(cfg.logging.every, start, run_dir, constant), None
    balance = CollapseWatch(cfg.logging.collapse_steps, [i for i in range(cfg.model.num_layers)
                                                          if cfg.model.ffn_kind(i) == "moe"])
    eval_fn, pending_eval = None, None
    try:
        # compile before the clock starts: tokens/s never includes it, and the wait is announced;
        # the eval step compiles beside the train step, so the first step waits for one compile
        with_eval = eval_set is not None and evals_ahead(start, cfg.train.steps, cfg.logging.eval_every) > 0
        beside = jax.process_count() == 1  # several processes compile in one order (train/compile_thread.py)
        where = f" (compilation cache: {cache_dir})" if cache_dir is not None else ""
        also = (", and the eval step beside it" if beside else "; the eval step at the first eval") if with_eval else ""
        log.message(f"compiling the train step{also}{where} ...")
        tuner = KernelTuner.for_run(cache_dir, processes=jax.process_count(), say=log.message,
                                    budget_s=cfg.train.autotune_budget_s)
        compiled = compile_steps(cfg, setup, tuner, with_eval=with_eval, eval_in_background=beside)
        step_fn, pending_eval = compiled.train, compiled.eval
        # the whole wait first, then its parts: metrics.jsonl's compile_s is XLA's part alone
        # (lower_s beside it), which this line once printed as if it were the whole
        log.message(f"compiled the train step in {compiled.lower_s + compiled.train_compile_s:.1f} s (traced and "
                    f"lowered in {compiled.lower_s:.1f} s, then XLA's compile {compiled.train_compile_s:.1f} s"
                    f"{f'; kernels tuned in {tuner.tuned_s:.0f} s' if tuner.tuned_s else ''})")
        log.scalars(start, {"compile_s": compiled.train_compile_s, "lower_s": compiled.lower_s}
                    | ({"autotune_s": tuner.tuned_s} if tuner.tuned_s else {}))
        clock, last_line = TrainClock(), [start]  # training time only: eval and checkpoints are set aside

        def check_finite(at: int, finite_at, m_at) -> None:
            if not bool(jax.device_get(finite_at)):  # never save or continue past a NaN
                last = jax.device_get(m_at)
                raise NonFiniteError(
                    f"loss or gradients are not finite at or before step {at} (loss={float(last['loss'])}, "
                    f"grad_norm={float(last['grad_norm'])}); stopping. The last good checkpoint "
                    f"(step {last_saved}) is kept in {ckpt.directory}")

        def log_line(at: int, snapshot=None) -> dict:
            """The line at step `at`: its window's means (of `snapshot`, the window as it stood at
            `at`, for a deferred line), the training tokens/s since the last line, MFU, the peak."""
            window_steps, means = window.means(at, snapshot)
            out = _scalar_metrics(means)
            out["window_steps"] = window_steps
            tok_s = (at - last_line[0]) * tokens_per_step / clock.lap()  # the training time since the last line
            last_line[0] = at
            out["tokens_per_s"] = tok_s
            if peak:  # k3jax.flops.mfu: model FLOPs against the chip's dense bf16 peak
                out["mfu"] = mfu_from_flops(flops_per_token, tok_s, peak, mesh.size)
            peak_gib = peak_device_gib(jax.local_devices())
            if peak_gib is not None:  # what a larger batch or a deeper model has left to grow into
                out["peak_gib"] = peak_gib
            launch_s = log.since_launch()  # seconds since launch, until the first step's line
            log.scalars(at, out)
            log.progress(at, out)
            if launch_s is not None:
                log.scalars(at, {"first_step_s": launch_s})
            for line in balance.update(at, window_steps, out):
                log.message(line)
            return out

        # A line at a window's end with nothing else at its step (no eval, save or stop) is logged
        # once the next step is queued: reading the step's metrics waits for that step only, and
        # the line's host work (the means, TensorBoard, metrics.jsonl) runs while the device
        # computes the next step, instead of with the device idle (benchmarks/results/
        # unrolled-h100-2026-12-07/5-train-beside-bench). A NaN is then found one step later; the
        # run stops there as before, with no checkpoint past it.
        deferred = None  # (step, window snapshot, finite flag, metrics) of the line to log next
        clock.start()
        while step < cfg.train.steps:
            with jax.set_mesh(mesh):
                state, m = step_fn(state, global_batch(next(train_data), rows))
            step += 1
            finite = m["finite"] if finite is None else finite & m["finite"]
            m = {k: v for k, v in m.items() if k != "finite"}
            window.add(step, m)
            if deferred is not None:
                at, snapshot, finite_at, m_at = deferred
                deferred = None
                check_finite(at, finite_at, m_at)
                metrics = log_line(at, snapshot)
            stopping = _should_stop(stop, step)
            log_now = step % cfg.logging.every == 0 or step in (start + 1, cfg.train.steps) or stopping
            save_now = step % cfg.checkpoint.every == 0 or step == cfg.train.steps or stopping
            eval_now = eval_set is not None and step % cfg.logging.eval_every == 0
            if log_now and step % cfg.logging.every == 0 and not (save_now or eval_now):
                deferred = (step, window.snapshot(), finite, m)
                window.after_line(step)
                continue
            if log_now or save_now:
                check_finite(step, finite, m)
            if log_now:
                metrics = log_line(step)
                window.after_line(step)
            if eval_now:
                jax.block_until_ready(state)  # the queued steps finish on the training clock
                if eval_fn is None:
                    eval_fn = _eval_step(pending_eval, clock, log, step)
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
        if pending_eval is not None and not pending_eval.done():  # e.g. a run stopped before its first eval
            log.message("waiting for the eval step's compile to end before exiting ...")
            pending_eval.wait()
        ckpt.close()
        log.close()
    return {k: float(np.asarray(v).mean()) for k, v in metrics.items()} | {"step": step}


def _eval_step(pending, clock: TrainClock, log: RunLogger, step: int):
    """The compiled eval step at the first eval: its compile ran beside the train step's (or
    runs now, several processes); the wait, if any, is set aside from the training clock."""
    ran_beside = pending.background
    with clock.aside("eval_compile"):
        eval_fn = pending.result()
    waited = clock.aside_seconds["eval_compile"]
    how = (f"beside the train step; step {step} waited {waited:.1f} s for it" if ran_beside and waited >= 0.1 else
           "beside the train step" if ran_beside else f"at step {step}")
    log.message(f"compiled the eval step in {pending.seconds:.1f} s ({how})")
    log.scalars(step, {"eval_compile_s": pending.seconds})
    return eval_fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="k3jax-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (may name a `base:` file)")
    p.add_argument("overrides", nargs="*", help="key.sub=value, e.g. run_dir=runs/x train.steps=500")
    a = p.parse_intermixed_args(argv)
    launched_at = launch_time()  # the process's start: the start lines count from it
    cpu_unless_accelerator()  # no GPU or TPU here: keep JAX's plugins from probing (k3jax/local_platform.py)
    set_gpu_xla_flags()  # before JAX starts its backend (train/xla_flags.py: collectives overlapped, no duplicated kernels)
    try:
        cfg = load_config(a.config, a.overrides)
        distributed.initialize(cfg.distributed)
        stop = _StopFlag()
        if jax.process_count() == 1:  # several processes: JAX's preemption service owns SIGTERM
            stop.install()
        train(cfg, stop=stop, launched_at=launched_at)
    except ConfigError as e:
        print(f"k3jax-train: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except NonFiniteError as e:
        print(f"k3jax-train: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except KeyboardInterrupt:  # a SIGINT before the handler was installed (or with several processes)
        print("k3jax-train: interrupted; the run resumes from its last complete checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
