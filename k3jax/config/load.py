"""Load a `Config` from YAML files (with `base:` inheritance) and `key.sub=value` overrides.

Every leaf remembers where it was set (file or command line), so an error names
the place a user can fix. Types are checked against the dataclass annotations;
nothing here holds a default of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from k3jax.config.errors import ConfigError
from k3jax.config.schema import Config

CLI = "command line"


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a checked `Config` from an optional YAML file plus `key=value` overrides."""
    tree: dict = {}
    origins: dict[str, str] = {}
    places: dict[str, str] = {}
    if path is not None:
        tree, origins, places = _read_yaml_with_bases(Path(path), ())
    return _checked_with_overrides(tree, origins, places, overrides)


def _checked_with_overrides(tree: dict, origins: dict[str, str], places: dict[str, str], overrides) -> Config:
    """The checked Config of `tree` (a config's plain dict, whose keys came from `origins`) with
    the command line's `key=value` overrides set on it; an error names the key and where it came from."""
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(tree, key, value, origins, CLI)
        for prefix in _prefixes(key):
            places[prefix] = CLI
    cfg = _build(Config, tree, "", origins, places)
    problems = cfg.check()
    if problems:
        key, msg = problems[0]
        raise ConfigError(msg, _where(key, origins))
    return cfg


def config_to_dict(cfg) -> dict:
    """A plain, YAML-safe dict of a config (tuples become lists)."""
    def conv(x):
        if dataclasses.is_dataclass(x):
            return {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (tuple, list)):
            return [conv(v) for v in x]
        return x
    return conv(cfg)


# Keys that configs saved by earlier versions (in checkpoints) carry and this version no longer
# has: dropped when such a config is read back, so those checkpoints still resume.
RETIRED_KEYS = ("model.max_seq_len", "train.autotune")


def config_from_dict(data: dict, source: str = "saved config") -> Config:
    """Rebuild a Config from `config_to_dict` output (e.g. one stored in a checkpoint)."""
    data = copy.deepcopy(data)
    for key in RETIRED_KEYS:
        parent, _, name = key.rpartition(".")
        node = _get_dotted(data, parent)
        if isinstance(node, dict):
            node.pop(name, None)
    origins = {k: source for k in _leaf_keys(data)}
    return _build(Config, data, "", origins)


def with_overrides(cfg, overrides, source: str = "saved config") -> Config:
    """`cfg` with `key=value` overrides on top, checked as `load_config` checks them (an error
    names the override's key, or `source` for a key the overrides did not set)."""
    if not overrides:
        return cfg
    tree = config_to_dict(cfg)
    return _checked_with_overrides(tree, {k: source for k in _leaf_keys(tree)}, {}, overrides)


