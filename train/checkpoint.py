"""Checkpoints: Orbax CheckpointManager over {state, data iterator, config}.

- state: params (fp32 master), optimizer state, step, QB router bias, RNG: one PyTree,
  restored straight into the current run's shardings (another mesh works too).
- data: the grain iterator state (JSON), so the run continues with the next unseen batch.
- config: the resolved run config (JSON), checked against the requested one on resume.

Orbax writes each step into a temporary directory and renames it when complete; only
finalised steps are listed, so a half-written checkpoint (a crash mid-save) is never
restored. Keeps the newest `keep_last` and every `keep_every`-th step.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from k3jax.config import ConfigError, config_from_dict, config_to_dict, diff_configs

ITEMS = ("state", "data", "config")


class Checkpointer:
    def __init__(self, run_dir, ckpt_cfg):
        self.directory = Path(run_dir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=ckpt_cfg.keep_last, keep_period=ckpt_cfg.keep_every or None,
            enable_async_checkpointing=ckpt_cfg.async_save, create=True,
            cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict, cfg) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config_to_dict(cfg))), force=True)

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

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


# model keys that change how the same function is computed, not what it is: a resumed run
# may change them (e.g. more remat, or the blocked expert matmul on GPU after ragged on TPU)
EXECUTION_KEYS = frozenset({"model.remat", "model.kda.chunk_size", "model.moe.ep_dispatch",
                            "model.moe.ep_capacity_factor", "model.moe.grouped_matmul", "model.moe.gmm_block",
                            "model.kda.impl"})


def model_changes(saved_model, requested_model) -> list[tuple[str, object, object]]:
    """Differences that make a checkpoint belong to another model (execution knobs excluded)."""
    return [d for d in diff_configs(saved_model, requested_model, prefix="model.") if d[0] not in EXECUTION_KEYS]


def check_resumable(ckpt: Checkpointer, step: int, cfg) -> None:
    """Refuse a checkpoint written for another model, or one already at/after the target."""
    where = f"{ckpt.directory / str(step)}"
    saved = ckpt.saved_config(step)
    diff = model_changes(saved.model, cfg.model)
    if diff:
        lines = "\n".join(f"  {k}: checkpoint {a!r} -> requested {b!r}" for k, a, b in diff)
        raise ConfigError(f"this checkpoint was written for a different model:\n{lines}\n"
                          f"use another run_dir, or restore the checkpoint's settings", where)
    if step >= cfg.train.steps:
        raise ConfigError(f"checkpoint is at step {step}, already >= train.steps={cfg.train.steps}; "
                          f"nothing to train (raise train.steps to continue)", where)


def abstract_with_shardings(tree, shardings):
    """ShapeDtypeStructs carrying the shardings the restored arrays should have."""
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
