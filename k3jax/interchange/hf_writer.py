"""A model's weights written as a Hugging Face checkpoint, in the K3 release's layout or a
relative's (`export_weights`; k3jax-export, train/interchange/export.py, reads them from a run).

Writes DIR/model-0000i-of-0000n.safetensors (each with metadata {"format": "pt"}),
DIR/model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map": {name: file}})
and DIR/config.json. Tensor names and layouts: `k3jax.interchange.names`. (The tokenizer files
beside them: `k3jax.interchange.hf_tokenizer`.)

Streaming: the arrays stay sharded on their devices; one tensor at a time is sliced out
(one layer's, or one expert's, part of a stacked parameter), gathered and converted, and a
shard file is written as soon as it reaches the shard size. Host memory stays about one shard.
With several processes every process takes part in the gathers and process 0 writes.

dtypes: bfloat16 (the release's) writes everything in bf16 except A_log, dt_bias, the short
convs and the router's e_score_correction_bias (fp32, as released); float32 writes all in fp32;
auto keeps each tensor's dtype in the run. mxfp4=True writes the routed experts' w1/w2/w3 as
compressed-tensors mxfp4-pack-quantized (`mxfp4_pack`) with the model's qat_scale_rule.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import config_to_dict
from k3jax.interchange.errors import InterchangeError
from k3jax.interchange.foreign import foreign_config_json, foreign_plan
from k3jax.interchange.hf_config import k3_config_json
from k3jax.interchange.mxfp4_pack import pack_mxfp4, quantization_config
from k3jax.interchange.names import Entry, abstract_state, release_plan

BF16 = np.dtype(jnp.bfloat16)  # ml_dtypes' bfloat16, which safetensors' NumPy API reads and writes

DTYPES = {"bfloat16": BF16, "float32": np.float32}


def to_hf(entry: Entry, x: np.ndarray) -> np.ndarray:
    """A k3jax slice (shape entry.inner) in HF layout (shape entry.shape)."""
    if entry.kind == "linear":
        out = x.reshape(x.shape[0], -1).T
    elif entry.kind == "heads_out":
        out = x.reshape(-1, x.shape[-1]).T
    elif entry.kind == "conv":
        out = x.T[:, None, :]
    elif entry.kind == "padded":
        out = np.zeros(entry.shape, x.dtype)
        out[: x.shape[0]] = x
    else:
        out = x.reshape(entry.shape)
    return np.ascontiguousarray(out)


@functools.partial(jax.jit, static_argnums=(2,))
def _take(x, idx, n: int):
    """x[idx[0], ..., idx[n-1]] with traced indices: one compile per leaf shape, not per index."""
    starts = tuple(idx[i] for i in range(n)) + (0,) * (x.ndim - n)
    return jax.lax.dynamic_slice(x, starts, (1,) * n + x.shape[n:]).reshape(x.shape[n:])


def gather(leaf, index: tuple[int, ...]) -> np.ndarray:
    """One entry's slice of a (sharded) leaf on this host."""
    y = _take(leaf, np.asarray(index, np.int32), len(index)) if index else leaf
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(y, tiled=True))
    return np.asarray(jax.device_get(y))


class ShardWriter:
    """Accumulates tensors and writes a safetensors file whenever `max_bytes` is reached."""

    def __init__(self, out: Path, max_bytes: int, write: bool = True):
        self.out, self.max_bytes, self.write = out, max_bytes, write
        self.pending: dict[str, np.ndarray] = {}
        self.size = 0
        self.files: list[list[str]] = []  # tensor names per written file, in order
        self.total = 0

    def add(self, name: str, arr: np.ndarray) -> None:
        if self.pending and self.size + arr.nbytes > self.max_bytes:
            self.flush()
        self.pending[name] = arr
        self.size += arr.nbytes
        self.total += arr.nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.numpy import save_file

        if self.write:
            save_file(self.pending, str(self.out / f"part-{len(self.files):05d}.tmp"), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.size = {}, 0

    def close(self) -> dict:
        """Rename the parts to model-i-of-n and write the index; returns the weight map."""
        self.flush()
        n = len(self.files)
        weight_map = {}
        for i, names in enumerate(self.files):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            if self.write:
                os.replace(self.out / f"part-{i:05d}.tmp", self.out / fname)
            weight_map.update({k: fname for k in names})
        if self.write:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        return weight_map


def export_weights(cfg, params: dict, rest: dict, out, *, mxfp4: bool = False, dtype: str = "bfloat16",
                   shard_bytes: int = 5 << 30, layout: str = "k3", config_extra: dict | None = None) -> dict:
    """Write `params` / `rest` (the run's arrays, possibly sharded) as an HF checkpoint in
    `out`, in the K3 release's layout or (layout="fla_kda" / "kimi_linear") a relative's.
    config_extra: keys added to config.json (e.g. the tokenizer's ids); its "k3jax" entries go
    into the k3jax section, which only the K3 layout has. Returns {"tensors", "files", "bytes"}."""
    out = Path(out)
    plan = release_plan(cfg.model, abstract_state(cfg.model))
    config = k3_config_json(cfg.model, dtype=dtype)
    if layout != "k3":
        if mxfp4:
            raise InterchangeError(f"--mxfp4 writes the K3 release's expert format; not with --layout {layout}")
        config = foreign_config_json(layout, cfg.model)  # or an error naming what it cannot express
        config["torch_dtype"] = "float32" if dtype == "float32" else "bfloat16"
        plan = foreign_plan(layout, plan, config)
    write = jax.process_index() == 0
    if write:
        out.mkdir(parents=True, exist_ok=True)
    groups = {"params": params, "rest": rest}
    writer = ShardWriter(out, shard_bytes, write)
    ignore = []
    for e in plan:
        leaf = groups[e.group]
        for k in e.leaf:
            leaf = leaf[k]
        x = to_hf(e, gather(leaf, e.index))
        if mxfp4 and e.expert:
            packed, scale = pack_mxfp4(x, cfg.model.qat_scale_rule, name=e.name)
            base = e.name[: -len("weight")]
            writer.add(base + "weight_packed", packed)
            writer.add(base + "weight_scale", scale)
            continue
        if e.name.endswith(".weight") and len(e.shape) == 2 and e.name != "model.embed_tokens.weight":
            ignore.append(e.name[: -len(".weight")])  # a linear module left unquantized
        target = x.dtype if dtype == "auto" else (np.float32 if e.keep_fp32 else DTYPES[dtype])
        writer.add(e.name, x.astype(target))
    weight_map = writer.close()
    if write:
        if mxfp4:
            config["quantization_config"] = quantization_config(ignore, cfg.model.qat_scale_rule)
        extra = dict(config_extra or {})
        k3jax_extra = extra.pop("k3jax", {})
        config.update(extra)
        if layout == "k3":
            config["k3jax"] = {"model": config_to_dict(cfg)["model"], **k3jax_extra}
        (out / "config.json").write_text(json.dumps(config, indent=1))
    return {"tensors": len(weight_map), "files": len(writer.files), "bytes": writer.total}