def dump_config(cfg, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def diff_configs(a, b, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Dotted keys whose values differ between two configs (or sub-configs)."""
    da, db = (config_to_dict(x) if dataclasses.is_dataclass(x) else x for x in (a, b))
    out = []
    for key in sorted(set(_leaf_keys(da)) | set(_leaf_keys(db))):
        va, vb = _get_dotted(da, key), _get_dotted(db, key)
        if va != vb:
            out.append((f"{prefix}{key}", va, vb))
    return out


# --------------------------------------------------------------------------------------
# YAML files and overrides


class _Loader(yaml.SafeLoader):
    """YAML 1.2's booleans: only true/false (any case). PyYAML follows YAML 1.1, where yes/no/on/off
    are booleans too, so `train.compile_cache_dir=off` arrived as False and was refused as "not a
    string"; here it is the string 'off', and a bool field given `yes` says it wants true/false."""


_Loader.yaml_implicit_resolvers = {k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
                                   for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _first in "tTfF":
    _Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                  [_first])


def _load_yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def _read_yaml_with_bases(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[str, str], dict[str, str]]:
    """The merged tree, the place ('file:line') each value was set, and the place each key was written."""
    path = path.expanduser()
    if not path.is_file():
        hint = f" (named as `base:` by {chain[-1]})" if chain else ""
        raise ConfigError(f"config file not found{hint}", str(path))
    real = path.resolve()
    if real in chain:
        raise ConfigError("`base:` files form a cycle: " + " -> ".join(map(str, chain + (real,))), str(path))
    text = path.read_text()
    try:
        data = _load_yaml(text) or {}
        lines = _key_lines(yaml.compose(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}", str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"top level must be a mapping, got {type(data).__name__}", str(path))
    base = data.pop("base", None)
    tree: dict = {}
    origins: dict[str, str] = {}
    places: dict[str, str] = {}
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError("`base:` must be a file path", f"{_place(str(path), lines, 'base')}: base")
        tree, origins, places = _read_yaml_with_bases(path.parent / base, chain + (real,))
    _merge(tree, data, origins, places, str(path), lines, "")
    return tree, origins, places


def _key_lines(node, prefix: str = "", out: dict[str, int] | None = None, depth: int = 0) -> dict[str, int]:
    """The 1-based line of every mapping key and list item of a composed YAML document, by dotted key."""
    out = {} if out is None else out
    if depth > 64:  # a recursive anchor; its keys fall back to the nearest line above
        return out
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            dotted = f"{prefix}{key_node.value}"
            out.setdefault(dotted, key_node.start_mark.line + 1)
            _key_lines(value_node, dotted + ".", out, depth + 1)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out.setdefault(f"{prefix}{i}", item.start_mark.line + 1)
            _key_lines(item, f"{prefix}{i}.", out, depth + 1)
    return out


def _place(source: str, lines: dict[str, int], dotted: str) -> str:
    """'file:line' of dotted (or of its nearest parent YAML gave a line for)."""
    probe = dotted
    while probe:
        if probe in lines:
            return f"{source}:{lines[probe]}"
        probe = probe.rpartition(".")[0]
    return source


def _merge(dst: dict, src: dict, origins: dict[str, str], places: dict[str, str], source: str,
           lines: dict[str, int], prefix: str) -> None:
    """Merge src (read from `source`) into dst; origins gets the place of each value set, places
    that of each key written (so an unknown key that holds a mapping still names its own line)."""
    for key, value in src.items():
        key = str(key)
        dotted = f"{prefix}{key}"
        places[dotted] = _place(source, lines, dotted)
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, origins, places, source, lines, dotted + ".")
        else:
            dst[key] = value
            _forget_below(origins, dotted)
            for leaf in _leaf_keys(value) if isinstance(value, (dict, list)) and value else [""]:
                full = f"{dotted}.{leaf}" if leaf else dotted
                origins[full] = _place(source, lines, full)


def _forget_below(origins: dict[str, str], key: str) -> None:
    """Drop the recorded places of the values a new value at key replaces."""
    for k in [k for k in origins if k.startswith(key + ".")]:
        del origins[k]


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form key.sub=value", CLI)
    try:
        value = _load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _set_dotted(tree: dict, key: str, value: Any, origins: dict[str, str], source: str) -> None:
    parts = key.split(".")
    node: Any = tree
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            idx = _list_index(part, node, ".".join(parts[: i + 1]))
            node = node[idx]
            continue
        if not isinstance(node.get(part), (dict, list)):
            node[part] = {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        node[_list_index(last, node, key)] = value
    else:
        node[last] = value
    _forget_below(origins, key)
    origins[key] = source


def _prefixes(key: str) -> list[str]:
    """'a.b.c' -> ['a', 'a.b', 'a.b.c']."""
    parts = key.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _list_index(part: str, node: list, key: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"list index {part!r} out of range (the list has {len(node)} items)", key)
    return int(part)


def _leaf_keys(d: Any, prefix: str = "") -> list[str]:
    if isinstance(d, dict):
        out = []
        for k, v in d.items():
            out += _leaf_keys(v, f"{prefix}{k}.") if isinstance(v, (dict, list)) and v else [f"{prefix}{k}"]
        return out
    if isinstance(d, list):
        out = []
        for i, v in enumerate(d):
            out += _leaf_keys(v, f"{prefix}{i}.") if isinstance(v, (dict, list)) and v else [f"{prefix}{i}"]
        return out
    return [prefix.rstrip(".")]


def _get_dotted(d: Any, key: str) -> Any:
    for part in key.split("."):
        if isinstance(d, dict) and part in d:
            d = d[part]
        elif isinstance(d, list) and part.isdigit() and int(part) < len(d):
            d = d[int(part)]
        else:
            return None
    return d


def _where(key: str, origins: dict[str, str]) -> str:
    """'file: key' for the most specific recorded origin of key (or of a parent)."""
    probe = key
    while probe:
        if probe in origins:
            return f"{origins[probe]}: {key}"
        probe = probe.rpartition(".")[0]
    return f"{key} (default)"


def _where_key(key: str, origins: dict[str, str], places: dict[str, str]) -> str:
    """'file:line: key' where the key itself was written; a key set only through its children
    (a mapping from a saved config) names the first child's place."""
    if key in places:
        return f"{places[key]}: {key}"
    below = [origins[k] for k in origins if k.startswith(key + ".")]
    return f"{below[0]}: {key}" if below else _where(key, origins)


# --------------------------------------------------------------------------------------
# Typed construction


def _build(cls, data: Any, prefix: str, origins: dict[str, str], places: dict[str, str] | None = None):
    where = _where(prefix.rstrip(".") or "<root>", origins)
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping for {cls.__name__}, got {data!r}", where)
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown key '{dotted}'{hint}", _where_key(dotted, origins, places or {}))
        kwargs[key] = _coerce(hints[key], value, dotted, origins, places)
    return cls(**kwargs)


def _coerce(tp, value: Any, key: str, origins: dict[str, str], places: dict[str, str] | None = None):
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", origins, places)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key, origins, places)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"must be one of {', '.join(map(str, choices))}, got {value!r}{hint}",
                              _where(key, origins))
        return value
    if origin is tuple:
        args = get_args(tp)
        if isinstance(value, str) and args and args[0] is str:
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected a list, got {value!r}", _where(key, origins))
        item_tp = args[0]
        return tuple(_coerce(item_tp, v, f"{key}.{i}", origins, places) for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"expected true/false, got {value!r}", _where(key, origins))
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"expected an integer, got {value!r}", _where(key, origins))
        return value
    if tp is float:
        if isinstance(value, str):
            try:  # YAML 1.1 reads '3e-4' as a string
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"expected a number, got {value!r}", _where(key, origins))
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"expected a string, got {value!r}", _where(key, origins))
        return value
    raise TypeError(f"unsupported config field type {tp!r} at {key}")  # a schema bug, not user input


__all__ = ["CLI", "config_from_dict", "config_to_dict", "diff_configs", "dump_config", "load_config"]
