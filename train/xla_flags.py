"""XLA flags the trainer sets on GPUs before the backend starts (`k3jax-train`, the benchmarks that
time its step, and the planner's compile for a GPU target). A flag already in XLA_FLAGS wins.

- The latency-hiding scheduler. XLA:GPU schedules without it by default: a collective's start
  and done end up next to each other (most become synchronous), so nothing runs under the
  expert-parallel exchange, the FSDP all-gathers or the tensor-parallel reductions. With it,
  XLA moves independent GEMMs between a collective's start and done
  (benchmarks/tools/a2a_schedule.py shows the compiled schedule both ways; BENCHMARKS.md).
- No dynamic-slice fusion. In jax 0.11.2's XLA, DynamicSliceFusionRewriterV2 makes a custom
  call whose result is stored into a scan's stacked buffer write it there directly, but when the
  result has other users too it keeps the original call for them: the kernel runs twice. In
  k3-small's step (the 2026-12-02 profile and its HLO, benchmarks/results/kernels-2026-12-03/1-*)
  that was every scanned layer's experts' gate|up grouped GEMM (12 extra launches, ~8 ms) and
  every scanned MLA layer's flash-attention forward (3, ~2.4 ms): outputs remat=save_dots keeps
  and the next op reads. (openxla/xla's later rewriter skips a result with more than one user.)
  Without the fusion each stored result is one in-place copy, and a slice a custom call or a
  collective reads (a layer's stored activations, a scanned layer's weight shard) is copied
  first: on one H200 the step is 8.6 ms faster without it (benchmarks/results/kernels-2026-12-03/
  README.md; 8.8 ms in BENCHMARKS.md §1). On many GPUs the copies are of per-device shards; not
  measured there.
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

GPU_XLA_OPTIONS = GPU_SCHEDULER_OPTIONS | {
    "xla_gpu_enable_dynamic_slice_fusion": False,  # the duplicated kernels above
}


def set_gpu_xla_flags(environ=os.environ) -> str:
    """Append GPU_XLA_OPTIONS to XLA_FLAGS (those it does not set already); returns the new
    value. Harmless on CPU and TPU (XLA parses, and ignores, GPU flags there)."""
    flags = environ.get("XLA_FLAGS", "")
    extra = [f"--{k}={str(v).lower()}" for k, v in GPU_XLA_OPTIONS.items() if f"--{k}=" not in flags]
    environ["XLA_FLAGS"] = " ".join(filter(None, [flags] + extra))
    return environ["XLA_FLAGS"]
