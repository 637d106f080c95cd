"""MLA's training attention on GPU: the fused flash kernel against the dense-mask XLA form.

    python -m benchmarks.ops.attention [--json out.json] [--check-only]

At k3-small's MLA shape (12 heads, q/k head dim 192 = 128 nope + 64 rope, v 128, bf16) with
packed documents: forward and forward+backward time, XLA's temporary memory for each, and the
kernel's output and gradients against the naive reference (`naive_causal_softmax_attention`)
in fp32 at HIGHEST precision on the same packed rows, each judged against a limit
(`check_rows`; --check-only: only that).

Limits (benchmarks/checks/verdict.py), max |kernel - reference| / max |reference|:
- fp32 inputs: the kernel's products are TF32 (u = 2^-11): the scores' operands and p and v
  for p.V, 2 stages for the output (9.8e-4); the backward rounds dp's, ds's and the
  cotangent's operands too, 4 stages for the gradients (2.0e-3). Seen: 3.9e-4 to 7.4e-4.
- bf16 inputs: p rounded for p.V and the bf16 output, 2 u_bf16 (7.8e-3); the gradients round
  ds and their bf16 outputs on the way, 3 u_bf16 (1.2e-2). Seen: 2.8e-3 (out), 4.2e-3 (dq).
A softmax scale for the wrong head dim, a skipped key block of a document, or q and k swapped
is far outside these (tests/test_check_attention.py seeds each, with the XLA form as the
"kernel": the checking is the same).

FLOP/s: the kernel skips the key blocks left of each query block's earliest document start,
so dense causal FLOPs over T count work it never does. `fwd_tflops` counts the blocks it
computes (`k3jax.flops.attention_block_fraction` at tokamax's SM90 heuristic tiles, `BLOCK_Q`
x `BLOCK_K`; `block_fraction` in the row); `fwd_tflops_needed` the (query, key) pairs the
documents need; `fwd_tflops_dense_causal_equiv` the dense causal count (T^2 / 2 pairs a row),
the figure this benchmark reported as `fwd_tflops_causal` until 2026-12: it can exceed the
chip's peak. XLA's dense-mask form computes every pair of the row, the masked half too: its
`fwd_tflops` counts T^2 pairs (twice its dense causal equivalent).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_util import Rows, ms_per_call
from benchmarks.checks.verdict import Verdicts, max_rel, rounding_limit
from k3jax.flops import attention_block_fraction, attention_pair_fraction
from k3jax.ops.softmax_attn import (
    causal_softmax_attention,
    naive_causal_softmax_attention,
)
from k3jax.segments import document_start

BLOCK_Q, BLOCK_K = 64, 128  # tokamax's SM90 flash-attention heuristic config (block_q, block_kv)
LIMITS = {"float32": {"out": (rounding_limit("tf32", 2), "2 x u_tf32: the scores' and p.V's operands"),
                      "grad": (rounding_limit("tf32", 4), "4 x u_tf32: the forward's 2, dp's and ds's operands")},
          "bfloat16": {"out": (rounding_limit("bfloat16", 2), "2 x u_bf16: p rounded for p.V, the bf16 output"),
                       "grad": (rounding_limit("bfloat16", 3), "3 x u_bf16: p, ds rounded, the bf16 gradient")}}


def packed_segments(B, T, mean_doc, rng):
    """[B,T] ids: documents of random length (exponential, mean `mean_doc`), numbered 1.. per row."""
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        t, d = 0, 1
        while t < T:
            n = max(1, int(rng.exponential(mean_doc)))
            seg[b, t:t + n] = d
            t, d = t + n, d + 1
    return jnp.asarray(seg)


def inputs(B, T, H, D, Dv, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, H, D), dtype)
    k = jax.random.normal(ks[1], (B, T, H, D), dtype)
    v = jax.random.normal(ks[2], (B, T, H, Dv), dtype)
    do = jax.random.normal(ks[3], (B, T, H, Dv), dtype)
    return q, k, v, do


def reference(q, k, v, do, seg, scale):
    """The naive form in fp32 at HIGHEST precision (no TF32): (o, (dq, dk, dv))."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        o, vjp = jax.vjp(lambda q, k, v: naive_causal_softmax_attention(q, k, v, scale=scale, segment_ids=seg),
                         f32(q), f32(k), f32(v))
        return o, vjp(f32(do))


def forward_and_grads(attention, q, k, v, do, seg, scale):
    """(o, (dq, dk, dv)) of attention(q, k, v, scale=, segment_ids=)."""
    o, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, scale=scale, segment_ids=seg), q, k, v)
    return o, vjp(do)


def judge(case, got, ref, dtype, verdicts: Verdicts) -> dict:
    lim = LIMITS[jnp.dtype(dtype).name]
    row = dict(out=max_rel(got[0], ref[0]), **{n: max_rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), got[1], ref[1])})
    ok = verdicts.judge(case, "out", row["out"], *lim["out"])
    for n in ("dq", "dk", "dv"):
        ok &= verdicts.judge(case, n, row[n], *lim["grad"])
    row["pass"] = bool(ok)
    return row


