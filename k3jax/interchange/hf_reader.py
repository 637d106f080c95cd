"""A Hugging Face checkpoint (K3 release layout, Kimi Linear, or fla's KDAForCausalLM) read
into a model's arrays (`import_checkpoint`; k3jax-import, train/interchange/import_.py, writes
them into a run directory).

For the K3 layout the run config's model section must describe the checkpoint; for Kimi
Linear and fla the architecture is read from HF_DIR/config.json and only execution settings
(dtypes, chunk sizes, ...) come from the run config (`k3jax.interchange.foreign`).

Every tensor is checked against the plan before anything is read: a missing, unexpected or
misshapen tensor is an error naming it and its file. Experts may be bf16/fp32 or MXFP4
(`weight_packed` + `weight_scale`, dequantized here). Loading is sharded: each parameter is
built with jax.make_array_from_callback, and each device's callback reads only its slice of
the file through safe_open(...).get_slice (a head range, an expert, one layer of a stack).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from k3jax.config import ConfigError, config_from_dict, model_changes
from k3jax.config.schema import replace
from k3jax.interchange.errors import InterchangeError
from k3jax.interchange.foreign import (
    apply_changes,
    detect_layout,
    fla_model_changes,
    foreign_plan,
    kimi_model_changes,
)
from k3jax.interchange.mxfp4_pack import unpack_mxfp4
from k3jax.interchange.names import Entry, abstract_state, release_plan

BLOCK = 32
# model settings that do not change what an exported checkpoint's tensors mean (storage and
# compute dtypes, how layers are stacked, initialisers, training-only behaviour): an export may
# be imported into a model that differs in them
NOT_IN_CHECKPOINT = frozenset(
    "model." + k for k in ("param_dtype", "compute_dtype", "scan_layers", "init_std", "qat", "qat_scale_rule",
                           "kda.a_init_min", "kda.a_init_max", "kda.dt_bias_init", "moe.balance",
                           "moe.qb_estimator", "moe.qb_bins", "moe.qb_range",
                           "moe.qb_update_rate"))
VLM_PREFIX = "language_model."  # the release's VLM checkpoint prefixes the text model's names


@dataclass(frozen=True)
class TensorInfo:
    file: str
    shape: tuple[int, ...]
    dtype: str


class HFCheckpoint:
    """The tensors of an HF directory (index + shards, or one model.safetensors), read lazily."""

    def __init__(self, hf_dir):
        from safetensors import SafetensorError, safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.dir / "model.safetensors").exists():
            files = ["model.safetensors"]
        else:
            raise InterchangeError(f"{self.dir}: no model.safetensors.index.json or model.safetensors")
        self._open, self._error = safe_open, SafetensorError
        self._handles: dict[str, object] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.names: dict[str, str] = {}  # our name -> name in the file
        self.skipped: list[str] = []  # tensors outside the text model of a VLM checkpoint
        for f in files:
            if not (self.dir / f).exists():
                raise InterchangeError(f"{self.dir}: the index names {f}, which does not exist")
            h = self._handle(f)
            for name in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                sl = h.get_slice(name)
                self.tensors[name] = TensorInfo(f, tuple(sl.get_shape()), sl.get_dtype())
        if any(n.startswith(VLM_PREFIX) for n in self.tensors):
            # the VLM checkpoint: its text model only (the vision tower and projector are not ours)
            self.skipped = sorted(n for n in self.tensors if not n.startswith(VLM_PREFIX))
            self.tensors = {n[len(VLM_PREFIX):]: v for n, v in self.tensors.items() if n.startswith(VLM_PREFIX)}
            self.names = {n: VLM_PREFIX + n for n in self.tensors}

    def _handle(self, f: str):
        if f not in self._handles:
            try:
                self._handles[f] = self._open(str(self.dir / f), framework="np").__enter__()
            except (OSError, self._error) as e:
                raise InterchangeError(f"{self.dir / f}: not a readable safetensors file ({e})") from None
        return self._handles[f]

    def read(self, name: str, index: tuple) -> np.ndarray:
        """name[index] (index: a tuple of slices), reading only that part of the file."""
        info = self.tensors[name]
        return self._handle(info.file).get_slice(self.names.get(name, name))[index]


def read_config_json(hf_dir) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise InterchangeError(f"{hf_dir}: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InterchangeError(f"{path}: not valid JSON ({e})") from None


def _packed_names(name: str) -> tuple[str, str]:
    base = name[: -len("weight")]
    return base + "weight_packed", base + "weight_scale"


def validate(plan: list[Entry], ckpt: HFCheckpoint) -> dict[str, str]:
    """Check every planned tensor against the files (present, shape, dtype) and that the files
    hold nothing else. Returns {entry name: "dense" or "mxfp4"}."""
    where = lambda n: f"{ckpt.dir / ckpt.tensors[n].file}"
    form, used = {}, set()
    for e in plan:
        packed, scale = _packed_names(e.name)
        if e.name in ckpt.tensors:
            t = ckpt.tensors[e.name]
            if t.shape != tuple(e.shape):
                raise InterchangeError(f"tensor {e.name} in {where(e.name)} has shape {list(t.shape)}, "
                                       f"expected {list(e.shape)}")
            form[e.name], _ = "dense", used.add(e.name)
        elif e.expert and packed in ckpt.tensors:
            out_, in_ = e.shape
            for n, want in ((packed, (out_, in_ // 2)), (scale, (out_, math.ceil(in_ / BLOCK)))):
                if n not in ckpt.tensors:
                    raise InterchangeError(f"missing tensor {n} (MXFP4 scales of {e.name}) in {ckpt.dir}")
                t = ckpt.tensors[n]
                if t.shape != want or t.dtype != "U8":
                    raise InterchangeError(f"tensor {n} in {where(n)} is {t.dtype}{list(t.shape)}, expected "
                                           f"U8{list(want)}")
                used.add(n)
            form[e.name] = "mxfp4"
        else:
            raise InterchangeError(f"missing tensor {e.name} (expected shape {list(e.shape)}) in {ckpt.dir}")
    extra = sorted(set(ckpt.tensors) - used)
    if extra:
        raise InterchangeError(f"unexpected tensor {extra[0]} in {where(extra[0])}"
                               + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                               + ": the config describes no such parameter")
    return form


def _read_hf(e: Entry, form: str, ckpt: HFCheckpoint, idx: tuple) -> np.ndarray:
    """The HF tensor of `e`, indexed by `idx` (slices over its HF shape), dequantized if MXFP4."""
    if form == "dense":
        return ckpt.read(e.name, idx)
    rows, cols = idx  # MXFP4: read whole 32-blocks along `in`, then trim
    c0, c1 = cols.start // BLOCK * BLOCK, -(-cols.stop // BLOCK) * BLOCK
    packed, scale = _packed_names(e.name)
    w = unpack_mxfp4(ckpt.read(packed, (rows, slice(c0 // 2, c1 // 2))),
                     ckpt.read(scale, (rows, slice(c0 // BLOCK, c1 // BLOCK))))
    return w[:, cols.start - c0: cols.stop - c0]


def read_inner(e: Entry, form: str, ckpt: HFCheckpoint, idx: tuple) -> np.ndarray:
    """The k3jax slice `idx` (slices over e.inner) of tensor `e`, read from the file."""
    hf = lambda *i: _read_hf(e, form, ckpt, tuple(i))
    if e.kind in ("same", "padded"):  # padded: the HF vector is longer; read its first entries
        return hf(*idx)
    if e.kind == "reshape":  # a small vector stored with extra unit axes
        return hf(*(slice(None),) * len(e.shape)).reshape(e.inner)[idx]
    if e.kind == "conv":  # HF [P, 1, W] -> [W, P]
        return hf(idx[1], slice(None), idx[0])[:, 0, :].T
    if e.kind == "heads_out":  # HF [d, H*v] -> [H, v, d]
        v, (sh, sv, sd) = e.inner[1], idx
        x = hf(sd, slice(sh.start * v, sh.stop * v))
        return x.reshape(x.shape[0], -1, v).transpose(1, 2, 0)[:, sv, :]
    if e.kind == "linear":  # HF [prod(out), in] -> [in, *out]; whole rows of the first out axis
        rest = math.prod(e.inner[2:])
        s0 = idx[1]
        x = hf(slice(s0.start * rest, s0.stop * rest), idx[0]).T
        x = x.reshape((x.shape[0], s0.stop - s0.start) + tuple(e.inner[2:]))
        return x[(slice(None), slice(None)) + tuple(idx[2:])]
    raise AssertionError(e.kind)


def _norm(index: tuple, shape: tuple) -> tuple:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise NotImplementedError("strided shards")
        out.append(slice(start, stop))
    return tuple(out)


def load_arrays(plan: list[Entry], form: dict, ckpt: HFCheckpoint, abstract: dict, shardings: dict | None):
    """{"params", "rest"}: every leaf of `abstract` built by make_array_from_callback from the
    entries that fill it (each device reads its own slice)."""
    by_leaf: dict[tuple, dict[tuple, Entry]] = {}
    for e in plan:
        by_leaf.setdefault((e.group, e.leaf), {})[e.index] = e
    out = {}
    for group in ("params", "rest"):
        flat = jax.tree_util.tree_flatten_with_path(abstract[group])[0]
        shard_leaves = (jax.tree.leaves(shardings[group]) if shardings is not None
                        else [jax.sharding.SingleDeviceSharding(jax.devices()[0])] * len(flat))
        arrays = []
        for (path, spec), sharding in zip(flat, shard_leaves):
            key = (group, tuple(k.key for k in path))
            entries = by_leaf.get(key)
            if not entries:
                raise InterchangeError(f"no tensor fills k3jax parameter {jax.tree_util.keystr(path)}")
            n = len(next(iter(entries)))
            dtype = spec.dtype

            memo: dict = {}  # devices holding the same slice (replicas) read it once

            def cb(index, entries=entries, n=n, shape=spec.shape, dtype=dtype, memo=memo):
                idx = _norm(index, shape)
                key = tuple((s.start, s.stop) for s in idx)
                if key not in memo:
                    memo[key] = _assemble(entries, n, idx, form, ckpt, dtype)
                    return memo[key]
                return memo[key].copy()  # one buffer per device: CPU devices may alias host memory

            arrays.append(jax.make_array_from_callback(spec.shape, sharding, cb))
            memo.clear()
        out[group] = jax.tree.unflatten(jax.tree.structure(abstract[group]), arrays)
    return out


def _assemble(entries: dict, n: int, idx: tuple, form: dict, ckpt: HFCheckpoint, dtype) -> np.ndarray:
    """The block `idx` of a leaf whose first n axes index `entries` (layers, experts)."""
    lead, inner = idx[:n], idx[n:]
    parts = [read_inner(entries[c], form[entries[c].name], ckpt, inner).astype(dtype)
             for c in itertools.product(*(range(s.start, s.stop) for s in lead))]
    sel = tuple(s.stop - s.start for s in idx)
    return np.stack(parts).reshape(sel) if n else parts[0].reshape(sel)


def resolve_config(cfg, hf_dir, layout: str | None = None):
    """(cfg with the checkpoint's architecture, layout name, its config.json). `layout` None:
    from config.json's model_type."""
    cj = read_config_json(hf_dir)
    where = str(Path(hf_dir) / "config.json")
    layout = layout or detect_layout(cj, where)
    if layout == "k3":
        saved = (cj.get("k3jax") or {}).get("model")
        if saved is not None:  # exported by k3jax: the model must be the one it was written for
            diff = [d for d in model_changes(config_from_dict({"model": saved}, source=where).model, cfg.model)
                    if d[0] not in NOT_IN_CHECKPOINT]
            if diff:
                k, a, b = diff[0]
                raise ConfigError(f"the checkpoint was exported from a model with {k}={a!r}, the config says {b!r}",
                                  where)
        return cfg, layout, cj
    changes = fla_model_changes(cj, where) if layout == "fla_kda" else kimi_model_changes(cj, where)
    return replace(cfg, model=apply_changes(cfg.model, changes, where)), layout, cj


def import_checkpoint(hf_dir, cfg, *, shardings=None, layout: str | None = None):
    """(cfg, {"params", "rest"}) read from hf_dir for the run config `cfg`."""
    cfg, layout, cj = resolve_config(cfg, hf_dir, layout)  # config errors first, before any file is opened
    ckpt = HFCheckpoint(hf_dir)
    abstract = abstract_state(cfg.model)
    plan = foreign_plan(layout, release_plan(cfg.model, abstract), cj)
    form = validate(plan, ckpt)
    return cfg, load_arrays(plan, form, ckpt, {"params": abstract[0], "rest": abstract[1]}, shardings)
