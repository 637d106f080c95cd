"""XLA flags the trainer sets on GPUs before the backend starts.

XLA:GPU schedules without its latency-hiding scheduler by default: a collective's start and done
end up next to each other (most become synchronous), so nothing runs under the expert-parallel
exchange, the FSDP all-gathers or the tensor-parallel reductions. With the scheduler, XLA moves
independent GEMMs between a collective's start and done: benchmarks/a2a_schedule.py shows the
compiled schedule both ways (BENCHMARKS.md). A flag already in XLA_FLAGS wins.
"""

from __future__ import annotations

import os

GPU_SCHEDULER_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    # not "xla_gpu_enable_analytical_latency_estimator": in jax 0.11.2 it aborts the compile of
    # K3's whole train step (configs/k3.yaml on 2,048 H200s, compiled deviceless on 2026-12-01:
    # "Check failed: buffer != nullptr" in GpuPerformanceModel's launch dimensions of a fusion,
    # called from AnalyticalLatencyEstimator::NodeCost); XLA's default estimator schedules it
}


def set_gpu_scheduler_flags(environ=os.environ) -> str:
    """Append GPU_SCHEDULER_OPTIONS to XLA_FLAGS (those it does not set already); returns the
    new value. Harmless on CPU and TPU (XLA parses, and ignores, GPU flags there)."""
    flags = environ.get("XLA_FLAGS", "")
    extra = [f"--{k}={str(v).lower()}" for k, v in GPU_SCHEDULER_OPTIONS.items() if f"--{k}=" not in flags]
    environ["XLA_FLAGS"] = " ".join(filter(None, [flags] + extra))
    return environ["XLA_FLAGS"]