def check_rows(verdicts: Verdicts, impl="kernel", B=2, T=2048, H=12, D=192, Dv=128, mean_doc=600.0,
               dtypes=(jnp.float32, jnp.bfloat16), attention=None) -> list[dict]:
    """The kernel (`impl`, or `attention` in its place: the CPU tests' faults) against the
    reference on packed rows, per input dtype."""
    attention = attention or (lambda q, k, v, **kw: causal_softmax_attention(q, k, v, impl=impl, **kw))
    rng = np.random.default_rng(0)
    scale = D ** -0.5
    rows = []
    for dtype in dtypes:
        q, k, v, do = inputs(B, T, H, D, Dv, dtype)
        seg = packed_segments(B, T, mean_doc, rng)
        case = f"{impl} {jnp.dtype(dtype).name} {B}x{T}x{H}x{D}x{Dv}"
        row = dict(check="kernel vs naive fp32 (HIGHEST)", impl=impl, dtype=jnp.dtype(dtype).name,
                   shape=[B, T, H, D, Dv])
        try:
            row.update(judge(case, forward_and_grads(attention, q, k, v, do, seg, scale),
                             reference(q, k, v, do, seg, scale), dtype, verdicts))
        except Exception as e:  # recorded (and failed), so the timing rows still run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            row["pass"] = verdicts.expect(case, "ran", False, row["error"][:120])
        rows.append(row)
    return rows


def timed(fn, args, reps=10):
    """(seconds per call, the compiled program's temporary bytes)."""
    compiled = jax.jit(fn).lower(*args).compile()
    return ms_per_call(compiled, *args, iters=reps) / 1e3, compiled.memory_analysis().temp_size_in_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--shapes", default="2x4096,8x4096,1x16384")
    ap.add_argument("--mean-doc", type=float, default=1500.0)
    ap.add_argument("--check-only", action="store_true", help="only the kernel's check against the reference")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    H, D, Dv = a.heads, 192, 128
    scale = D ** -0.5
    rng = np.random.default_rng(0)
    rows = Rows()
    verdicts = Verdicts("attention")
    for row in check_rows(verdicts, H=H, D=D, Dv=Dv):
        rows.add(row)
    for shape in [] if a.check_only else a.shapes.split(","):
        B, T = map(int, shape.split("x"))
        q, k, v, do = inputs(B, T, H, D, Dv, jnp.bfloat16)
        seg = packed_segments(B, T, a.mean_doc, rng)
        starts = np.asarray(document_start(seg))
        dense = 2 * B * H * (T * T / 2) * (D + Dv)  # causal half, every row one document
        needed = 2 * B * H * (T * (T + 1) / 2) * (D + Dv) * attention_pair_fraction(starts)
        blocks = attention_block_fraction(starts, BLOCK_Q, BLOCK_K)
        for impl in ("kernel", "xla"):
            done = dense * blocks if impl == "kernel" else 2 * dense
            row = dict(impl=impl, batch=B, seq=T, heads=H, d_qk=D, d_v=Dv, mean_doc=a.mean_doc,
                       block_fraction=round(blocks, 4) if impl == "kernel" else 2.0,
                       blocks=f"{BLOCK_Q}x{BLOCK_K}" if impl == "kernel" else "dense mask: every pair",
                       settings=dict(impl=impl, shape=[B, T, H, D, Dv], mean_doc=a.mean_doc, dtype="bfloat16",
                                     device=jax.devices()[0].device_kind))
            try:
                fwd = lambda q, k, v, seg, impl=impl: causal_softmax_attention(  # noqa: E731
                    q, k, v, scale=scale, segment_ids=seg, impl=impl)
                t_f, m_f = timed(fwd, (q, k, v, seg))

                def fwd_bwd(q, k, v, do, seg, fwd=fwd):
                    o, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, seg), q, k, v)
                    return vjp(do)
                t_fb, m_fb = timed(fwd_bwd, (q, k, v, do, seg))
                tf = lambda flops, t: round(flops / t / 1e12, 1)  # noqa: E731
                row.update(fwd_ms=round(t_f * 1e3, 3), fwd_bwd_ms=round(t_fb * 1e3, 3),
                           fwd_tflops=tf(done, t_f), fwd_bwd_tflops=tf(3.5 * done, t_fb),
                           fwd_tflops_needed=tf(needed, t_f), fwd_bwd_tflops_needed=tf(3.5 * needed, t_fb),
                           fwd_tflops_dense_causal_equiv=tf(dense, t_f),
                           fwd_bwd_tflops_dense_causal_equiv=tf(3.5 * dense, t_fb),
                           temp_gb_fwd=round(m_f / 2**30, 2), temp_gb_fwd_bwd=round(m_fb / 2**30, 2))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.add(row)
    rows.write(a.json)
    return verdicts.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
