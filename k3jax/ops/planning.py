"""Tracing for another backend's memory: the context k3jax-plan sets while it compiles.

Inside `planning_for("gpu")` operators are traced as they would run on a GPU. Kernels that
cannot be compiled here are traced through stand-ins that keep what the kernels keep (their
inputs and outputs, the residuals their backward reads), so XLA sizes the program as it would
be: tokamax's Mosaic-GPU kernels (MLA's flash attention, the expert grouped GEMM), which
compile only with a GPU attached, and, when the planner compiles on XLA:CPU (no GPU compiler
installed), the fused Triton KDA kernels too. With the target's own compiler
(`planning_for("gpu", target_compiler=True)`, see `train.plan.target`) the Triton kernels are
the real ones.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class Planning:
    target: str              # "gpu" | "tpu" | "cpu": the backend the run will use
    target_compiler: bool    # compiling with that backend's own compiler (deviceless)


_PLANNING: contextvars.ContextVar[Planning | None] = contextvars.ContextVar("k3jax_planning", default=None)


@contextlib.contextmanager
def planning_for(backend: str, *, target_compiler: bool = False):
    """Inside, operators are traced as they would run on `backend` ("gpu", "tpu", "cpu")."""
    token = _PLANNING.set(Planning(backend, target_compiler))
    try:
        yield
    finally:
        _PLANNING.reset(token)


def current_planning() -> Planning | None:
    """The planning context in force (hashable: part of a cached trace's key); None outside."""
    return _PLANNING.get()


def planning_target() -> str | None:
    """The backend k3jax-plan is tracing for; None outside planning."""
    p = _PLANNING.get()
    return None if p is None else p.target


def triton_stand_in() -> bool:
    """Trace Triton (Pallas) kernels through their stand-ins: planning, without the GPU compiler."""
    p = _PLANNING.get()
    return p is not None and not p.target_compiler


def target_backend() -> str:
    """The backend an operator is traced for: the planning target, else this process's."""
    p = _PLANNING.get()
    return p.target if p is not None else jax.default_backend()
