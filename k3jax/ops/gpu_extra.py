"""The `[gpu]` extra (tokamax's kernels): whether it can run here, and why not.

Checked once per process by the operators that have a tokamax form (the expert grouped
matmul, MLA's flash attention); CPU installs and CI never import tokamax.
"""

from __future__ import annotations

import functools

import jax


@functools.cache
def tokamax_unavailable() -> str | None:
    """Why tokamax's GPU kernels cannot run here (None when they can): no GPU, or tokamax
    missing or broken (it imports xprof, pydantic and qwix at import time)."""
    if jax.default_backend() != "gpu":
        return f"no GPU (backend {jax.default_backend()})"
    try:
        import tokamax  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"tokamax not importable ({type(e).__name__}: {e}); install the GPU extra: pip install -e '.[gpu]'"
    return None
