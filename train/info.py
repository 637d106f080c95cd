"""k3jax-info: parameter counts, decode-state size and optimizer partition of a config,
without allocating.

    k3jax-info --config configs/k3.yaml [--context 1048576] [--json] [key=value ...]

The model is built abstractly (`nnx.eval_shape`), so the counts come from the real
modules (`k3jax.model_sizes`). Active parameters per token exclude the input embedding and all
but top_k of the routed experts (lm_head included). The routed experts' weight bytes are given in bf16,
and with model.qat=mxfp4 also in MXFP4: a 4-bit element per weight and a one-byte scale per
32 weights along the reduction axis (4.25 bits per weight). With optimizer.name=muon, a table
shows which parameters take whole-matrix Muon, per-head Muon (optimizer.muon_per_head) or AdamW.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from flax import nnx

from k3jax.config import ConfigError, load_config
from k3jax.local_platform import cpu_unless_accelerator
from k3jax.model_sizes import (COMPONENTS, abstract_model, active_params, decode_state_bytes, full_attention_bytes,
                               param_component, param_counts, routed_expert_bytes)
from train.optimizer import optimizer_label, partition_summary


def _layer_path(keys: list[str]) -> str:
    """A parameter's path inside its layer ('self_attn/q_proj/kernel'); the whole path outside
    the stacked layers."""
    if keys[0] == "stages" and "layers" in keys:
        return "/".join(keys[keys.index("layers") + 2:])
    return "/".join(keys)


def optimizer_partition(opt_cfg, model) -> list[dict]:
    """Which update each parameter takes (train/optimizer.py): one row per component,
    parameter name inside its layer and update ("muon", "muon per-head (H)", "adamw"), with
    the number of stored tensors and parameters."""
    rows: dict[tuple, list[int]] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = (param_component(path, model), _layer_path([str(k) for k in path]),
               optimizer_label(opt_cfg, path, var))
        row = rows.setdefault(key, [0, 0])
        row[0] += 1
        row[1] += int(np.prod(var.get_value().shape))
    order = {c: i for i, c in enumerate(COMPONENTS)}
    return [{"component": c, "parameter": p, "optimizer": o, "tensors": n, "params": size}
            for (c, p, o), (n, size) in sorted(rows.items(), key=lambda kv: (order[kv[0][0]], kv[0][1]))]


def report(model_cfg, context: int, opt_cfg=None) -> dict:
    model = abstract_model(model_cfg)
    counts = param_counts(model)
    state = decode_state_bytes(model, context)
    extra = {}
    if opt_cfg is not None:
        extra = {"optimizer": partition_summary(opt_cfg, nnx.state(model, nnx.Param)),
                 "optimizer_partition": optimizer_partition(opt_cfg, model) if opt_cfg.name == "muon" else []}
    return {
        "routed_experts_bytes": routed_expert_bytes(model, model_cfg.qat),
        "total_params": sum(counts.values()),
        "active_params": active_params(model_cfg, counts),
        "params_by_component": counts,
        "layers": model_cfg.num_layers,
        "stages": [{"start": s.start, "unit": len(s.unit), "repeat": s.repeat} for s in model.plan],
        "context": context,
        "decode_state_bytes": state,
        "decode_state_total_bytes": sum(state.values()),
        "full_attention_bytes": full_attention_bytes(model_cfg, context),
        **extra,
    }


def _human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G" if unit == "B" else "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.4g} {suffix}{unit}"
    return f"{n:.0f} {unit}".strip()


def _print(r: dict) -> None:
    print(f"parameters: {_human(r['total_params'])} total, {_human(r['active_params'])} active per token")
    for k, v in r["params_by_component"].items():
        print(f"  {k:<16}{_human(v):>12}  {100 * v / r['total_params']:7.3f}%")
    eb = r["routed_experts_bytes"]
    if eb["bf16"]:
        print(f"routed experts' weights: {_human(eb['bf16'], 'B')} in bf16"
              + (f", {_human(eb['mxfp4'], 'B')} in MXFP4 (4.25 bits per weight)" if "mxfp4" in eb else ""))
    print("stages (scanned units): " + ", ".join(f"layers {s['start']}+ {s['repeat']}x{s['unit']}" for s in r["stages"]))
    print(f"decode state per sequence at context {r['context']:,}:")
    for k, v in r["decode_state_bytes"].items():
        print(f"  {k:<16}{_human(v, 'B'):>12}")
    print(f"  {'total':<16}{_human(r['decode_state_total_bytes'], 'B'):>12}")
    fa = r["full_attention_bytes"]
    print("full attention in every layer would need:")
    print(f"  MLA latent cache   {_human(fa['all_layers_mla_latent'], 'B'):>10}"
          f"  ({fa['all_layers_mla_latent'] / r['decode_state_total_bytes']:.1f}x)")
    print(f"  expanded K/V cache {_human(fa['all_layers_expanded_kv'], 'B'):>10}"
          f"  ({fa['all_layers_expanded_kv'] / r['decode_state_total_bytes']:.1f}x)")
    if "optimizer" in r:
        print(r["optimizer"])
    if r.get("optimizer_partition"):
        width = max(len(row["parameter"]) for row in r["optimizer_partition"])
        print(f"  {'component':<16}{'parameter':<{width + 2}}{'update':<20}{'tensors':>8}{'params':>12}")
        for row in r["optimizer_partition"]:
            print(f"  {row['component']:<16}{row['parameter']:<{width + 2}}{row['optimizer']:<20}"
                  f"{row['tensors']:>8}{_human(row['params']):>12}")


def main(argv=None):
    cpu_unless_accelerator()  # no GPU or TPU here: keep JAX's plugins from probing (k3jax/local_platform.py)
    p = argparse.ArgumentParser(prog="k3jax-info", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--context", type=int, default=4096, help="context length for the decode-state size")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", help="key.sub=value")
    a = p.parse_intermixed_args(argv)
    try:
        cfg = load_config(a.config, a.overrides)
    except ConfigError as e:
        print(f"k3jax-info: {e}", file=sys.stderr)
        return 2
    r = report(cfg.model, a.context, cfg.optimizer)
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        _print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
