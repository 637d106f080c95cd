"""Checkpoint interchange with the Hugging Face layout (safetensors, K3 release names).

    k3jax-export RUN_DIR [--step N] --out DIR [--mxfp4]      (export.py)
    k3jax-import HF_DIR --config CONFIG --out RUN_DIR        (import_.py)

names.py      the release's tensor names / layouts and where each lives in a k3jax model
mxfp4_pack.py routed experts as compressed-tensors mxfp4-pack-quantized
hf_config.py  config.json of an export
foreign.py    Kimi Linear and fla KDAForCausalLM: config mapping and tensor names
rundir.py     weights in a run directory (checkpoints/ or imported/), `load_model` for decoding
"""

from k3jax.interchange.rundir import InterchangeError, load_model, load_run_weights

__all__ = ["InterchangeError", "load_model", "load_run_weights"]
