"""The experts' GLU backward on the GPU: autodiff's XLA fusions, the one-fusion XLA form and the
Pallas kernel.

    python -m benchmarks.ops.glu_grad --json out.json [--profile DIR]

k3-small's shape per MoE layer: gate|up [262,144, 1024] bf16 (32,768 tokens x top-8, H = 512),
SiTU-GLU. ms per call after two warm-ups, of d(gate|up) given dh: autodiff's form (jax.vjp of
`apply_glu` on the two halves, as the kernel path ran it before 2026-12-02 night: `xla_ms`),
`k3jax.ops.glu_grad.glu_grad_xla` (the default, model.moe.glu_grad=xla: `fused_ms`) and
`k3jax.ops.glu_grad.glu_grad` (the kernel: `kernel_ms`); each result against autodiff's
(max |a - b| / max |b|).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.activations import apply_glu
from k3jax.ops.glu_grad import glu_grad, glu_grad_xla
from benchmarks.bench_util import ms_per_call, profiled, rel_err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=262144)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--json", required=True)
    ap.add_argument("--profile", default=None, help="a jax.profiler trace of each form: DIR/xla, DIR/fused, DIR/kernel")
    a = ap.parse_args()
    M, H = a.rows, a.hidden
    spec = ("situ", 4.0, 25.0)
    ks = jax.random.split(jax.random.key(0), 2)
    gu = (jax.random.normal(ks[0], (M, 2 * H), jnp.float32) * 3).astype(jnp.bfloat16)
    dh = jax.random.normal(ks[1], (M, H), jnp.bfloat16)
    xla = jax.jit(lambda gu, dh: jax.vjp(lambda x: apply_glu(spec, x[:, :H], x[:, H:]), gu)[1](dh)[0])
    fused = jax.jit(lambda gu, dh: glu_grad_xla(gu, dh, spec))
    kernel = jax.jit(lambda gu, dh: glu_grad(gu, dh, spec, interpret=jax.default_backend() != "gpu"))
    want = xla(gu, dh)
    out = {"device": jax.devices()[0].device_kind, "shape": [M, 2 * H],
           "xla_ms": ms_per_call(xla, gu, dh, iters=20), "fused_ms": ms_per_call(fused, gu, dh, iters=20),
           "kernel_ms": ms_per_call(kernel, gu, dh, iters=20),
           "rel_err": rel_err(kernel(gu, dh), want), "fused_rel_err": rel_err(fused(gu, dh), want),
           "bytes_min_gb": (M * 2 * H * 2 * 2 + M * H * 2) / 1e9}
    print(out, flush=True)
    if a.profile:
        profiled(xla, gu, dh, trace_dir=f"{a.profile}/xla")
        profiled(fused, gu, dh, trace_dir=f"{a.profile}/fused")
        profiled(kernel, gu, dh, trace_dir=f"{a.profile}/kernel")
    with open(a.json, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
