"""Which backend JAX starts on this machine, decided before it starts one.

With the `[plan]` extra installed (the CUDA plugin and libtpu: the planner's deviceless
compilers), JAX offers every installed plugin as a local backend on first use. On a machine
with no GPU and no TPU the CUDA plugin logs a traceback ("Jax plugin configuration error ...
Unable to load cuDNN") and libtpu prints TPU_WORKER_HOSTNAMES errors while it looks for a TPU,
before JAX settles on the CPU anyway.

`cpu_unless_accelerator()` sets JAX's platform to "cpu" when no accelerator's device node
exists: the backend JAX would end up on, without the plugins' probing. The plugins stay
registered (the CUDA plugin skips only its version check when CUDA is not asked for), so the
deviceless GPU and TPU compiles of k3jax-plan and the tests still work. A machine with a GPU or
a TPU is left alone, and so is an explicit JAX_PLATFORMS (set it, even to "", to choose).
Entry points call it before anything touches a device.
"""

from __future__ import annotations

import glob
import os

# The device nodes a driver creates for an accelerator JAX can use:
# NVIDIA: /dev/nvidia0.., /dev/nvidiactl in containers, /dev/dxg under WSL2 (as jax's own
# hardware check); AMD ROCm: /dev/kfd; TPU: /dev/accel0.. (v2 to v5e) or a numbered VFIO group
# (/dev/vfio/0.., v5p and later; /dev/vfio/vfio alone is the VFIO control node of any host).
ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd", "/dev/accel[0-9]*",
                     "/dev/vfio/[0-9]*")


def accelerator_nodes(patterns=ACCELERATOR_NODES) -> list[str]:
    """The accelerator device nodes present on this machine."""
    return [p for pattern in patterns for p in glob.glob(pattern)]


def local_platform(environ=None, nodes=None) -> str | None:
    """"cpu" where JAX should be kept off its plugins (no accelerator node, no JAX_PLATFORMS),
    else None (leave JAX's own choice). environ / nodes: for tests."""
    environ = os.environ if environ is None else environ
    if "JAX_PLATFORMS" in environ:
        return None
    nodes = accelerator_nodes() if nodes is None else nodes
    return None if nodes else "cpu"


def cpu_unless_accelerator() -> str | None:
    """Keep JAX on the CPU where this machine has no GPU or TPU (see the module docstring).
    Returns the platform set, or None. Call before any backend starts; later it changes nothing
    JAX has already started, and a platform set in jax.config is left alone."""
    import jax

    platform = local_platform()
    if platform is None or jax.config.jax_platforms:
        return None
    jax.config.update("jax_platforms", platform)
    return platform
