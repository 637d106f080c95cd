"""Resuming from the newest checkpoint that restores: a damaged checkpoint costs only its own
steps.

A run's newest checkpoint may be damaged (a disk that failed, a file overwritten, a copy cut
short). The resume tries the saved steps newest first, each in three looks:
1. its integrity record (train/checkpoint_manifest.py): a file missing, of another size, or a
   small file with another CRC-32 marks it damaged without reading the arrays;
2. its config: one that does not read marks it damaged; one that reads but belongs to another
   model or optimizer layout is a refusal (ConfigError, exit 2: the request, not the disk);
3. the restore itself: any error marks it damaged.
The first step that passes is resumed from. Only then are the damaged newer steps moved aside
(checkpoints/damaged/<step>-<time>, kept, no longer listed by Orbax), each named in one warning
line with its reason; so a failure that strikes every step alike (too little memory for the
state, another machine) moves nothing. When no step restores: NoRestorableCheckpoint (exit 2),
naming each step's reason, with nothing moved.

Several processes: every process looks at the same step; process 0 reads the integrity record
(the files are shared), and a step counts as restored only where it restored on every process.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import jax

from k3jax.config import ConfigError
from train import distributed
from train.checkpoint import Checkpointer, abstract_with_shardings, check_resumable
from train.checkpoint_manifest import manifest_problem
from train.relayout import relayout
from train.setup import setup_in_layout
from train.stderr_capture import StderrCapture, drop_unraisable_from


# Orbax's read coroutines (per array index, per array, and the deserialize over them): a failed
# restore leaves them to report its error again when they are collected, often at exit
ORBAX_READS = ("_read_array_index_and_device_put", "_read_and_create_array", "async_deserialize")


class NoRestorableCheckpoint(ConfigError):
    """Every saved step is damaged (the CLI prints it and exits 2)."""


@dataclass
class Resumed:
    step: int
    cfg: object  # the config to resume with (check_resumable's: the run's schedule length kept)
    state: dict
    data: dict  # the data iterator's state
    damaged: list[tuple[int, str, Path | None]] = field(default_factory=list)  # (step, why, moved to)


def root_cause(e: BaseException, limit: int = 300) -> str:
    """The innermost cause of an error, as "Type: first line" (Orbax wraps TensorStore's)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
    return line if len(line) <= limit else line[:limit] + " ..."


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _agreed(why: str | None) -> str | None:
    """A step is good only where it is good on every process."""
    if distributed.everywhere(why is None):
        return None
    return why or "it failed on another process"


def _looks_intact(ckpt: Checkpointer, step: int) -> str | None:
    """Looks 1 and 2: why the step is damaged, or None."""
    why = manifest_problem(ckpt.step_dir(step)) if jax.process_index() == 0 else None
    why = distributed.broadcast_text(why or "") or None
    if why is not None:
        return f"its files differ from their record: {why}"
    try:
        ckpt.saved_config(step)
    except ConfigError:
        raise  # a config this version cannot read is the user's to resolve, not damage
    except Exception as e:
        return f"its config does not read: {root_cause(e)}"
    return None


class RestoreFailed(Exception):
    """A checkpoint that does not restore; its message is the root cause, "Type: first line"."""


def restore_quietly(ckpt: Checkpointer, step: int, setup, cfg):
    """(state, data) of checkpoint `step`, restored into `setup`'s shardings and ready. A failed
    restore raises RestoreFailed naming its root cause, and the stray tracebacks its unfinished
    reads print are held and dropped (train/stderr_capture.py): the caller names the failure in
    one line. What a good restore prints is passed on. Used by k3jax-train's resume and by
    train.interchange.rundir (k3jax-generate, k3jax-export).

    cfg: the config `setup` was prepared from. When its layer layout differs from the
    checkpoint's (`model.scan_layers`), the state is read in the checkpoint's layout, on the
    same mesh, and moved into `setup`'s (train/relayout.py)."""
    why = None
    saved_model = ckpt.saved_config(step).model
    source = setup_in_layout(setup, cfg, saved_model)
    with StderrCapture() as held:
        try:
            with jax.set_mesh(setup.mesh):
                state, data = ckpt.restore(step, abstract_with_shardings(source.abstract, source.shardings))
                if source is not setup:
                    state = relayout(state, saved_model, setup.abstract, cfg.model, setup.shardings)
                jax.block_until_ready(state)
        except Exception as e:
            why = root_cause(e)
        if why is not None:  # after the except block: nothing holds the error's frames, and with
            # them Orbax's reads, so they finish and print into the held file here, not at exit
            step_dir = ckpt.step_dir(step)  # as the read errors name it: absolute, maybe resolved
            drop_unraisable_from(*ORBAX_READS, mentioning=(
                os.path.abspath(step_dir) + os.sep, str(Path(step_dir).resolve()) + os.sep))
            held.settle()
    if why is not None:
        held.drop()
        raise RestoreFailed(why)
    held.pass_on()
    return state, data


def restore_newest(ckpt: Checkpointer, cfg, setup, *, warn: Callable[[str], None] = _stderr) -> Resumed | None:
    """The newest step of `ckpt` that restores into `setup`'s state (train.setup.StepSetup),
    checked against `cfg` (check_resumable); None when no step was saved."""
    steps = sorted(ckpt.manager.all_steps(), reverse=True)
    failed: list[tuple[int, str]] = []
    for step in steps:
        why = _agreed(_looks_intact(ckpt, step))
        if why is None:
            resume_cfg = check_resumable(ckpt, step, cfg, abstract_state=setup.abstract)
            state = data = None
            try:
                state, data = restore_quietly(ckpt, step, setup, cfg)
            except RestoreFailed as e:
                why = f"it does not restore: {e}"
            why = _agreed(why)
        if why is not None:
            failed.append((step, why))
            continue
        damaged = []
        for bad, bad_why in failed:
            to = ckpt.move_aside(bad) if jax.process_index() == 0 else None
            damaged.append((bad, bad_why, to))
        if failed:
            distributed.barrier("k3jax-train: damaged checkpoints moved aside")
            ckpt.reload()
            for bad, bad_why, to in damaged:
                if to is not None:
                    warn(f"k3jax-train: warning: checkpoint step {bad} is damaged ({bad_why}); moved to {to}; "
                         f"resuming from step {step}")
        return Resumed(step, resume_cfg, state, data, damaged)
    if not failed:
        return None
    reasons = "; ".join(f"step {s}: {w}" for s, w in failed)
    raise NoRestorableCheckpoint(f"no checkpoint restores ({reasons}). Nothing was moved: move the steps "
                                 f"aside to start this run again from step 0, or train in another run_dir",
                                 str(ckpt.directory))
