"""The expert-parallel exchange on real GPUs: correctness of every hop against one device, then its time.

1. Correctness (fp32): `routed_experts_sharded` against `routed_experts_dropless` (output and
   gradients) on every mesh the GPUs allow, with nodes emulated by moe.ep_devices_per_node
   (2 GPUs: the network hop alone, the node hop alone; 8 GPUs: both hops with NCCL replica
   groups, tensor 2 sharing rows and weights), ragged and capacity; and the MXFP8 wire bit for
   bit against the compute-dtype wire (bf16, qat). CPU tests only see an emulated ragged
   all-to-all: this is the real one.
2. Time (bf16): one MoE layer's routed experts, forward + backward, at one device's K3 shapes
   (tokens per device, latent 3584, hidden 3072, top-16, 14 experts per device), 1 and 2
   chunks, with XLA's latency-hiding scheduler on (train/xla_flags.py). Median of 10 steps after
   2 warm-up steps, plus an xprof trace of 3 steps for the overlap.

    OUT=out python -m benchmarks.ops.ep_exchange [--tokens 8192] [--skip-time]

Writes $OUT/ep_exchange.json and $OUT/trace/ (the profile). Needs >= 2 GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from train.xla_flags import set_gpu_xla_flags

set_gpu_xla_flags()  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax.config import MeshConfig  # noqa: E402
from k3jax.layers.expert_parallel import routed_experts_sharded  # noqa: E402
from k3jax.layers.moe import routed_experts_dropless  # noqa: E402
from k3jax.ops.mx import ExpertQuant  # noqa: E402
from k3jax.sharding import make_mesh  # noqa: E402

GLU = ("situ", 4.0, 25.0)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def inputs(N, E, k, l, H, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.standard_normal((N, l)), dtype)
    idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    w = jnp.asarray(rng.random((N, k)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.05, jnp.float32) for s in ((E, l, H), (E, l, H), (E, H, l))]
    return z, idx, w, ws


def cases(n):
    """(name, mesh sizes, devices per node, tensor mode) for n GPUs."""
    out = [("network hop", dict(data=n // 2, expert=2), 1, "auto"),
           ("node hop", dict(data=n // 2, expert=2), 2, "auto")]
    if n >= 8:
        out += [("both hops (replica groups)", dict(data=2, expert=4), 2, "auto"),
                ("both hops, tensor 2 rows", dict(expert=4, tensor=2), 4, "rows"),
                ("both hops, tensor 2 weights", dict(expert=4, tensor=2), 4, "weights")]
    return out


def correctness(n):
    results = []
    z, idx, w, (w1, w3, w2) = inputs(64 * n, 16, 4, 64, 64)

    def loss(fn):
        return jax.value_and_grad(lambda z, w, w1: (lambda u: (jnp.sum(u[0] ** 2), u))(fn(z, w, w1)),
                                  argnums=(0, 1, 2), has_aux=True)

    (_, (ref, _)), gr = jax.jit(loss(lambda z, w, w1: (routed_experts_dropless(z, idx, w, w1, w3, w2, GLU), 0.0)))(
        z, w, w1)
    for name, shape, per_node, tensor in cases(n):
        mesh = make_mesh(MeshConfig(**{"data": 1, **shape}))
        for dispatch in ("ragged", "capacity"):
            for chunks in (1, 2):
                f = loss(lambda z, w, w1: routed_experts_sharded(
                    z, idx, w, w1, w3, w2, GLU, jnp.float32, mesh=mesh, capacity_factor=8.0, dispatch=dispatch,
                    devices_per_node=per_node, tensor=tensor, chunks=chunks))
                with jax.set_mesh(mesh):
                    (_, (u, drop)), g = jax.jit(f)(z, w, w1)
                row = dict(case=name, mesh=shape, devices_per_node=per_node, dispatch=dispatch, chunks=chunks,
                           dropped=float(drop), out_rel_err=rel_err(u, ref),
                           grad_rel_err=[rel_err(a, b) for a, b in zip(g, gr)])
                row["ok"] = row["dropped"] == 0 and row["out_rel_err"] < 1e-5 and max(row["grad_rel_err"]) < 1e-5
                print(json.dumps(row), flush=True)
                results.append(row)
    # the MXFP8 wire, bit for bit against quantizing after a bf16 exchange
    name, shape, per_node, tensor = cases(n)[-1]
    mesh = make_mesh(MeshConfig(**{"data": 1, **shape}))
    zb = z.astype(jnp.bfloat16)

    def run(wire):
        return jax.value_and_grad(lambda z, w1: jnp.sum(routed_experts_sharded(
            z, idx, w, w1, w3, w2, GLU, jnp.bfloat16, mesh=mesh, capacity_factor=8.0, qat=ExpertQuant(), wire=wire,
            devices_per_node=per_node, tensor=tensor, chunks=2)[0].astype(jnp.float32) ** 2), argnums=(0, 1))(zb, w1)

    with jax.set_mesh(mesh):
        (a, ga), (b, gb) = jax.jit(lambda: (run("auto"), run("compute")))()
    same = bool(np.array_equal(np.asarray(a), np.asarray(b)) and all(
        np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32)) for x, y in zip(ga, gb)))
    print(json.dumps({"case": f"mxfp8 wire bit-exact ({name})", "ok": same}), flush=True)
    results.append({"case": f"mxfp8 wire bit-exact ({name})", "ok": same})
    return results


def timing(n, tokens, out_dir):
    """One device's K3 MoE shapes: `tokens` per device, 14 experts per device."""
    X = n
    E, k, l, H = 14 * X, 16, 3584, 3072
    keys = jax.random.split(jax.random.key(0), 6)
    z = jax.random.normal(keys[0], (tokens * n, l), jnp.bfloat16)
    idx = jnp.argsort(jax.random.uniform(keys[1], (tokens * n, E)), axis=-1)[:, :k].astype(jnp.int32)  # k distinct
    w = jax.random.uniform(keys[2], (tokens * n, k), jnp.float32)
    w1, w3 = (0.02 * jax.random.normal(kk, (E, l, H), jnp.float32) for kk in keys[3:5])
    w2 = 0.02 * jax.random.normal(keys[5], (E, H, l), jnp.float32)
    mesh = make_mesh(MeshConfig(data=1, expert=X))
    rows = []
    for chunks in (1, 2):
        f = jax.jit(jax.grad(lambda z, w1: jnp.sum(routed_experts_sharded(
            z, idx, w, w1, w3, w2, GLU, jnp.bfloat16, mesh=mesh, chunks=chunks, devices_per_node=1)[0]
                                                    .astype(jnp.float32) ** 2), argnums=(0, 1)))
        with jax.set_mesh(mesh):
            for _ in range(2):
                jax.block_until_ready(f(z, w1))
            times = []
            for _ in range(10):
                t0 = time.perf_counter()
                jax.block_until_ready(f(z, w1))
                times.append(time.perf_counter() - t0)
            if chunks == 2:
                jax.profiler.start_trace(os.path.join(out_dir, "trace"))
                for _ in range(3):
                    jax.block_until_ready(f(z, w1))
                jax.profiler.stop_trace()
        row = dict(chunks=chunks, tokens_per_device=tokens, experts_per_device=14,
                   median_ms=1e3 * float(np.median(times)), min_ms=1e3 * min(times))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per device for the timing")
    p.add_argument("--skip-time", action="store_true")
    a = p.parse_args(argv)
    out_dir = os.environ.get("OUT", "bench-out")
    os.makedirs(out_dir, exist_ok=True)
    n = jax.device_count()
    if n < 2:
        print("needs >= 2 GPUs", file=sys.stderr)
        return 2
    report = {"devices": n, "xla_flags": os.environ.get("XLA_FLAGS", ""), "correctness": correctness(n)}
    if not a.skip_time:
        report["timing"] = timing(n, a.tokens, out_dir)
    with open(os.path.join(out_dir, "ep_exchange.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    return 0 if all(r["ok"] for r in report["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
