"""What a rung's rows depend on, and the rule for resuming them after an upgrade.

A finished row stands for a function of the rung's config: its model, its data, its optimizer
and its training length (`function_dict`: those sections of the resolved config, without the
seeds, which name the row, and without the settings that change how it is computed but not what:
the `knob` fields, data workers, compile caches). `ladder.json` keeps that dict for each rung
and kind of model (recall, LM), and a later launch resumes the rows only if its own config
computes the same function (`function_changes`):

* a key whose value changed orphans the rows, as does a key that no longer exists;
* a key added to the schema since, at its default value, does not: the stored dict is read
  back through `config_from_dict`, which fills keys it lacks with today's defaults (the way a
  checkpoint's config is read back, k3jax.config.load), and only then compared;
* a default that changed since is caught too: the stored dict holds the value the rows were
  measured with, not "the default".

The `fingerprint` is a short hash of the dict, for display only; the comparison uses the dict.
"""

from __future__ import annotations

import hashlib
import json

from k3jax.config import ConfigError, config_from_dict, config_to_dict
from k3jax.config.schema import Config, execution_keys

SECTIONS = ("model", "data", "optimizer", "train")
# how a run is carried out, not what it computes (besides every `knob` field): the seeds are part
# of each row's own key (--seeds), so they never orphan another seed's rows
NOT_FUNCTION = frozenset({"train.seed", "data.seed", "data.num_workers", "train.compile_cache_dir",
                          "train.autotune_budget_s", "train.scan_output_init", "optimizer.allow_lr_change"})


def _skip(key: str) -> bool:
    return key in NOT_FUNCTION or key in execution_keys(Config)


def _prune(node, prefix: str):
    if isinstance(node, dict):
        return {k: _prune(v, f"{prefix}{k}.") for k, v in node.items() if not _skip(f"{prefix}{k}")}
    if isinstance(node, list):  # data.sources: a list of dicts, whose fields are keys too
        return [_prune(v, f"{prefix}{i}.") for i, v in enumerate(node)]
    return node


def function_dict(cfg) -> dict:
    """The sections of cfg that make up the function its rows measured, as a nested plain dict."""
    full = config_to_dict(cfg)
    return {s: _prune(full[s], f"{s}.") for s in SECTIONS}


def flat(node, prefix: str = "") -> dict:
    """{dotted key: leaf value}; list items by index (data.sources.0.type)."""
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = ((str(i), v) for i, v in enumerate(node))
    else:
        return {prefix.rstrip("."): node}
    out = {}
    for k, v in items:
        if isinstance(v, (dict, list)) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fingerprint(function: dict) -> str:
    """A short hash of a function dict (shown in ladder.json; never compared on its own)."""
    return hashlib.sha256(json.dumps(function, sort_keys=True).encode()).hexdigest()[:16]


def function_changes(stored: dict, cfg) -> list[tuple[str, object, object]]:
    """(key, measured with, now) for every setting of cfg's function that differs from `stored`
    (a `function_dict` from ladder.json). Keys added to the schema since, at their default, are
    not differences; keys the schema no longer has are (unless k3jax.config.load retired them)."""
    try:
        then = config_from_dict(stored, source="ladder.json")
    except ConfigError as e:  # e.g. a key this version does not have
        return [(e.where or "ladder.json", e.message, "(not read by this version)")]
    old, new = flat(function_dict(then)), flat(function_dict(cfg))
    missing = object()
    return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if old.get(k, missing) != new.get(k, missing)]


__all__ = ["NOT_FUNCTION", "SECTIONS", "fingerprint", "flat", "function_changes", "function_dict"]
