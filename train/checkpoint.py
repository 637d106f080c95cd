"""Checkpoints: Orbax CheckpointManager over {state, data iterator, config}.

- state: params (fp32 master), optimizer state, step, QB router bias, RNG: one PyTree,
  restored straight into the current run's shardings (another mesh works too).
- data: the grain iterator state (JSON), so the run continues with the next unseen batch.
- config: the resolved run config (JSON), checked against the requested one on resume.

Orbax writes each step into a temporary directory and renames it when complete; only
finalised steps are listed, so a half-written checkpoint (a crash mid-save) is never
restored. Keeps the newest `keep_last` and every `keep_every`-th step. Each completed step
gets an integrity record (train/checkpoint_manifest.py) that a resume checks before restoring;
a damaged step is moved to checkpoints/damaged/, where Orbax no longer lists it
(train/resume.py).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from k3jax.config import ConfigError, config_from_dict, config_to_dict, diff_configs, model_changes
from k3jax.config.schema import replace
from train.checkpoint_manifest import write_manifest
from train.relayout import RelayoutError, relayout, stage_layout

ITEMS = ("state", "data", "config")
DAMAGED = "damaged"  # checkpoints/damaged/<step>-<time>: steps moved aside, kept, never listed


class Checkpointer:
    """owner: this process holds the run directory (train/run_lock.py), so the half-written
    saves a killed run left (*.orbax-checkpoint-tmp) may be removed; a reader (k3jax-export,
    k3jax-generate) leaves them, as they may be a live run's save in progress.
    A context manager: leaving it closes the manager (waiting for a save under way), so no
    background thread of Orbax outlives the run. `close()` may be called more than once."""

    def __init__(self, run_dir, ckpt_cfg, *, owner: bool = False):
        self.directory = Path(run_dir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=ckpt_cfg.keep_last, keep_period=ckpt_cfg.keep_every or None,
            enable_async_checkpointing=ckpt_cfg.async_save, create=True,
            cleanup_tmp_directories=owner)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self._async = ckpt_cfg.async_save
        self._unrecorded = None  # the step saved last, its integrity record not yet written
        self._closed = False

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None:
            self.close()
            return
        try:  # an exception is on its way out: close, and say in one line if that fails too
            self.close()
        except Exception as e:
            print(f"k3jax-train: the checkpoint manager did not close cleanly: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, state, data_state: dict, cfg) -> None:
        if self._unrecorded is not None:  # Orbax's save waits for the previous one anyway
            self.manager.wait_until_finished()
            self._record()
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config_to_dict(cfg))), force=True)
        self._unrecorded = step
        if not self._async:  # finalised (and older steps pruned) on return
            self._record()

    def _record(self) -> None:
        """The integrity record of the last save, once it is complete and while no save or
        pruning runs in the background (process 0 writes it; the files are shared)."""
        step, self._unrecorded = self._unrecorded, None
        if step is not None and jax.process_index() == 0:
            write_manifest(self.step_dir(step))

    def move_aside(self, step: int) -> Path:
        """Move a damaged step to checkpoints/damaged/<step>-<time> (kept, never deleted), out
        of Orbax's listing; the caller reloads the manager's step list (`reload`)."""
        to = self.directory / DAMAGED / f"{step}-{time.strftime('%Y%m%dT%H%M%S')}"
        to.parent.mkdir(exist_ok=True)
        n = 1
        while to.exists():  # the same step moved aside twice within a second
            to, n = to.with_name(f"{step}-{time.strftime('%Y%m%dT%H%M%S')}-{n}"), n + 1
        self.step_dir(step).rename(to)
        return to

    def reload(self) -> None:
        self.manager.reload()

    def saved_config(self, step: int):
        raw = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        return config_from_dict(raw, source=f"{self.directory / str(step)}")

    def restore(self, step: int, abstract_state):
        """abstract_state: a tree of jax.ShapeDtypeStruct (with .sharding) for the current run."""
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return out["state"], out["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()
        self._record()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self.manager.close()


def check_resumable(ckpt: Checkpointer, step: int, cfg, abstract_state=None):
    """Refuse, before anything is restored, a resume that cannot or should not continue the
    checkpoint's run: another model, a train state of another layout (another optimizer,
    gradient clipping switched on or off), a learning rate that would jump, or nothing left
    to train. Returns the config to resume with: the schedule length the run was trained
    with, unless the request sets `optimizer.decay_steps` itself.

    abstract_state: the requested run's train state as ShapeDtypeStructs (train.setup); when
    given, the checkpoint's own layout is derived from its config and compared with it."""
    where = f"{ckpt.directory / str(step)}"
    saved = ckpt.saved_config(step)
    diff = model_changes(saved.model, cfg.model)
    if diff:
        raise ConfigError(f"this checkpoint was written for a different model:\n{_lines(diff)}\n"
                          f"use another run_dir, or restore the checkpoint's settings", where)
    if step >= cfg.train.steps:
        raise ConfigError(f"checkpoint is at step {step}, already >= train.steps={cfg.train.steps}; "
                          f"nothing to train (raise train.steps to continue)", where)
    cfg = resume_schedule(saved, cfg, step, where)
    if abstract_state is not None:
        saved_state = abstract_train_state_of(saved)
        try:  # another layer layout (model.scan_layers) is the same state in other places
            if stage_layout(saved.model) != stage_layout(cfg.model):
                saved_state = relayout(saved_state, saved.model, abstract_state, cfg.model)
            problem = state_layout_difference(saved_state, abstract_state)
        except RelayoutError as e:
            problem = str(e)
        if problem:
            changed = [d for d in diff_configs(saved, cfg) if d[0].startswith(("optimizer.", "train."))]
            raise ConfigError(f"this checkpoint's train state cannot be restored into the requested run's "
                              f"({problem}); settings that differ:\n{_lines(changed)}\n"
                              f"use another run_dir, or restore the checkpoint's settings", where)
    return cfg


