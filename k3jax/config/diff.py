"""Which differences between two model configs make them different models.

A checkpoint (or imported weights, or an exported release) belongs to one model: resuming,
importing or loading it under a config whose model differs is refused. Execution knobs (`knob`
fields in the schema: remat, kernels, dtypes of the computation, ...) change how the same
function is computed, not what it is, so they may differ.
"""

from __future__ import annotations

from k3jax.config.load import diff_configs
from k3jax.config.schema import ModelConfig, execution_keys

# model keys that change how the same function is computed, not what it is: a resumed run
# may change them (e.g. more remat, or the blocked expert matmul on GPU after ragged on TPU).
# Marked in the schema itself (`knob` fields).
EXECUTION_KEYS = execution_keys(ModelConfig, "model.")


def model_changes(saved_model, requested_model) -> list[tuple[str, object, object]]:
    """Differences that make a checkpoint belong to another model (execution knobs excluded)."""
    return [d for d in diff_configs(saved_model, requested_model, prefix="model.") if d[0] not in EXECUTION_KEYS]
