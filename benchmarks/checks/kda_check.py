"""The fused KDA kernels on the GPU against float64 and the XLA form (correctness, not speed).

    python -m benchmarks.checks.kda_check [--json out.json] [--quick] [--alike]

The CPU tests run the same kernels in the Pallas interpreter; this runs them compiled by Triton
at production head dims, with padding (T % 64 != 0), three packed documents in a row, an
initial state, fp32 and bf16 inputs. Prints relative errors: outputs against a float64 loop,
gradients against the XLA form's autodiff.

--alike: DeltaNet (the kernels' no-gate form) and gated DeltaNet with its gate at 0, keys and
queries sharing a direction (mean cosine ~0.8) and beta ~0.88, as in a trained layer: the inputs
whose UT inverse the old doubling series lost (the ladder's NaN), here with the H200's TF32/bf16
products. Gradients against float64 autodiff of the token recurrence.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
from reference import delta_rule_loop, rel_err  # noqa: E402

from benchmarks.bench_util import Rows  # noqa: E402
from k3jax.ops import chunk_deltanet, chunk_gated_deltanet, chunk_kda, recurrent_gated_deltanet  # noqa: E402
from k3jax.ops.kda_inputs import kda_inputs  # noqa: E402


def inputs(seed, B, T, H, K, V):
    """`kda_inputs` and three packed documents in row 0 (row 1: one)."""
    seg = np.stack([np.repeat([0, 1, 2], [T // 4, T // 2, T - T // 4 - T // 2]), np.zeros(T, int)])[:B]
    return (*kda_inputs(seed, B, T, H, K, V), seg)


def alike_inputs(seed, B, T, H, K, cosine=0.8):
    rng = np.random.default_rng(seed)

    def unit():
        shared = rng.standard_normal(K)
        x = np.sqrt(cosine) * shared / np.linalg.norm(shared) + np.sqrt(1 - cosine) * rng.standard_normal(
            (B, T, H, K)) / np.sqrt(K)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q, k = unit(), unit()
    v = rng.standard_normal((B, T, H, K))
    beta = 1 / (1 + np.exp(-(2.0 + 0.5 * rng.standard_normal((B, T, H)))))
    return q, k, v, beta, rng.standard_normal((B, T, H, K))


def alike_rows(B=2, T=1024, H=4, K=128):
    """DeltaNet and gated DeltaNet (gate 0) with alike keys: fused kernels vs float64."""
    q, k, v, beta, w = alike_inputs(0, B, T, H, K)
    g = np.zeros((B, T, H))
    with jax.enable_x64(True):
        ref_grads = jax.jit(jax.grad(lambda *x: _alike_loss(recurrent_gated_deltanet, *x), argnums=(0, 1, 2, 4)))(
            *map(jnp.asarray, (q, k, v, g, beta, w)))
    ref_o, ref_S = delta_rule_loop(q, k, v, None, beta, decay=None)
    rows = Rows()
    for kind in ("deltanet", "gated_deltanet"):
        for dt in (jnp.float32, jnp.bfloat16):
            if kind == "deltanet":
                def fn(q, k, v, g, beta, impl="pallas"):
                    return chunk_deltanet(q, k, v, beta, impl=impl)
            else:
                def fn(q, k, v, g, beta, impl="pallas"):
                    return chunk_gated_deltanet(q, k, v, g, beta, decay_bound=-5.0, impl=impl)
            x = [jnp.asarray(t, dt) for t in (q, k, v)] + [jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32),
                                                           jnp.asarray(w, jnp.float32)]
            o, S = jax.jit(fn)(*x[:5])
            grads = jax.jit(jax.grad(lambda *x: _alike_loss(fn, *x), argnums=(0, 1, 2, 4)))(*x)
            row = dict(check="alike keys", kind=kind, shape=[B, T, H, K], dtype=jnp.dtype(dt).name,
                       o_vs_f64=rel_err(o, ref_o), S_vs_f64=rel_err(S, ref_S),
                       grads_vs_f64={n: rel_err(a_, b_) for n, a_, b_ in zip("q k v beta".split(), grads, ref_grads)},
                       finite=bool(all(np.isfinite(np.asarray(t, np.float32)).all() for t in grads)))
            rows.add(row)
    return rows


def _alike_loss(fn, q, k, v, g, beta, w):
    o, S = fn(q, k, v, g, beta)
    return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(S * S)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="bf16 at one shape only")
    ap.add_argument("--alike", action="store_true", help="only the alike-keys check of DeltaNet / gated DeltaNet")
    a = ap.parse_args()
    if a.alike:
        rows = alike_rows()
        rows.write(a.json)
        return
    rows = Rows()
    cases = [((2, 300, 2, 128, 128), (jnp.float32, jnp.bfloat16)), ((2, 200, 3, 64, 128), (jnp.bfloat16,))]
    if a.quick:
        cases = [((2, 300, 2, 128, 128), (jnp.bfloat16,))]
    for (B, T, H, K, V), dtypes in cases:
        q, k, v, g, beta, s0, seg = inputs(0, B, T, H, K, V)
        rng = np.random.default_rng(1)
        w_o = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
        for dt in dtypes:
            x = [jnp.asarray(t, dt) for t in (q, k, v)] + [jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32),
                                                           jnp.asarray(s0, jnp.float32), jnp.asarray(seg)]
            def run(impl, *x):
                return chunk_kda(*x[:5], initial_state=x[5], segment_ids=x[6], decay_bound=-5.0, impl=impl)

            def loss(impl, *x):
                o, S = run(impl, *x)
                return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(S)

            t0 = time.perf_counter()
            o, S = jax.jit(run, static_argnums=0)("pallas", *x)
            fwd_s = time.perf_counter() - t0
            xr = [np.asarray(t.astype(jnp.float32), np.float64) for t in x[:3]]
            ref_o, ref_S = delta_rule_loop(*xr, g, beta, initial_state=s0, segment_ids=seg)
            t0 = time.perf_counter()
            gp = jax.jit(jax.grad(loss, argnums=range(1, 7)), static_argnums=0)("pallas", *x)
            bwd_s = time.perf_counter() - t0
            gx = jax.jit(jax.grad(loss, argnums=range(1, 7)), static_argnums=0)("xla", *x)
            ox, _ = jax.jit(run, static_argnums=0)("xla", *x)
            row = dict(shape=[B, T, H, K, V], dtype=jnp.dtype(dt).name, o_vs_f64=rel_err(o, ref_o),
                       S_vs_f64=rel_err(S, ref_S), xla_o_vs_f64=rel_err(ox, ref_o),
                       grads_vs_xla={n: rel_err(a_, b_) for n, a_, b_ in zip("q k v g beta h0".split(), gp, gx)},
                       finite=bool(all(np.isfinite(np.asarray(t, np.float32)).all() for t in gp)),
                       compile_fwd_s=round(fwd_s, 1), compile_bwd_s=round(bwd_s, 1))
            rows.add(row)
    rows.write(a.json)


if __name__ == "__main__":
    main()
