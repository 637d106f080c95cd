"""Scans start their stacked outputs from an uninitialised buffer, not from zeros (GPU and TPU).

`lax.scan` lowers to a while loop that writes iteration i's outputs into slot i of a stacked
buffer. jax 0.11.2 creates that buffer as a broadcast of zero (`loops._empty_array`, through
`lax.empty2`), and XLA:GPU runs the broadcast as a kernel that fills it, although the loop then
overwrites every slot. In k3-small's train step these buffers are the layer scan's saved
activations and the backward scan's stacked weight gradients: compiled for an H200
(`benchmarks/tools/glue_regions.py`), 21 fill kernels and 25.3 GB written per step, and zero
buffers copied where two loops shared one; the 2026-12-02 profile put 8.4 ms of the ~520 ms
step on those fills (`train/step.py:79`, the line the scans' plumbing is charged to).

`install()` swaps in a `_empty_array` that makes the buffer with `lax.empty`: an `AllocateBuffer`
custom call on GPU and TPU (no kernel, no bytes), zeros everywhere else (XLA:CPU: the same
program as before). This is the change jax's own TODO in `_empty_array` names ("Replace
`lax.empty2` with `lax.empty` once AllocateBuffer issues are fixed"); k3jax diverges from jax
here. It is safe for scan because the loop writes every slot before anything reads the
buffer: slot i in iteration i, an unrolled scan's remainder concatenated whole, and a
length-0 scan has no slot. tests/test_scan_outputs.py lowers scans of every form with the
buffer filled with NaN instead, and checks their values and gradients against a float64 loop.

One device only. jax lowers `lax.empty` to an AllocateBuffer with no sharding, and XLA's SPMD
partitioner, which has no rule for that custom call, makes it whole on every device: a scan
whose stacked output is split over a mesh then allocates the global stack per device
(configs/k3.yaml planned on 2,048 H200s: 10.6 TB of temporaries instead of ~106 GB; on 8 H200s
a toy scan's temporaries grow 2.7x, tests/test_scan_outputs.py). So `install` keeps jax's zeros
whenever the step runs on more than one device; that is the "AllocateBuffer issues" of jax's
TODO.

Lowering, not tracing, builds the buffer (`_scan_impl` runs when a jaxpr is lowered), so a
context around the step's tracing would miss it: the switch is process-wide, set from the
config and the mesh by `train.setup.prepare` (`train.scan_output_init`: uninitialized, the
default, or zeros, jax's own), like the XLA flags the trainer sets. Buffers outside device
memory (host offload) keep jax's form. With a jax whose `_empty_array` is not the one this was
written against, `install` leaves jax alone and says so.
"""

from __future__ import annotations

import inspect
import threading

from jax._src import core
from jax._src.lax import lax as lax_internal
from jax._src.lax.control_flow import loops
from jax._src.mesh import get_abstract_mesh, use_abstract_mesh

from k3jax.config.schema import SCAN_OUTPUT_INITS

_JAX_EMPTY_ARRAY = loops._empty_array
_LOCK = threading.Lock()


def _uninitialized_empty_array(prefix, length_spec, aval):
    """jax's `_empty_array` (same arguments and sharding), with `lax.empty` for the broadcast of
    zero: [*prefix, *aval.shape] of aval's dtype, its contents undefined on GPU and TPU."""
    if aval.memory_space != core.MemorySpace.Device:
        return _JAX_EMPTY_ARRAY(prefix, length_spec, aval)
    mesh = get_abstract_mesh() if aval.sharding.mesh.empty else aval.sharding.mesh
    sharding = aval.sharding.update(mesh=mesh, spec=aval.sharding.spec.update(
        partitions=(*length_spec, *aval.sharding.spec.partitions)))
    with use_abstract_mesh(sharding.mesh):
        out = lax_internal.empty((*prefix, *aval.shape), aval.dtype, out_sharding=sharding)
    return core.pvary(out, tuple(aval.mat.varying))


def _compatible() -> str | None:
    """Why the swap cannot be made with this jax, or None."""
    if not hasattr(lax_internal, "empty"):
        return "jax.lax has no `empty` primitive"
    params = list(inspect.signature(_JAX_EMPTY_ARRAY).parameters)
    if params != ["prefix", "length_spec", "aval"]:
        return f"jax's scan buffer helper takes {params}, not (prefix, length_spec, aval)"
    return None


def install(init: str = "uninitialized", num_devices: int = 1) -> bool:
    """Make every scan lowered from now on in this process start its stacked outputs as `init`
    ("uninitialized" or "zeros", jax's own) for a step on `num_devices` devices (more than one:
    zeros, module docstring); returns whether the uninitialised form is active."""
    if init not in SCAN_OUTPUT_INITS:
        raise ValueError(f"train.scan_output_init must be one of {SCAN_OUTPUT_INITS}, got {init!r}")
    with _LOCK:
        if init == "zeros" or num_devices > 1:
            loops._empty_array = _JAX_EMPTY_ARRAY
            return False
        reason = _compatible()
        if reason is not None:
            print(f"train.scan_output_init=uninitialized: not applied ({reason}); scans start from zeros")
            return False
        loops._empty_array = _uninitialized_empty_array
        return True


def active() -> bool:
    return loops._empty_array is _uninitialized_empty_array