def _lines(diff) -> str:
    return "\n".join(f"  {k}: checkpoint {a!r} -> requested {b!r}" for k, a, b in diff) or "  (none)"


def resume_schedule(saved, cfg, step: int, where: str):
    """The requested config with the checkpoint's schedule length filled in (when the request
    leaves `optimizer.decay_steps` at 0), refusing a learning-rate jump at `step` unless
    `optimizer.allow_lr_change` says otherwise."""
    from train.optimizer import lr_schedule  # jnp-only; here to keep this module light

    saved_len = saved.optimizer.decay_steps or saved.train.steps
    if cfg.optimizer.decay_steps == 0:
        cfg = replace(cfg, **{"optimizer.decay_steps": saved_len})
    before = float(lr_schedule(saved.optimizer, saved_len)(step))
    after = float(lr_schedule(cfg.optimizer, cfg.optimizer.decay_steps)(step))
    if not math.isclose(before, after, rel_tol=1e-6, abs_tol=1e-12) and not cfg.optimizer.allow_lr_change:
        changed = [d for d in diff_configs(saved.optimizer, cfg.optimizer, prefix="optimizer.")
                   if d[0] != "optimizer.allow_lr_change"]
        raise ConfigError(f"resuming at step {step} would change the learning rate from {before:.6g} to "
                          f"{after:.6g}; changed:\n{_lines(changed)}\nkeep the run's schedule "
                          f"(optimizer.decay_steps={saved_len}, the default on resume), or pass "
                          f"optimizer.allow_lr_change=true to change it on purpose", where)
    return cfg


def abstract_train_state_of(cfg):
    """The train state a config trains, as ShapeDtypeStructs (nothing is allocated)."""
    from k3jax.model_spec import model_spec
    from train.optimizer import build_optimizer, schedule_steps
    from train.state import abstract_train_state

    spec = model_spec(cfg.model, cfg.train.seed)
    tx, _ = build_optimizer(cfg.optimizer, schedule_steps(cfg), spec.params)
    return abstract_train_state(cfg, spec, tx)


def state_layout_difference(saved, requested) -> str | None:
    """The first way two abstract train states differ in structure, shape or dtype, or None."""
    if jax.tree.structure(saved) != jax.tree.structure(requested):
        a = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(saved)[0]}
        b = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(requested)[0]}
        only = sorted(a - b)[:1] or sorted(b - a)[:1]
        return "the state's structure differs" + (f", e.g. at {only[0]}" if only else "")
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(saved)[0], jax.tree.leaves(requested)):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{jax.tree_util.keystr(path)}: {x.dtype}{list(x.shape)} -> {y.dtype}{list(y.shape)}"
    return None


def abstract_with_shardings(tree, shardings):
    """ShapeDtypeStructs carrying the shardings the restored arrays should have."""
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
