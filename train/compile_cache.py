"""JAX's persistent compilation cache, on by default for k3jax-train (`train.compile_cache_dir`).

A relaunch, a resume or a second run of the same config loads the compiled train and eval
steps instead of compiling them again (k3-small on an H200: 131 s compiled, 50 s from the
cache, BENCHMARKS.md §6). tokamax's tuned kernel configs live beside it, in its `tokamax/`
folder (train/kernel_tuning.py).

`train.compile_cache_dir`:
- "auto" (default): JAX's own setting when the environment gives one (JAX_COMPILATION_CACHE_DIR),
  else $XDG_CACHE_HOME/k3jax/jax, i.e. ~/.cache/k3jax/jax. A per-user directory rather than one
  beside run_dir: compiled programs do not depend on the run, so every run of a config (and
  every config sharing a program) reuses them, and run_dir stays what it is: the run's
  checkpoints and logs.
- "off": no persistent cache (and no tuned tokamax configs kept).
- any other string: that directory (~ expanded).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import jax

AUTO, OFF = "auto", "off"


def resolve_cache_dir(setting: str, environ: Mapping[str, str] | None = None,
                      jax_setting: str | None = None) -> Path | None:
    """The directory `train.compile_cache_dir` names, or None when the cache is off.

    environ: the environment (default os.environ); jax_setting: JAX's configured cache
    directory (default jax.config's, which JAX_COMPILATION_CACHE_DIR sets at import)."""
    environ = os.environ if environ is None else environ
    setting = setting.strip()
    if setting.lower() in (OFF, "none", ""):
        return None
    if setting.lower() != AUTO:
        return Path(os.path.expanduser(setting))
    if jax_setting is None:
        jax_setting = jax.config.jax_compilation_cache_dir
    jax_setting = jax_setting or environ.get("JAX_COMPILATION_CACHE_DIR")
    if jax_setting:
        return Path(os.path.expanduser(jax_setting))
    cache_home = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_home) / "k3jax" / "jax"


def enable_compile_cache(setting: str) -> Path | None:
    """Point JAX's persistent compilation cache at `resolve_cache_dir(setting)` (None: leave it off).

    Called once per process before the first compile; a cache JAX already opened elsewhere
    in this process is re-pointed (JAX opens its cache once, at the first compile)."""
    path = resolve_cache_dir(setting)
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != str(path):
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", str(path))
        compilation_cache.reset_cache()  # reopened at the next compile, at the new path
    return path
