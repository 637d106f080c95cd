"""Model weights in a run directory: read them from a training checkpoint, or write and read
the `imported/` weights that `k3jax-import` leaves for `k3jax-train` to start from.

    RUN_DIR/config.yaml          the run's config (as k3jax-train writes it)
    RUN_DIR/imported/model.json  the model config the weights belong to
    RUN_DIR/imported/state/      Orbax PyTree {"params": ..., "rest": ...} (rest = QB router bias)

k3jax-train, finding `imported/` and no checkpoint, starts at step 0 from those weights with a
fresh optimizer state (train/cli.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from k3jax.config import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
    model_changes,
    with_overrides,
)
from k3jax.config.schema import replace
from k3jax.interchange.errors import InterchangeError
from k3jax.local_platform import cpu_unless_accelerator
from k3jax.model_spec import model_spec
from train.checkpoint import Checkpointer, abstract_with_shardings
from train.checkpoint_manifest import manifest_problem
from train.relayout import relayout
from train.resume import RestoreFailed, restore_quietly
from train.setup import prepare, setup_in_layout

IMPORTED = "imported"


def save_imported(run_dir, cfg, params: dict, rest: dict) -> Path:
    """Write `params` / `rest` (arrays, possibly sharded) and the run config into run_dir."""
    run_dir = Path(run_dir).absolute()
    out = run_dir / IMPORTED
    if out.exists() or (run_dir / "checkpoints").exists():
        raise InterchangeError(f"{run_dir} already holds weights ({IMPORTED}/ or checkpoints/); "
                               f"import into a new run directory")
    if jax.process_count() > 1:  # every process has looked before any creates the directory
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("k3jax-import: checked the run directory")
    out.mkdir(parents=True, exist_ok=True)
    # synchronous: the async StandardCheckpointer spends seconds in its background machinery
    ocp.Checkpointer(ocp.StandardCheckpointHandler()).save(out / "state", {"params": params, "rest": rest})
    if jax.process_index() == 0:
        (out / "model.json").write_text(json.dumps(config_to_dict(cfg)["model"], indent=1))
        dump_config(cfg, run_dir / "config.yaml")
    return out


def imported_model_config(run_dir):
    """The ModelConfig the imported weights of run_dir were written for, or None."""
    path = Path(run_dir) / IMPORTED / "model.json"
    if not path.exists():
        return None
    return config_from_dict({"model": json.loads(path.read_text())}, source=str(path)).model


def load_imported(run_dir, setup, cfg) -> dict:
    """{"params", "rest"} of run_dir/imported, restored into the shapes and shardings of `setup`
    (train.setup.StepSetup, prepared from `cfg`). Weights imported under another layer layout
    (`model.scan_layers`) are read in theirs and moved into cfg's (train/relayout.py)."""
    path = Path(run_dir).absolute() / IMPORTED / "state"
    model = imported_model_config(run_dir)
    source = setup if model is None else setup_in_layout(setup, cfg, model)
    part = lambda tree: {k: tree[k] for k in ("params", "rest")}  # noqa: E731
    out = ocp.StandardCheckpointer().restore(path, abstract_with_shardings(part(source.abstract),
                                                                            part(source.shardings)))
    if source is not setup:
        out = relayout(out, model, part(setup.abstract), cfg.model, part(setup.shardings))
    return out


def run_config(run_dir, overrides=()):
    """The config a run directory was written with (config.yaml), with `key=value` overrides."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise InterchangeError(f"{run_dir}: no config.yaml; is this a k3jax run directory?")
    return load_config(path, list(overrides))


def load_run_weights(run_dir, step: int | None = None, overrides=(), mesh=None):
    """(cfg, params, rest) of a run: its checkpoint at `step` (default: the newest), or its
    imported weights when it has no checkpoint. Arrays are sharded as the run trains them
    (cfg.mesh, or `mesh`), never gathered on one host."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir, overrides)
    ckpt_dir = run_dir / "checkpoints"
    if ckpt_dir.is_dir():
        ckpt = Checkpointer(run_dir, cfg.checkpoint)
        try:
            steps = ckpt.manager.all_steps()
            step = ckpt.latest_step() if step is None else step
            if step is None or step not in steps:
                raise InterchangeError(f"{ckpt_dir}: no checkpoint at step {step} (saved steps: {sorted(steps)})")
            damaged = manifest_problem(ckpt.step_dir(step))  # a cheap look before Orbax reads garbage
            if damaged:
                raise InterchangeError(f"{ckpt.step_dir(step)}: its files differ from when it was saved "
                                       f"({damaged}); load another step with --step (saved steps: {sorted(steps)})")
            # the checkpoint's own config (config.yaml may have changed since), with the mesh
            # asked for and the caller's overrides on top: a knob such as model.kda.impl=xla
            # must not be dropped silently (it once made a kernel-vs-XLA check compare the
            # kernel path with itself)
            saved = ckpt.saved_config(step)
            cfg = with_overrides(_with_mesh(saved, cfg), overrides, source=str(ckpt.step_dir(step)))
            setup = prepare(cfg, mesh)
            try:
                state, _ = restore_quietly(ckpt, step, setup, cfg)
            except RestoreFailed as e:  # named in one line, without Orbax's stray tracebacks
                raise InterchangeError(f"{ckpt.step_dir(step)}: it does not restore ({e}); load another step "
                                       f"with --step (saved steps: {sorted(steps)})") from None
        finally:
            ckpt.close()
        return cfg, state["params"], state["rest"]
    if step not in (None, 0):
        raise InterchangeError(f"{run_dir}: no checkpoints/, so no step {step} (imported weights are step 0)")
    model = imported_model_config(run_dir)
    if model is None:
        raise InterchangeError(f"{run_dir}: holds neither checkpoints/ nor {IMPORTED}/")
    diff = model_changes(model, cfg.model)
    if diff:
        raise ConfigError(f"config.yaml's model differs from the imported weights' at {diff[0][0]}",
                          str(run_dir / IMPORTED / "model.json"))
    setup = prepare(cfg, mesh)
    with jax.set_mesh(setup.mesh):
        out = load_imported(run_dir, setup, cfg)
    return cfg, out["params"], out["rest"]


def _with_mesh(saved, requested):
    """The checkpoint's config with the requested mesh (the machine exporting may differ)."""
    return replace(saved, mesh=requested.mesh)


def load_model(run_dir, step: int | None = None, overrides=()):
    """A K3Model holding a run's weights (checkpoint or imported), for `k3jax.decode`."""
    cfg, params, rest = load_run_weights(run_dir, step, overrides)
    return model_spec(cfg.model, cfg.train.seed).model_from(params, rest)


def command_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The argument parser of a command over run directories, its description the module's
    docstring; JAX is kept on the CPU first where this machine has no GPU or TPU."""
    cpu_unless_accelerator()  # before anything touches a device (k3jax/local_platform.py)
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def run_command(prog: str, body) -> int:
    """A command over run directories (k3jax-export, k3jax-import): body() does the work and
    returns the line to print after `prog: `; a ConfigError or InterchangeError is that one line
    on stderr instead, exit status 2."""
    try:
        line = body()
    except (ConfigError, InterchangeError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(f"{prog}: {line}")
    return 0


__all__ = [
    "command_parser",
    "imported_model_config",
    "load_imported",
    "load_model",
    "load_run_weights",
    "run_command",
    "run_config",
    "save_imported",
]
