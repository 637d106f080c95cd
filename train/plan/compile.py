"""k3jax-plan's measurement on the target: the real sharded train step, compiled by the target's
own compiler for a topology of the mesh's size, and what its memory peak holds.

    m = compile_train_step(cfg, CHIPS["h200"], 2048)
    m.arguments, m.temporaries, m.outputs_not_aliased, m.total     # bytes per device
    m.peak_terms                                                   # [(name, bytes)], largest first

The program is one device's share of `train.setup.prepare(cfg, mesh).train_step(cfg)` (the
step the CLI runs: micro-batches, the optimizer update, QB, every collective the mesh needs),
lowered on abstract inputs over compile-only devices (`train.plan.target`) and compiled with
the target's compiler; nothing is allocated. The figures are XLA:GPU's or XLA:TPU's own buffer
assignment, read from its dump in a child process that is stopped there, before the machine
code (`figures_from` says which; the same bytes `memory_analysis()` reports, checked on k3.yaml
for XLA:GPU and on k3-tiny for both compilers; XLA:TPU's whole compile of k3.yaml ran for over
45 minutes here without finishing, its buffer assignment is written after about 10). The peak's terms come
from XLA's live-range dump (`train.plan.breakdown`), named by the code that made each buffer.

Kernels the target compiler cannot build without the device attached (tokamax's Mosaic-GPU
flash attention and grouped GEMM) are traced through stand-ins that keep what they keep
(`k3jax.ops.planning`); the fused KDA kernels are Triton and compile for real.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import jax

from k3jax.chips import Chip
from k3jax.config.schema import replace
from k3jax.ops.planning import planning_for
from k3jax.sharding.mesh import AXES, mesh_shape
from train.plan.breakdown import peak_breakdown
from train.plan.target import target_mesh
from train.setup import prepare
from train.xla_flags import GPU_XLA_OPTIONS  # the flags k3jax-train runs with

# XLA:GPU options for a program that is only measured, where it is compiled to the end
# (to_the_end=True, or a small program whose child finishes before its dump is read):
# unoptimised LLVM IR and ptxas -O0. Buffer assignment (the plan's figure) is fixed before code
# generation, which took 9 of k3.yaml's 25 minutes of plan (dump timestamps, 2026-12-01)
PLAN_CODEGEN_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                        "xla_gpu_disable_gpuasm_optimizations": True}

# Without a GPU, XLA:GPU's fusion autotuner measures nothing: it compiled each of the step's
# ~2,000 generic fusions to machine code (ptxas) only to record the native emitter's default
# config, 9.3 of k3.yaml's 25 minutes (per-pass timers, 2026-12-01). Off, the buffer assignment
# and live ranges are the same bytes (their dumps compared with diff, k3.yaml's widths and mesh
# at 25 layers): the fusions and their emitters are the same, only the recorded config differs
PLAN_AUTOTUNE_OPTIONS = {"xla_gpu_experimental_enable_fusion_autotuner": False}

PROJECT_ROOTS = (os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),)  # the repository


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
    figures_from: str = "memory_analysis()"  # or the buffer-assignment dump of a compile stopped there
    fusion_autotuner: bool = False  # XLA:GPU's fusion autotuner was on (a fusion needed it: compile_lowered)
    unsharded_kernels: tuple[str, ...] = ()  # kernels outside any shard_map: operands whole (kernels.py)

    @property
    def total(self) -> int:
        return self.arguments + self.temporaries + self.outputs_not_aliased


def compile_train_step(cfg, chip: Chip, num_devices: int, *, batch: int | None = None, seq: int | None = None,
                       breakdown: bool = True, dump_dir: str | None = None,
                       to_the_end: bool = False) -> TargetCompile:
    """Compile `cfg`'s train step for `num_devices` of `chip` (mesh from cfg.mesh) on this
    machine with the chip's compiler, and read its memory. dump_dir: keep XLA's dump of the
    compiled step there (HLO, buffer assignment, live ranges) for a closer look.

    The compile runs in a child process that is stopped once XLA has dumped its buffer
    assignment (`figures_from` says so): the figures are that assignment's allocations, the
    same bytes `memory_analysis()` reads from the finished executable, without the machine code
    (on a GPU LLVM, ptxas, Triton: 9 of the 25 minutes of k3.yaml's plan; XLA:TPU's backend
    did not finish k3.yaml in 45), which cannot change them (XLA:TPU: but for a few MB, see
    `buffer_assignment_figures`). to_the_end=True compiles to the end in this process and reads
    `memory_analysis()`."""
    changes = {}
    if batch is not None and batch != cfg.train.batch_size:
        changes["train.batch_size"] = batch
    if seq is not None and seq != cfg.data.seq_len:
        changes["data.seq_len"] = seq
    cfg = replace(cfg, **changes) if changes else cfg
    topology = chip.gpu_topology(num_devices) if chip.platform == "gpu" else chip.tpu_topology(num_devices)
    compiler = "XLA:GPU" if chip.platform == "gpu" else "XLA:TPU"
    with tempfile.TemporaryDirectory(prefix="k3jax-plan-") as tmp:
        dump = dump_dir or os.path.join(tmp, "dump")
        if not to_the_end:
            figures, lower_s, compile_s, source, fusion_autotuner, unsharded = _compile_in_child(
                cfg, chip, num_devices, dump, tmp, keep_log=dump_dir is not None)
        else:
            t0 = time.perf_counter()
            setup, lowered = _lower(cfg, chip, num_devices)
            unsharded = _unsharded(lowered, num_devices)
            t1 = time.perf_counter()
            try:
                compiled, fusion_autotuner = compile_lowered(lowered, chip, dump)
            except jax.errors.JaxRuntimeError as e:
                # XLA:TPU refuses a program whose temporaries exceed the chip's HBM instead of
                # compiling it: the figure it names is the plan's answer
                temporaries = hbm_overflow_bytes(str(e))
                if temporaries is None:
                    raise
                return TargetCompile(
                    compiler=compiler, devices=num_devices, topology=topology,
                    arguments=_shard_bytes(setup.abstract_args(cfg)), temporaries=temporaries,
                    outputs_not_aliased=0, peak_terms=(), lower_s=t1 - t0, compile_s=time.perf_counter() - t1,
                    figures_from="XLA:TPU's refusal over HBM (the temporaries it names)",
                    unsharded_kernels=tuple(unsharded))
            compile_s = time.perf_counter() - t1
            figures, lower_s, source = memory_figures(compiled), t1 - t0, "memory_analysis()"
        terms = ()
        if breakdown:
            _, named = peak_breakdown(dump, PROJECT_ROOTS, module_glob="*jit_step*")
            terms = tuple(named)
    return TargetCompile(compiler=compiler, devices=num_devices, topology=topology, peak_terms=terms,
                         lower_s=lower_s, compile_s=compile_s, figures_from=source,
                         fusion_autotuner=fusion_autotuner, unsharded_kernels=tuple(unsharded), **figures)


def _lower(cfg, chip: Chip, num_devices: int):
    """(setup, lowered): the sharded train step lowered on abstract inputs over compile-only devices."""
    sizes = mesh_shape(cfg.mesh, num_devices)
    mesh = target_mesh(chip, num_devices, tuple(sizes[a] for a in AXES), AXES)
    with planning_for(chip.platform, target_compiler=True):
        setup = prepare(cfg, mesh=mesh)
        with jax.set_mesh(mesh):
            return setup, setup.train_step(cfg).lower(*setup.abstract_args(cfg))


def _unsharded(lowered, num_devices: int) -> list[str]:
    """The kernels of the lowered step that run outside any shard_map (`train.plan.kernels`):
    on more than one device each would take its operands whole."""
    if num_devices <= 1:
        return []
    from train.plan.kernels import unsharded_kernels

    return unsharded_kernels(lowered.as_text())


def compile_options(chip: Chip, dump: str, fusion_autotuner: bool = False) -> dict:
    """XLA options of the plan's compile: dump the step (the breakdown reads it) and, on a GPU,
    the schedule k3jax-train runs with, without work that cannot change the buffer assignment."""
    options = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": "jit_step"}
    if chip.platform == "gpu":
        options |= GPU_XLA_OPTIONS | PLAN_CODEGEN_OPTIONS
        if not fusion_autotuner:
            options |= PLAN_AUTOTUNE_OPTIONS
    return options


def compile_lowered(lowered, chip: Chip, dump: str, on_retry=lambda: None):
    """(compiled, fusion_autotuner): `lowered` compiled with `compile_options`. On a GPU the
    fusion autotuner is off unless the compile needs it: it is also what offers XLA:GPU's native
    emitter to a GEMM fusion Triton cannot tile ("No supported config found", k3-small's step at
    8 x 4096), and then the step is compiled again with it (minutes, not the whole plan)."""
    try:
        return lowered.compile(compiler_options=compile_options(chip, dump)), False
    except jax.errors.JaxRuntimeError as e:
        if chip.platform != "gpu" or "No supported config found" not in str(e):
            raise
    on_retry()
    return lowered.compile(compiler_options=compile_options(chip, dump, fusion_autotuner=True)), True


def memory_figures(compiled) -> dict:
    """arguments, temporaries, outputs_not_aliased of a compiled program (memory_analysis())."""
    ma = compiled.memory_analysis()
    return {"arguments": int(ma.argument_size_in_bytes), "temporaries": int(ma.temp_size_in_bytes),
            "outputs_not_aliased": max(0, int(ma.output_size_in_bytes) - int(ma.alias_size_in_bytes))}


# ------------------------------------------------------------------------------------------
# the compile in a child process, stopped after buffer assignment

_ALLOCATION = re.compile(r"^allocation \d+: size (\d+),(.*)$")
HOST_MEMORY_SPACE = 5  # xla::Layout::kHostMemorySpace: a buffer in host memory, not the device's


def buffer_assignment_figures(text: str) -> dict:
    """arguments, temporaries, outputs_not_aliased in bytes from XLA's buffer-assignment dump
    (`*after_optimizations-buffer-assignment.txt`), counted as `memory_analysis()` counts the
    executable's allocations (XLA's CompiledMemoryStats::PopulateBufferStatsFromAllocations):
    entry parameters are arguments, preallocated temporaries (every device memory colour:
    XLA:GPU keeps the collectives' buffers in colour 1) are temporaries, maybe-live-out
    allocations are outputs; an output in a parameter's allocation is aliased to that donated
    input. Allocations in host memory are left out, as memory_analysis() reports them apart.
    XLA:TPU: memory_analysis() counts its colour 1 too (22 MB of k3-tiny's 95 MB, 50 MB of
    k3.yaml's 63 GB), so it is counted here; XLA:TPU then adds a few MB after buffer assignment
    that the dump does not hold (k3-tiny for 4 v5p chips: 7.9 MB of 52.9 at batch 8, 0.5 of
    95.2 at batch 32)."""
    arguments = temporaries = outputs = aliased = 0
    for line in text.splitlines():
        m = _ALLOCATION.match(line)
        if not m:
            continue
        size, attrs = int(m.group(1)), m.group(2)
        head = attrs.split(" shape |")[0]  # the attributes before any printed shape
        tail = attrs.rsplit("|", 1)[-1]     # ... and after it
        colour = re.search(r"\bcolor (\d+)", head)
        if colour and int(colour.group(1)) == HOST_MEMORY_SPACE:
            continue
        parameter = re.search(r"\bparameter \d+", head) is not None
        live_out = "maybe-live-out" in tail
        arguments += size if parameter else 0
        aliased += size if parameter and live_out else 0
        outputs += size if live_out else 0
        temporaries += size if "preallocated-temp" in tail else 0
    return {"arguments": arguments, "temporaries": temporaries, "outputs_not_aliased": outputs - aliased}


def _buffer_assignment_dump(dump: str, since: float, last_sizes: dict, final: bool = False) -> str | None:
    """The buffer-assignment file of the step's dump once XLA has written it and the optimized
    HLO beside it in whole (the breakdown reads both): present, written after `since`, the same
    size as at the last call (unless `final`: the compile has ended), and the HLO ends with its
    entry computation's closing brace."""
    hlo = [p for p in glob.glob(os.path.join(dump, "*jit_step*after_optimizations.txt")) if os.path.getmtime(p) >= since]
    if not hlo:
        return None
    base = max(hlo, key=os.path.getmtime)[:-len(".txt")]
    files = [base + ".txt", base + "-buffer-assignment.txt", base + "-memory-usage-report.txt"]
    if any(not os.path.exists(f) or os.path.getmtime(f) < since for f in files):
        return None
    sizes = {f: os.path.getsize(f) for f in files}
    stable = final or sizes == last_sizes
    last_sizes.clear()
    last_sizes.update(sizes)
    if not stable:
        return None
    with open(base + ".txt", "rb") as f:
        f.seek(max(0, sizes[base + ".txt"] - 64))
        if not f.read().rstrip().endswith(b"}"):
            return None
    return base + "-buffer-assignment.txt"


def _compile_in_child(cfg, chip: Chip, num_devices: int, dump: str, tmp: str, keep_log: bool = False,
                      poll_s: float = 1.0) -> tuple[dict, float, float, str, bool]:
    """Lower and compile the step in a child process (`_child_main`); return its figures from
    XLA:GPU's buffer-assignment dump as soon as that is written, and stop the child there
    (from memory_analysis() only if the child ends without a dump, as on a compilation-cache
    hit). keep_log: the child's log (XLA's messages) goes beside the dump, else it is dropped
    unless the compile fails. -> (figures, lower_s, compile_s, source, fusion_autotuner,
    unsharded kernels)"""
    job = os.path.join(tmp, "job")
    os.makedirs(job)
    with open(os.path.join(job, "job.pkl"), "wb") as f:
        pickle.dump({"cfg": cfg, "chip": chip.name, "devices": num_devices, "dump": dump}, f)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PROJECT_ROOTS[0]] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if "JAX_PLATFORMS" not in env and jax.config.jax_platforms:
        env["JAX_PLATFORMS"] = jax.config.jax_platforms  # as this process chose (train.plan.cli)
    if chip.platform == "tpu":
        # libtpu takes a machine-wide lock on load, which this process may hold already (its
        # compiler was probed here); a compile-only client touches no TPU, so two may load it
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    log_path = os.path.join(dump if keep_log else job, "k3jax-plan-compile.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    since = time.time() - 1.0
    with open(log_path, "wb") as log:
        child = subprocess.Popen([sys.executable, "-c", f"from train.plan.compile import _child_main; "
                                  f"_child_main({job!r}, {os.getpid()})"],
                                 env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    lowered_at, last_sizes = None, {}
    try:
        while True:
            exited = child.poll() is not None
            lowered = _read_json(os.path.join(job, "lowered.json"))
            unsharded = (lowered or {}).get("unsharded_kernels", [])
            if lowered is not None and lowered_at is None:
                lowered_at = time.perf_counter()
            ba = _buffer_assignment_dump(dump, since, last_sizes, final=exited) if lowered is not None else None
            if ba is not None:
                with open(ba) as f:
                    figures = buffer_assignment_figures(f.read())
                return (figures, lowered["lower_s"], time.perf_counter() - lowered_at,
                        "XLA's buffer assignment (compile stopped before code generation)",
                        os.path.exists(os.path.join(job, "retry.json")), unsharded)
            result = _read_json(os.path.join(job, "result.json"))
            if result is not None and exited and "refused" in result:  # XLA:TPU: over HBM, before its dump
                return (result["refused"], result["lower_s"], result["compile_s"],
                        "XLA:TPU's refusal over HBM (the temporaries it names)", False, unsharded)
            if result is not None and exited:  # compiled to the end without a dump to read (a cache hit)
                return (result["figures"], result["lower_s"], result["compile_s"], "memory_analysis()",
                        result["fusion_autotuner"], unsharded)
            if exited:
                with open(log_path, "rb") as f:
                    tail = f.read()[-4000:].decode(errors="replace")
                raise RuntimeError(f"the {chip.platform.upper()} compile of the train step failed "
                                   f"(exit {child.returncode}); its log ends:\n{tail}")
            time.sleep(poll_s)
    finally:
        if child.poll() is None:
            try:
                os.killpg(child.pid, signal.SIGKILL)  # the child and the assemblers (ptxas) it started
            except ProcessLookupError:
                pass
            child.wait()


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)  # whole, or not at all, for the parent's polls


def _child_main(job: str, parent: int) -> None:
    """The child of `_compile_in_child`: lower, say so, compile; exits when the parent does."""
    import threading

    def orphaned():  # the parent gone (killed), nothing will read the compile: stop it
        while os.getppid() == parent:
            time.sleep(2)
        os._exit(3)

    threading.Thread(target=orphaned, daemon=True).start()
    from k3jax.chips import CHIPS

    with open(os.path.join(job, "job.pkl"), "rb") as f:
        spec = pickle.load(f)
    chip = CHIPS[spec["chip"]]
    t0 = time.perf_counter()
    setup, lowered = _lower(spec["cfg"], chip, spec["devices"])
    t1 = time.perf_counter()
    _write_json(os.path.join(job, "lowered.json"), {"lower_s": t1 - t0,
                                                    "unsharded_kernels": _unsharded(lowered, spec["devices"])})
    try:
        compiled, fusion_autotuner = compile_lowered(
            lowered, chip, spec["dump"], on_retry=lambda: _write_json(os.path.join(job, "retry.json"), {}))
    except jax.errors.JaxRuntimeError as e:
        temporaries = hbm_overflow_bytes(str(e))  # XLA:TPU refuses a program over HBM (compile_train_step)
        if temporaries is None:
            raise
        _write_json(os.path.join(job, "result.json"), {
            "refused": {"arguments": _shard_bytes(setup.abstract_args(spec["cfg"])), "temporaries": temporaries,
                        "outputs_not_aliased": 0},
            "lower_s": t1 - t0, "compile_s": time.perf_counter() - t1})
        return
    _write_json(os.path.join(job, "result.json"), {"figures": memory_figures(compiled), "lower_s": t1 - t0,
                                                   "compile_s": time.perf_counter() - t1,
                                                   "fusion_autotuner": fusion_autotuner})


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
