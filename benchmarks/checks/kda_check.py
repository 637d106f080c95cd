"""The fused KDA kernels on the GPU against float64 (correctness, not speed), each error judged.

    python -m benchmarks.checks.kda_check [--json out.json] [--quick] [--alike] [--tune ';intra_split=1']

The CPU tests run the same kernels in the Pallas interpreter; this runs them compiled by Triton
at production head dims, with padding (T % 64 != 0), three packed documents in a row, an
initial state, fp32 and bf16 inputs. Every figure is max |a - ref| / max |ref| against float64:
outputs and final state against the token loop (tests/reference.py), gradients against float64
autodiff of the token recurrence (`recurrent_kda` in x64). The XLA chunk form's errors against
the same references are reported beside the kernel's (what the other implementation costs).

Limits (benchmarks/checks/verdict.py, `LIMITS`):
- fp32 inputs: the kernels multiply in fp32 (IEEE) and accumulate K- and C-term sums in fp32 a
  few times in a row: 4 K u_fp32 (3.1e-5 at K = 128). Seen: 4.5e-7 (o), 1.6e-6 (grads).
- bf16 inputs: the MMAs' operands are rounded to bf16, state and accumulation fp32. The output's
  longest path rounds 4 times (the state read as an operand, the corrected values v - w S, the
  intra-chunk scores, o itself): 4 u_bf16 = 1.6e-2. The backward adds the cotangents' roundings
  on the way back through the same products (dS, dv, the scores' cotangent, the gate's sums):
  6 u_bf16 = 2.3e-2.
A wrong scale, a dropped chunk or a transposed state moves o by far more (tests/test_check_kda.py
seeds each).

--alike: DeltaNet (the kernels' no-gate form) and gated DeltaNet with its gate at 0, keys and
queries sharing a direction (mean cosine ~0.8) and beta ~0.88, as in a trained layer: the inputs
whose UT inverse the old doubling series lost (the ladder's NaN), here with the H200's TF32/bf16
products. Gradients against float64 autodiff of the token recurrence; same limits.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests"))
from reference import delta_rule_loop  # noqa: E402

from benchmarks.bench_util import Rows  # noqa: E402
from benchmarks.checks.verdict import Verdicts, max_rel, rounding_limit  # noqa: E402
from k3jax.ops import (chunk_deltanet, chunk_gated_deltanet, chunk_kda, recurrent_gated_deltanet,  # noqa: E402
                       recurrent_kda)
from k3jax.ops.kda_inputs import kda_inputs  # noqa: E402
from k3jax.ops.kda_kernels import Tuning  # noqa: E402

CHECK = "kda"
GRAD_NAMES = ("q", "k", "v", "g", "beta", "h0")


def limits(dtype, K: int) -> dict:
    """{"out": (limit, why), "grad": (limit, why)} for inputs of `dtype` at head dim K."""
    if jnp.dtype(dtype) == jnp.float32:
        lim = rounding_limit("float32", 4 * K)
        why = f"fp32 products, K-term fp32 sums a few in a row: 4 K u_fp32 at K={K}"
        return {"out": (lim, why), "grad": (lim, why)}
    return {"out": (rounding_limit("bfloat16", 4), "4 x u_bf16: the state as an operand, v - w S, the scores, o"),
            "grad": (rounding_limit("bfloat16", 6), "6 x u_bf16: the forward's 4 and the cotangents' dS, dv")}


def inputs(seed, B, T, H, K, V):
    """`kda_inputs` and three packed documents in row 0 (row 1: one)."""
    seg = np.stack([np.repeat([0, 1, 2], [T // 4, T // 2, T - T // 4 - T // 2]), np.zeros(T, int)])[:B]
    return (*kda_inputs(seed, B, T, H, K, V), seg)


def _loss(fn, w_o, q, k, v, g, beta, s0, seg):
    o, S = fn(q, k, v, g, beta, s0, seg)
    return jnp.sum(o.astype(w_o.dtype) * w_o) + jnp.sum(S)


def reference(x, w_o):
    """Float64 truth on the (rounded) inputs x = (q, k, v, g, beta, s0, seg): (o, S, grads)."""
    q, k, v, g, beta, s0, seg = x
    xr = [np.asarray(jnp.asarray(t).astype(jnp.float32), np.float64) for t in (q, k, v, g, beta, s0)]
    o, S = delta_rule_loop(*xr[:5], initial_state=xr[5], segment_ids=seg)
    with jax.enable_x64(True):
        def rec(q, k, v, g, beta, s0, seg):
            return recurrent_kda(q, k, v, g, beta, initial_state=s0, segment_ids=seg, decay_bound=-5.0)
        grads = jax.jit(jax.grad(lambda *a: _loss(rec, jnp.asarray(w_o, jnp.float64), *a), argnums=range(6)))(
            *(jnp.asarray(t, jnp.float64) for t in xr), jnp.asarray(seg))
        grads = [np.asarray(t) for t in grads]
    return o, S, grads


@functools.lru_cache(maxsize=None)
def _compiled(impl, tuning: Tuning = Tuning()):
    """The jitted forward and gradient of chunk_kda[impl] (one per impl and tuning: a second call
    of the same shapes reuses its executable)."""
    def fn(q, k, v, g, beta, s0, seg):
        return chunk_kda(q, k, v, g, beta, initial_state=s0, segment_ids=seg, decay_bound=-5.0, impl=impl,
                         tuning=tuning)
    return jax.jit(fn), jax.jit(jax.grad(lambda w_o, *a: _loss(fn, w_o, *a), argnums=range(1, 7)))


def run(impl, x, w_o, tuning: Tuning = Tuning()):
    """(o, S, grads) of chunk_kda[impl] on x = (q, k, v, g, beta, s0, seg)."""
    fwd, grad = _compiled(impl, tuning)
    o, S = fwd(*x)
    return o, S, grad(w_o, *x)


def judge(case, got, ref, lim, verdicts, xla=None) -> dict:
    """The row of one case: errors of got = (o, S, grads) against ref, each judged."""
    o, S, grads = got
    row = dict(o_vs_f64=max_rel(o, ref[0]), S_vs_f64=max_rel(S, ref[1]),
               grads_vs_f64={n: max_rel(a, b) for n, a, b in zip(GRAD_NAMES, grads, ref[2])},
               finite=bool(all(np.isfinite(np.asarray(t, np.float32)).all() for t in (o, S, *grads))))
    if xla is not None:
        row.update(xla_o_vs_f64=max_rel(xla[0], ref[0]),
                   xla_grads_vs_f64={n: max_rel(a, b) for n, a, b in zip(GRAD_NAMES, xla[2], ref[2])})
    ok = verdicts.judge(case, "o_vs_f64", row["o_vs_f64"], *lim["out"])
    ok &= verdicts.judge(case, "S_vs_f64", row["S_vs_f64"], *lim["out"])
    for n, e in row["grads_vs_f64"].items():
        ok &= verdicts.judge(case, f"d{n}_vs_f64", e, *lim["grad"])
    row["pass"] = bool(ok)
    return row


def case_inputs(B, T, H, K, V, dt):
    """x = (q, k, v in dt; g, beta, s0 fp32; seg) and the output weights w_o of one case."""
    q, k, v, g, beta, s0, seg = inputs(0, B, T, H, K, V)
    w_o = jnp.asarray(np.random.default_rng(1).standard_normal((B, T, H, V)), jnp.float32)
    x = [jnp.asarray(t, dt) for t in (q, k, v)] + [jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32),
                                                   jnp.asarray(s0, jnp.float32), jnp.asarray(seg)]
    return x, w_o


def case_rows(cases, verdicts: Verdicts, with_xla: bool = True, tunings=("",)) -> Rows:
    """Each case at each kernel tuning (`Tuning.parse` strings; "" is the defaults)."""
    rows = Rows()
    for (B, T, H, K, V), dtypes in cases:
        for dt in dtypes:
            x, w_o = case_inputs(B, T, H, K, V, dt)
            ref = reference(x, w_o)
            xla = run("xla", x, w_o) if with_xla else None
            for tune in tunings:
                t0 = time.perf_counter()
                got = run("pallas", x, w_o, Tuning.parse(tune))
                compile_s = time.perf_counter() - t0
                case = f"{jnp.dtype(dt).name} {B}x{T}x{H}x{K}x{V}" + (f" [{tune}]" if tune else "")
                row = dict(shape=[B, T, H, K, V], dtype=jnp.dtype(dt).name, tuning=tune or "default",
                           **judge(case, got, ref, limits(dt, K), verdicts, xla), compile_s=round(compile_s, 1))
                rows.add(row)
    return rows


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


def alike_rows(verdicts: Verdicts, B=2, T=1024, H=4, K=128):
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
            lim = limits(dt, K)
            case = f"alike {kind} {jnp.dtype(dt).name} {B}x{T}x{H}x{K}"
            row = dict(check="alike keys", kind=kind, shape=[B, T, H, K], dtype=jnp.dtype(dt).name,
                       o_vs_f64=max_rel(o, ref_o), S_vs_f64=max_rel(S, ref_S),
                       grads_vs_f64={n: max_rel(a_, b_) for n, a_, b_ in zip("q k v beta".split(), grads, ref_grads)},
                       finite=bool(all(np.isfinite(np.asarray(t, np.float32)).all() for t in grads)))
            ok = verdicts.judge(case, "o_vs_f64", row["o_vs_f64"], *lim["out"])
            ok &= verdicts.judge(case, "S_vs_f64", row["S_vs_f64"], *lim["out"])
            for n, e in row["grads_vs_f64"].items():
                ok &= verdicts.judge(case, f"d{n}_vs_f64", e, *lim["grad"])
            row["pass"] = bool(ok)
            rows.add(row)
    return rows


def _alike_loss(fn, q, k, v, g, beta, w):
    o, S = fn(q, k, v, g, beta)
    return jnp.sum(o.astype(jnp.float32 if o.dtype != jnp.float64 else o.dtype) * w) + jnp.sum(S * S)


CASES = [((2, 300, 2, 128, 128), (jnp.float32, jnp.bfloat16)), ((2, 200, 3, 64, 128), (jnp.bfloat16,))]
QUICK = [((2, 300, 2, 128, 128), (jnp.bfloat16,))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="bf16 at one shape only")
    ap.add_argument("--alike", action="store_true", help="only the alike-keys check of DeltaNet / gated DeltaNet")
    ap.add_argument("--no-xla", action="store_true", help="without the XLA form's errors beside the kernel's (faster)")
    ap.add_argument("--tune", default="", help="';'-separated kernel tunings to check (k3jax.ops.kda_kernels.Tuning), "
                    "e.g. ';intra_split=1' (the defaults and one variant)")
    a = ap.parse_args(argv)
    try:
        Tuning.parse_list(a.tune)
    except ValueError as e:
        ap.error(str(e))
    verdicts = Verdicts(CHECK)
    rows = alike_rows(verdicts) if a.alike else case_rows(QUICK if a.quick else CASES, verdicts, with_xla=not a.no_xla,
                                                          tunings=tuple(a.tune.split(";")))
    rows.write(a.json)
    return verdicts.exit_code()


if __name__ == "__main__":
    sys.exit(main())
