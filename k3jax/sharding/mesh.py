"""The device mesh: named axes data, fsdp, expert, context, tensor, sized from `MeshConfig`.

The names, their order (slowest links outermost, `tensor` innermost) and `active_mesh` live in
`k3jax.ops.mesh_axes`, below every floor that reads them; this module builds meshes from configs.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from k3jax.config import ConfigError
from k3jax.ops.mesh_axes import AXES, BATCH_AXES, CONTEXT, TOKEN_AXES, active_mesh  # noqa: F401 (re-exported)


def mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
    """Resolve the -1 axis and check the product equals the device count."""
    sizes = {a: getattr(mesh_cfg, a) for a in AXES}
    free = [a for a, s in sizes.items() if s == -1]
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % fixed:
            raise ConfigError(f"the fixed mesh axes multiply to {fixed}, which does not divide the "
                              f"{num_devices} devices", f"mesh.{free[0]}")
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ConfigError(f"mesh {sizes} has {math.prod(sizes.values())} devices but {num_devices} are "
                          f"available; set one axis to -1 to take the rest", "mesh")
    return sizes


def make_mesh(mesh_cfg, devices=None) -> jax.sharding.Mesh:
    """A mesh over `devices` (default: all devices of all processes), Auto axis types so the
    XLA partitioner propagates shardings (shard_map regions are explicit)."""
    if devices is None:
        devices = jax.devices()
        if mesh_cfg.num_devices:
            if mesh_cfg.num_devices > len(devices) or jax.process_count() > 1:
                raise ConfigError(f"{mesh_cfg.num_devices} devices requested, {len(devices)} available "
                                  f"(and only a single-process run may use a subset)", "mesh.num_devices")
            devices = devices[:mesh_cfg.num_devices]
    devices = list(devices)
    sizes = mesh_shape(mesh_cfg, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    try:  # topology-aware device order where JAX knows the interconnect
        return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES), devices=devices)
    except (ValueError, NotImplementedError):
        return jax.sharding.Mesh(np.asarray(devices).reshape(shape), AXES,
                                 axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))
