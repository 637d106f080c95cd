"""What the decode kernels share: which form runs (`model.decode_impl`) and how they are launched.

auto: the Pallas kernels on a GPU, XLA elsewhere (CPU, TPU, and while k3jax-plan traces for
XLA:CPU: the kernels are Triton, which only compiles for a GPU). Tracing for a GPU with its own
compiler (`planning_for("gpu", target_compiler=True)`: a deviceless XLA:GPU compile,
benchmarks/decode/decode_kernels.py) builds the real kernels, as the GPU would run them. pallas: the
kernels everywhere; off a GPU they run in the Pallas interpreter (the CPU tests). xla: the
plain forms.

Limits of the Pallas-Triton lowering that shape the kernels (as in k3jax/ops/kda_kernels):
every loaded or stored block has a power-of-two size, dots are 2-D with both sides >= 16,
and refs are indexed at dynamic offsets with `pl.ds` rather than values being sliced.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

IMPLS = ("auto", "pallas", "xla")
log = logging.getLogger("k3jax.ops")
_logged: set[str] = set()


def log_once(msg: str):
    if msg not in _logged:
        _logged.add(msg)
        log.info(msg)


def resolve_impl(impl: str, name: str = "model.decode_impl") -> str:
    """"pallas" or "xla" for `impl` in IMPLS on this backend."""
    from k3jax.ops.planning import planning_target, triton_stand_in

    if impl not in IMPLS:
        raise ValueError(f"{name} must be one of {IMPLS}, got {impl!r}")
    if impl == "xla":
        return "xla"
    if planning_target() is not None:  # the kernels only when XLA:GPU itself compiles them
        return "pallas" if planning_target() == "gpu" and not triton_stand_in() else "xla"
    if impl == "pallas":
        return "pallas"
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def resolve_for_shape(impl: str, key: str, why: str | None, width_fault: bool) -> str:
    """`resolve_impl` for one call of a training kernel (the short-conv and GLU backwards):
    "xla" where the kernel cannot take this call's shapes (`why`; None when it can). With impl
    "pallas" and the fault in the config's width (`width_fault`) rather than in a length that
    varies per call (a decode step, an odd prompt), an error naming `key` instead."""
    form = resolve_impl(impl, key)
    if form == "pallas" and why is not None:
        if impl == "pallas" and width_fault:
            raise ValueError(f"{key}=pallas: {why}")
        return "xla"
    return form


def interpret() -> bool:
    """Run the kernels in the Pallas interpreter (off a GPU, unless XLA:GPU compiles them)."""
    from k3jax.ops.planning import target_backend

    return target_backend() != "gpu"


def pow2_at_least(n: int, floor: int = 16) -> int:
    """The smallest power of two >= max(n, floor): a dot's padded side."""
    p = floor
    while p < n:
        p *= 2
    return p


def block_dividing(n: int, sizes=(64, 32, 16)) -> int | None:
    """The largest block in `sizes` dividing n (None when none does)."""
    return next((b for b in sizes if n % b == 0), None)


def index_operands(indices) -> tuple[list, list[int]]:
    """Layer indices (int32 scalars or Python ints) as kernel operands: ([1]-shaped int32 arrays,
    position of each index among them). The same traced value (a stage's repeat, used by every
    stacked parameter of a layer) or the same int is one operand, and a reshape builds each,
    so no XLA op runs to gather them (a stacked [n] array would be one more kernel)."""
    uniq, pos = [], []
    for i in indices:
        for j, u in enumerate(uniq):
            if u is i or (isinstance(u, int) and isinstance(i, int) and u == i):
                pos.append(j)
                break
        else:
            uniq.append(i)
            pos.append(len(uniq) - 1)
    return [jnp.reshape(jnp.asarray(u, jnp.int32), (1,)) for u in uniq], pos


def glu_f32(spec: tuple, a, b):
    """k3jax.layers.activations.apply_glu in fp32 on inputs already rounded: spec = (name,
    beta, linear_beta) as `glu_spec` gives it (SiTU-GLU, or SwiGLU for any other name)."""
    name, beta, linear_beta = spec
    if name == "situ":
        gate = beta * jnp.tanh(a / beta) * jax.nn.sigmoid(a)
        return gate * (b if linear_beta is None else linear_beta * jnp.tanh(b / linear_beta))
    return a * jax.nn.sigmoid(a) * b

