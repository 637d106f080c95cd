"""Kernels a sharded program runs outside a shard_map: each takes its operands whole on every device.

A Pallas (Triton) or Mosaic kernel is one device's program. Traced under a mesh but outside
`jax.shard_map`, it is opaque to XLA's SPMD partitioner, which then gathers every operand whole
onto each device and runs the kernel on all of it there. On 2026-12-02 the short-conv backward
did so, and k3.yaml's plan on 2,048 H200s grew from 117 to 656 GB per device
(benchmarks/results/k3-plan-2026-12-02/README.md). `unsharded_kernels` reads the lowered
program (StableHLO with shardy, as `jax.jit(...).lower(...).as_text()` prints it) and names the
kernels reachable from the entry without passing through an `sdy.manual_computation` (a shard_map's
body), directly or through the functions it calls.
"""

from __future__ import annotations

import collections
import re

KERNEL_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu", "tpu_custom_call")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_FUNC = re.compile(r"^\s*func\.func\s+(?:(?:public|private)\s+)?@([\w.$-]+)")
_CALL = re.compile(r"\bcall\s+@([\w.$-]+)\(")
_TARGET = re.compile(r"custom_call\s+@([\w.$-]+)\(")
_NAME = re.compile(r'\bname\s*=\s*"([^"]*)"')


def unsharded_kernels(text: str) -> list[str]:
    """The kernels (a Triton call's `name`, else its custom-call target) of the lowered program
    `text` that run outside every shard_map, in program order, once per call site."""
    calls = collections.defaultdict(list)  # callee -> [(caller, inside a manual computation)]
    kernels = []  # (function, inside a manual computation, name)
    func, depth, manual = None, 0, []  # manual: the depths at which the open manual regions began
    for raw in text.splitlines():
        line = _QUOTED.sub('""', raw)  # braces inside strings (a kernel's IR) do not nest
        m = _FUNC.match(line)
        if m:
            func, manual = m.group(1), []
        inside = bool(manual)
        for callee in _CALL.findall(line):
            calls[callee].append((func, inside))
        target = _TARGET.search(line)
        if target and target.group(1) in KERNEL_TARGETS:
            name = _NAME.search(raw)
            kernels.append((func, inside, name.group(1) if name else target.group(1)))
        if "sdy.manual_computation" in line and line.rstrip().endswith("{"):
            manual.append(depth)
        depth += line.count("{") - line.count("}")
        while manual and depth <= manual[-1]:
            manual.pop()
    # a function runs per shard when every call of it does: the largest such set (the entry,
    # called from nowhere, is not in it)
    per_shard = set(calls)
    changed = True
    while changed:
        changed = False
        for f in list(per_shard):
            if not all(inside or caller in per_shard for caller, inside in calls[f]):
                per_shard.discard(f)
                changed = True
    return [name for f, inside, name in kernels if not inside and f not in per_shard]
