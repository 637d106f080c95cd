"""Checkpoint interchange of run directories (the formats themselves: k3jax/interchange/).

    k3jax-export RUN_DIR [--step N] --out DIR [--mxfp4]      (export.py)
    k3jax-import HF_DIR --config CONFIG --out RUN_DIR        (import_.py)

rundir.py     weights in a run directory (checkpoints/ or imported/), `load_model` for decoding
tokenizer_files.py  the run's tokenizer written beside an export, and read back on import
"""

from train.interchange.rundir import load_model, load_run_weights

__all__ = ["load_model", "load_run_weights"]
