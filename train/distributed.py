"""Multi-process start-up with JAX's own runtime (`jax.distributed`), no home-made launcher.

One process per host (or per GPU). `jax.distributed.initialize()` finds the coordinator on
SLURM, Open MPI, Kubernetes (JobSet / indexed Jobs) and TPU pods by itself; elsewhere set
distributed.coordinator / num_processes / process_id (launch/local.sh does).
"""

from __future__ import annotations

import os

import jax

_CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JOB_COMPLETION_INDEX", "TPU_WORKER_HOSTNAMES",
                "MEGASCALE_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS")


def _looks_multiprocess() -> bool:
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 or int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return True
    workers = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in workers or any(k in os.environ for k in _CLUSTER_ENV[2:3] + _CLUSTER_ENV[4:])


def initialize(dist_cfg) -> None:
    """Join the job's processes, before anything touches a device."""
    if dist_cfg.initialize == "never":
        return
    # cross-process collectives for the CPU client (GPU/TPU clients ignore it); asking for the
    # backend here would initialise it before jax.distributed may
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if dist_cfg.coordinator:
        jax.distributed.initialize(coordinator_address=dist_cfg.coordinator, num_processes=dist_cfg.num_processes,
                                   process_id=dist_cfg.process_id)
    elif dist_cfg.initialize == "always" or _looks_multiprocess():
        jax.distributed.initialize()


def broadcast_text(text: str, size: int = 4096) -> str:
    """Process 0's `text` on every process (identity on one process): a fixed-size byte buffer
    through JAX's collectives, for a decision process 0 made alone."""
    if jax.process_count() == 1:
        return text
    import numpy as np
    from jax.experimental import multihost_utils

    buf = np.zeros(size, np.uint8)
    raw = text.encode()[:size]
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return bytes(out).rstrip(b"\0").decode(errors="replace")


def everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every process (identity on one process)."""
    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.int32(ok))).all())


def barrier(name: str) -> None:
    """Every process reaches this point before any goes on (nothing on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
