"""k3jax-plan's measurement on the target: the real sharded train step, compiled by the target's
own compiler for a topology of the mesh's size, and what its memory peak holds.

    m = compile_train_step(cfg, CHIPS["h200"], 2048)
    m.arguments, m.temporaries, m.outputs_not_aliased, m.total     # bytes per device
    m.peak_terms                                                   # [(name, bytes)], largest first

The program is one device's share of `train.setup.prepare(cfg, mesh).train_step(cfg)` (the
step the CLI runs: micro-batches, the optimizer update, QB, every collective the mesh needs),
lowered on abstract inputs over compile-only devices (`k3jax.plan_target`) and compiled with
the target's compiler; nothing is allocated. `memory_analysis()` then is XLA:GPU's or
XLA:TPU's own buffer assignment. The peak's terms come from XLA's live-range dump
(`k3jax.plan_breakdown`), named by the code that made each buffer.

Kernels the target compiler cannot build without the device attached (tokamax's Mosaic-GPU
flash attention and grouped GEMM) are traced through stand-ins that keep what they keep
(`k3jax.ops.planning`); the fused KDA kernels are Triton and compile for real.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import jax

from k3jax.chips import Chip
from k3jax.config.schema import replace
from k3jax.ops.planning import planning_for
from k3jax.plan_breakdown import peak_breakdown
from k3jax.plan_target import target_mesh
from k3jax.sharding.mesh import AXES, mesh_shape

# XLA:GPU options for a program that is only measured: unoptimised LLVM IR and ptxas -O0. Buffer
# assignment (the plan's figure) is fixed before code generation; k3.yaml's step spent about 7
# of its 23 minutes of compile generating code after it (dump timestamps, 2026-12-01)
PLAN_CODEGEN_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                        "xla_gpu_disable_gpuasm_optimizations": True}

PROJECT_ROOTS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),)


@dataclass(frozen=True)
class TargetCompile:
    compiler: str            # "XLA:GPU" | "XLA:TPU"
    devices: int
    topology: str
    arguments: int           # per device: the train state and the batch (donated state included)
    temporaries: int         # XLA's temporary allocation: gradients, activations, the update
    outputs_not_aliased: int  # outputs that do not reuse a donated input's buffer
    peak_terms: tuple[tuple[str, int], ...]  # buffers live at the peak, by what made them
    lower_s: float
    compile_s: float

    @property
    def total(self) -> int:
        return self.arguments + self.temporaries + self.outputs_not_aliased


def compile_train_step(cfg, chip: Chip, num_devices: int, *, batch: int | None = None, seq: int | None = None,
                       breakdown: bool = True, dump_dir: str | None = None) -> TargetCompile:
    """Compile `cfg`'s train step for `num_devices` of `chip` (mesh from cfg.mesh) on this
    machine with the chip's compiler, and read its memory. dump_dir: keep XLA's dump of the
    compiled step there (HLO, buffer assignment, live ranges) for a closer look."""
    from train.setup import prepare  # train/ builds on k3jax; imported only when planning

    changes = {}
    if batch is not None and batch != cfg.train.batch_size:
        changes["train.batch_size"] = batch
    if seq is not None and seq != cfg.data.seq_len:
        changes["data.seq_len"] = seq
    cfg = replace(cfg, **changes) if changes else cfg
    sizes = mesh_shape(cfg.mesh, num_devices)
    mesh = target_mesh(chip, num_devices, tuple(sizes[a] for a in AXES), AXES)
    topology = chip.gpu_topology(num_devices) if chip.platform == "gpu" else chip.tpu_topology(num_devices)
    t0 = time.perf_counter()
    with planning_for(chip.platform, target_compiler=True):
        setup = prepare(cfg, mesh=mesh)
        with jax.set_mesh(mesh):
            lowered = setup.train_step(cfg).lower(*setup.abstract_args(cfg))
        t1 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="k3jax-plan-") as tmp:
            dump = dump_dir or tmp
            options = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True,
                       "xla_dump_hlo_module_re": "jit_step"} if breakdown or dump_dir else {}
            if chip.platform == "gpu":  # the schedule k3jax-train runs with (train/xla_flags.py)
                from train.xla_flags import GPU_SCHEDULER_OPTIONS
                options |= GPU_SCHEDULER_OPTIONS
                # nothing runs what the plan compiles: skip the machine code's optimisation
                # (LLVM and ptxas), which comes after buffer assignment and cannot change it
                options |= PLAN_CODEGEN_OPTIONS
            try:
                compiled = lowered.compile(compiler_options=options)
            except jax.errors.JaxRuntimeError as e:
                # XLA:TPU refuses a program whose temporaries exceed the chip's HBM instead of
                # compiling it: the figure it names is the plan's answer
                temporaries = hbm_overflow_bytes(str(e))
                if temporaries is None:
                    raise
                state, batch_args = setup.abstract_args(cfg)
                return TargetCompile(
                    compiler="XLA:TPU" if chip.platform == "tpu" else "XLA:GPU", devices=num_devices,
                    topology=topology, arguments=_shard_bytes((state, batch_args)), temporaries=temporaries,
                    outputs_not_aliased=0, peak_terms=(), lower_s=t1 - t0, compile_s=time.perf_counter() - t1)
            t2 = time.perf_counter()
            terms = ()
            if breakdown:
                _, named = peak_breakdown(dump, PROJECT_ROOTS, module_glob="*jit_step*")
                terms = tuple(named)
    ma = compiled.memory_analysis()
    return TargetCompile(
        compiler="XLA:GPU" if chip.platform == "gpu" else "XLA:TPU", devices=num_devices, topology=topology,
        arguments=int(ma.argument_size_in_bytes), temporaries=int(ma.temp_size_in_bytes),
        outputs_not_aliased=max(0, int(ma.output_size_in_bytes) - int(ma.alias_size_in_bytes)),
        peak_terms=terms, lower_s=t1 - t0, compile_s=t2 - t1)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def hbm_overflow_bytes(message: str) -> int | None:
    """The temporaries XLA:TPU says a program needs when it refuses it for HBM ("the total
    memory required for HLO temporaries (4.79T) exceeds available HBM (95.73G)"), in bytes;
    None for any other error."""
    import re

    m = re.search(r"HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM", message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def _shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs."""
    import math

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))
