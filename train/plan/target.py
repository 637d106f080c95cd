"""Compiling for an accelerator this machine does not have (k3jax-plan's target compile).

XLA compiles for a GPU or a TPU without one attached when it is given a description of the
device and of the topology: `jax.experimental.topologies.get_topology_desc` builds compile-only
devices, a mesh over them is an ordinary `jax.sharding.Mesh`, and `jit(...).lower(...).compile()`
runs the target's own compiler (XLA:GPU from the CUDA plugin, XLA:TPU from libtpu) on this CPU:
its fusion, scheduling and buffer assignment, so `memory_analysis()` is the target's figure.
The compilers come with the `[plan]` extra:

    pip install -e '.[plan]'    # jax-cuda13-plugin + jax-cuda13-pjrt, libtpu, pinned to jax's release

Without it the planner compiles on XLA:CPU (`train.plan.memory`), which on k3-small measured
1.96x the H200's peak (benchmarks/results/k3-small-2026-12-01/README.md): a fallback, said so in
the plan's first line.
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import numpy as np

from k3jax.chips import Chip

INSTALL_HINT = "pip install -e '.[plan]'"
FALLBACK_NOTE = ("XLA:CPU's figure: measured 1.96x the H200's real peak on k3-small "
                 "(benchmarks/results/k3-small-2026-12-01/README.md). "
                 f"For the target's own compiler: {INSTALL_HINT}")


@contextlib.contextmanager
def _quiet_plugin_env():
    """libtpu and the CUDA plugin look for hardware when they load: keep them from probing
    metadata servers or refusing a machine with no CUDA libraries (only compiling here). libtpu
    also takes a machine-wide lock file (/tmp/libtpu_lockfile) and refuses to load in a second
    process while one holds it: two plans (or two test workers) compiling for a TPU at once
    then fail; compiling touches no TPU, so the lock is waived."""
    defaults = {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
                # a worker list and a slice type keep libtpu from logging errors for the absent
                # TPU VM metadata; the topology asked for is given to the compile itself
                "TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5p-8"}
    saved = {k: os.environ.get(k) for k in defaults}
    for k, v in defaults.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@functools.cache
def compiler_unavailable(platform: str) -> str | None:
    """Why this process cannot compile for `platform` ("gpu" | "tpu"), None when it can."""
    with _quiet_plugin_env():
        try:
            if platform == "gpu":
                import jax_plugins.xla_cuda13  # noqa: F401
            elif platform == "tpu":
                import libtpu  # noqa: F401
            else:
                return f"unknown platform {platform!r}"
        except ImportError:
            what = "jax-cuda13-plugin" if platform == "gpu" else "libtpu"
            return f"{what} is not installed ({INSTALL_HINT})"
        try:
            _probe(platform)
        except Exception as e:  # the plugin is there but will not describe a device
            return f"the {platform.upper()} compiler did not load: {type(e).__name__}: {str(e)[:300]}"
    return None


def _probe(platform: str):
    from k3jax.chips import CHIPS, DEFAULT_CHIP

    topology(CHIPS[DEFAULT_CHIP[platform]], 1)


@functools.lru_cache(maxsize=8)
def topology(chip: Chip, devices: int):
    """Compile-only devices for `devices` of `chip`, laid out as the machine would be: GPUs
    in nodes of `chip.devices_per_node`, TPU chips in the slice `chip.tpu_topology(devices)`."""
    from jax.experimental import topologies

    with _quiet_plugin_env():
        if chip.platform == "gpu":
            return topologies.get_topology_desc(platform="cuda", target_config=chip.gpu_target_config(),
                                                topology=chip.gpu_topology(devices))
        return topologies.get_topology_desc(platform="tpu", topology_name=chip.tpu_topology(devices),
                                            chip_config_name="default",
                                            chips_per_host_bounds=chip.tpu_host_bounds(devices), num_slices=1)


def target_mesh(chip: Chip, devices: int, shape: tuple[int, ...], axis_names: tuple[str, ...]) -> jax.sharding.Mesh:
    """A mesh of `shape` over compile-only devices of `chip`, ordered as `k3jax.sharding.make_mesh`
    orders real ones (the interconnect-aware order where JAX has one, so the innermost axes
    land on the fastest links: `tensor` inside a node)."""
    devs = topology(chip, devices).devices
    auto = (jax.sharding.AxisType.Auto,) * len(axis_names)
    try:
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_device_mesh(shape, devs)
    except (ValueError, NotImplementedError, AssertionError):
        arr = np.asarray(devs).reshape(shape)
    return jax.sharding.Mesh(arr, axis_names, axis_types=auto)
