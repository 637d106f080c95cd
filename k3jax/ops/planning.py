"""Tracing for another backend's memory: the context k3jax-plan sets while it compiles.

Inside `planning_for("gpu")` the operators that take a GPU-only kernel (the fused KDA
kernels, MLA's flash attention) are traced as they would run on a GPU, through stand-ins
that keep what the kernels keep: Triton and Mosaic-GPU kernels cannot be compiled off-GPU,
so the planner compiles the stand-ins with XLA and adds the kernels' workspace analytically.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_PLANNING_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("k3jax_planning_for", default=None)


@contextlib.contextmanager
def planning_for(backend: str):
    """Inside, operators are traced as they would run on `backend` ("gpu", "tpu", "cpu")."""
    token = _PLANNING_FOR.set(backend)
    try:
        yield
    finally:
        _PLANNING_FOR.reset(token)


def planning_target() -> str | None:
    """The backend k3jax-plan is tracing for; None outside planning."""
    return _PLANNING_FOR.get()


def target_backend() -> str:
    """The backend an operator is traced for: the planning target, else this process's."""
    return _PLANNING_FOR.get() or jax.default_backend()
