"""Merge ladder.json files of one plan measured apart (several processes on one GPU, several
machines), rung by rung.

Each process of a split launch resumes its own copy of one ledger and trains its own rungs, so
for every rung one file holds all the runs any file holds of it: the others hold a subset (the
runs they all resumed from) or none. The merge takes each rung from the file that holds the
most of it, and refuses, naming both files, where two files each measured runs of a rung the
other lacks (two launches trained the same rung: merging run by run could pair rows of
different commands) or where their settings or a rung's function differ (the same rules as a
resume, report.Ledger and fingerprint.py).
"""

from __future__ import annotations

from pathlib import Path

from k3jax.config import ConfigError
from train.ladder.report import read_ledger, settings_change, write_ledger, write_report
from train.ladder.sizes import RUNGS


def _rung_of(key: str) -> str:
    return key.split("/", 1)[0]


def _models_of(data: dict, rung: str) -> dict:
    """A ledger's "rungs" entries (one per width) of one rung."""
    return {k: v for k, v in data["rungs"].items() if v.get("rung", k.split("@")[0]) == rung}


def merge(paths: list[Path]) -> dict:
    """One ledger holding every rung's runs from `paths` (in order; the first one's settings)."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise ConfigError("nothing to merge: name at least one ladder.json", "--merge")
    ledgers = [read_ledger(p, hint=" (only those can be merged)") for p in paths]
    for path, data in zip(paths[1:], ledgers[1:]):
        change = settings_change(ledgers[0]["settings"], data["settings"])
        if change:
            k, there, here = change
            raise ConfigError(f"measured with other settings than {paths[0]} ({k}: {there!r} there, "
                              f"{here!r} here); their rows cannot share a table", str(path))

    rungs = list(dict.fromkeys([*RUNGS, *(_rung_of(k) for d in ledgers for k in d["done"])]))
    out = {**ledgers[0], "commands": [], "rungs": {}, "done": [], "timing": {}, "rows": []}
    for data in ledgers:
        out["commands"] += [c for c in data.get("commands", []) if c not in out["commands"]]
    for rung in rungs:
        done = [{k for k in d["done"] if _rung_of(k) == rung} for d in ledgers]
        owner = max(range(len(ledgers)), key=lambda i: len(done[i]))
        for i, keys in enumerate(done):
            extra = keys - done[owner]
            if extra:
                raise ConfigError(f"both this file and {paths[owner]} measured runs of the {rung} rung the other "
                                  f"lacks (e.g. {sorted(extra)[0]} here): two launches trained it. Merge only "
                                  "files whose launches split the rungs between them", str(paths[i]))
        source = ledgers[owner]
        models = _models_of(source, rung)
        for i, keys in enumerate(done):  # a file holding some of the same runs measured the same function
            if not keys or i == owner:
                continue
            for key, info in models.items():
                theirs = ledgers[i]["rungs"].get(key, {}).get("function")
                if theirs is not None and theirs != info.get("function"):
                    raise ConfigError(f"the {key} rung was measured with another config than in {paths[owner]}",
                                      str(paths[i]))
        if not models:  # no file measured it: its description from the first file that has one
            models = next((m for m in (_models_of(d, rung) for d in ledgers) if m), {})
        out["rungs"].update(models)
        out["done"] += [k for k in source["done"] if _rung_of(k) == rung]
        out["timing"].update({k: v for k, v in source["timing"].items() if _rung_of(k) == rung})
        out["rows"] += [r for r in source["rows"] if r["rung"] == rung]
    # the environment of the newest launch (the files named last, among the latest date), with
    # every device that measured rows named where they differ
    envs = [d["environment"] for d in ledgers if d.get("environment", {}).get("date")]
    latest = max(e["date"] for e in envs) if envs else None
    out["environment"] = dict([e for e in envs if e["date"] == latest][-1]) if envs else {}
    devices = list(dict.fromkeys(d for e in envs if "device" in e for d in e["device"].split(" and ")))
    if len(devices) > 1:
        out["environment"]["device"] = " and ".join(devices)
    out["merged_from"] = [str(p) for p in paths]
    return out


def merge_into(out: Path, files: list[str], *, keep_existing: bool = True) -> dict:
    """k3jax-ladder --merge: --out's ladder.json (unless `keep_existing` is False, as for a --fresh
    launch) and `files`, rung by rung, written to --out's ladder.json with its tables and plots.
    -> the merged ledger."""
    out = Path(out)
    target = out / "ladder.json"
    paths = [Path(f) for f in files]
    if keep_existing and target.is_file() and all(p.resolve() != target.resolve() for p in paths):
        paths.insert(0, target)
    data = merge(paths)
    write_ledger(target, data)
    print(f"merged {len(paths)} files: {len(data['done'])} finished runs")
    print("wrote " + ", ".join(str(p) for p in [target, *write_report(data, out)]))
    return data


__all__ = ["merge", "merge_into"]
