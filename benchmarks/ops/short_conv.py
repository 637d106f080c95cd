"""KDA's short convolution on the GPU: the backward as XLA fusions against the Pallas kernel.

    python -m benchmarks.ops.short_conv --json out.json [--sweep "rows,channels,warps[,tiles[,stages]];..."] [--profile DIR]
    python -m benchmarks.ops.short_conv --json out.json --check-only

The check first (`check_rows`): the kernel at its default launch setting, plain and normalised
(KDA's q/k form), against the XLA backward run on the same values in fp32 at HIGHEST precision,
each gradient judged (benchmarks/checks/verdict.py), max |kernel - ref| / max |ref|:
- dx and dwindow (bf16): the cotangent through SiLU's derivative in fp32, then rounded once to
  bf16, plus the normalised form's dy: 2 u_bf16 (7.8e-3). Seen against XLA: 1.2e-3 / 2.2e-3.
- dweight (fp32), plain: exact products of bf16 values summed over N = B x T rows in fp32
  blocks; for random-sign terms the rounding error grows like sqrt(N) u_fp32: 16 sqrt(N) u_fp32
  (1.7e-4 at N = 32,768). Seen against XLA: 2e-7. Normalised: the norm's backward starts from
  y as the forward rounded it to bf16 (as the XLA form does), so each summand carries a bf16
  rounding: 2 u_bf16. Seen against XLA (which rounds alike): 5.3e-5; against fp32, ~0.9 u.
The sweep rows below keep comparing each setting with the XLA form (informational).

k3-small's shape per conv: x [8, 4096, 1536] bf16 (q, k or v of 12 heads x 128), 4 taps,
packed documents (a new one every ~1,000 tokens, at random), a window of earlier inputs. Times,
ms per call after two warm-ups:
  - the backward alone: `k3jax.layers.conv._conv_silu_bwd` in its XLA form and
    `k3jax.ops.short_conv_grad.short_conv_grad` at each launch setting;
  - forward + backward through `short_conv` (jax.grad of a sum), impl="xla" against "pallas";
  - KDA's q/k form, the conv and the l2 norm per 128-channel head under one backward
    (`short_conv_normalized`), forward + backward, impl="xla" against "pallas", and the two
    layers one after the other as KDA ran them before (`short_conv` then `l2_normalize`, XLA);
    then its backward alone, XLA's against the kernel at each of --norm-sweep's settings.
Each kernel's gradients are compared with the XLA form's (max |a - b| / max |b|; both bf16 dx).
--profile DIR: a jax.profiler trace of three calls of each form under DIR/<form> (read them with
benchmarks/tools/profile_summary.py DIR/<form> --steps 3): which kernels of each form take the time.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_util import ms_per_call, profiled, rel_err, shape_args
from benchmarks.checks.verdict import Verdicts, max_rel, rounding_limit
from k3jax.layers import conv
from k3jax.ops.short_conv_grad import FORM, FORMS, WARPS, loop_tiles, short_conv_grad, tile
from k3jax.segments import segment_counter


def _setting(text: str, most: int) -> tuple:
    """'16,64,4,8[,two_pass]' -> (16, 64, 4, 8, form): up to `most` integers, then the form."""
    parts = text.split(",")
    form = parts.pop() if parts[-1] in FORMS else FORM
    if len(parts) > most:
        raise SystemExit(f"setting {text!r}: at most {most} integers, then a form of {FORMS}")
    return (*(int(v) for v in parts), form)


def check_inputs(B, T, P, W, seed=0):
    """(w [W,P] fp32, x bf16, window bf16, r the segment counter, g bf16): packed documents."""
    rng = np.random.default_rng(seed)
    seg = np.cumsum(rng.random((B, T)) < max(1e-3, 4.0 / T), axis=1).astype(np.int32) + 1
    ks = jax.random.split(jax.random.key(seed), 4)
    w = jax.random.uniform(ks[0], (W, P), jnp.float32, -0.5, 0.5)
    x = jax.random.normal(ks[1], (B, T, P), jnp.bfloat16)
    win = jax.random.normal(ks[2], (B, W - 1, P), jnp.bfloat16)
    g = jax.random.normal(ks[3], (B, T, P), jnp.bfloat16)
    return w, x, win, segment_counter(jnp.asarray(seg)), g


def limits(B, T, normalized: bool) -> dict:
    dw = ((rounding_limit("bfloat16", 2), "2 x u_bf16: the summands carry dy, from y rounded to bf16 before the norm")
          if normalized else
          (16 * (B * T) ** 0.5 * 2.0**-24, f"16 sqrt(N) u_fp32: fp32 sums of N = {B * T} exact products"))
    return {"dw": dw,
            "dx": (rounding_limit("bfloat16", 2), "2 x u_bf16: dy's and the bf16 output's rounding"),
            "dwindow": (rounding_limit("bfloat16", 2), "2 x u_bf16: dy's and the bf16 output's rounding")}


def exact_backward(w, x, win, r, g, normalize):
    """The XLA backward on the same values in fp32 at HIGHEST precision: (dw, dx, dwindow)."""
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        if normalize is None:
            return jax.jit(lambda *a: conv._conv_silu_bwd("xla", a[:4], a[4])[:3])(w, f32(x), f32(win), r, f32(g))
        return jax.jit(lambda *a: conv._conv_silu_norm_bwd(*normalize, "xla", a[:4], a[4])[:3])(
            w, f32(x), f32(win), r, f32(g))


def check_rows(verdicts: Verdicts, B=8, T=4096, P=1536, W=4, head=128, kernel=None) -> list[dict]:
    """The kernel at its default setting (or `kernel`, the CPU tests' faults, in its place),
    plain and normalised, against `exact_backward`."""
    ip = jax.default_backend() != "gpu"
    kernel = kernel or (lambda *a, normalize: short_conv_grad(*a, normalize=normalize, interpret=ip))
    w, x, win, r, g = check_inputs(B, T, P, W)
    rows = []
    for name, normalize in (("conv", None), ("conv+l2norm", (head, 1e-6))):
        lim = limits(B, T, normalize is not None)
        case = f"{name} {B}x{T}x{P}x{W}"
        got = kernel(w, x, win, r, g, normalize=normalize)
        want = exact_backward(w, x, win, r, g, normalize)
        row = dict(check="kernel vs XLA in fp32 (HIGHEST)", form=name, shape=[B, T, P, W],
                   **{f"rel_{n}": max_rel(a, b) for n, a, b in zip(("dw", "dx", "dwindow"), got, want)})
        row["pass"] = all([verdicts.judge(case, n, row[f"rel_{n}"], *lim[n]) for n in ("dw", "dx", "dwindow")])
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    shape_args(ap, batch=8, seq=4096, channels=1536, size=4)
    ap.add_argument("--sweep", default="16,128,4;64,128,8;32,64,4;32,128,8",
                    help="launch settings besides the default: 'rows,channels,warps[,tiles[,stages]][,form];...' "
                         "(tiles: row tiles per program, stages: the loop's pipelining depth; both 1 by default; "
                         "form: recompute (default) or two_pass, k3jax.ops.short_conv_grad.FORMS)")
    ap.add_argument("--norm-sweep", default="16,4,8;16,8,8;16,8,4;32,8,4;16,4,1;16,8,1",
                    help="the normalised backward's launch settings (128-channel tiles): 'rows,warps,tiles[,form];...'")
    ap.add_argument("--backward-only", action="store_true",
                    help="only the backward sweeps (no forward + backward rows: fewer compiles)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--profile", default=None, help="trace each form under this directory")
    ap.add_argument("--check-only", action="store_true", help="only the kernel's check (no timing)")
    a = ap.parse_args()
    verdicts = Verdicts("short_conv")
    checked = check_rows(verdicts, a.batch, a.seq, a.channels, a.size)
    if a.check_only:
        with open(a.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "check": checked}, fh, indent=1)
        return verdicts.exit_code()
    trace = (lambda name: f"{a.profile}/{name}") if a.profile else (lambda name: None)  # noqa: E731
    B, T, P, W = a.batch, a.seq, a.channels, a.size
    rng = np.random.default_rng(0)
    seg = np.cumsum(rng.random((B, T)) < 1e-3, axis=1).astype(np.int32) + 1
    ks = jax.random.split(jax.random.key(0), 5)
    w = jax.random.uniform(ks[0], (W, P), jnp.float32, -0.5, 0.5)
    x = jax.random.normal(ks[1], (B, T, P), jnp.bfloat16)
    win = jax.random.normal(ks[2], (B, W - 1, P), jnp.bfloat16)
    g = jax.random.normal(ks[3], (B, T, P), jnp.bfloat16)
    r = segment_counter(jnp.asarray(seg))
    out = {"device": jax.devices()[0].device_kind, "shape": [B, T, P, W], "check": checked, "backward": [],
           "fwd_bwd": [], "normalized_fwd_bwd": []}

    def save():  # after every row: a run cut short by its time limit keeps what it measured
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)

    xla_bwd = jax.jit(lambda w, x, win, r, g: conv._conv_silu_bwd("xla", (w, x, win, r), g)[:3])
    want = xla_bwd(w, x, win, r, g)
    out["backward"].append(dict(form="xla", ms=ms_per_call(xla_bwd, w, x, win, r, g)))
    profiled(xla_bwd, w, x, win, r, g, trace_dir=trace("bwd_xla"))
    print(out["backward"][-1], flush=True)
    settings = [tile(x) + (WARPS, loop_tiles(x, tile(x)[0]), 1, FORM)] + [_setting(s, 5) for s in a.sweep.split(";") if s]
    for rows, ch, warps, *loop, form in settings:
        tiles, stages = (tuple(loop) + (1, 1))[:2]
        name = f"pallas {rows}x{ch} w{warps} tiles{tiles} s{stages} {form}"
        try:
            fn = jax.jit(lambda w, x, win, r, g, rows=rows, ch=ch, warps=warps, tiles=tiles, stages=stages, form=form:
                         short_conv_grad(w, x, win, r, g, rows=rows, channels=ch, warps=warps, tiles=tiles,
                                         stages=stages, form=form))
            got = fn(w, x, win, r, g)
            row = dict(form=name, ms=ms_per_call(fn, w, x, win, r, g),
                       **{f"rel_{n}": rel_err(u, v) for n, u, v in zip(("dw", "dx", "dwindow"), got, want)})
            profiled(fn, w, x, win, r, g, trace_dir=trace(name.replace(" ", "_")))
        except Exception as e:  # a setting Triton refuses: say so and go on
            row = dict(form=name, error=f"{type(e).__name__}: {str(e)[:200]}")
        out["backward"].append(row)
        print(row, flush=True)
        save()

    cy = jax.random.normal(ks[4], (B, T, P), jnp.float32)
    for impl in () if a.backward_only else ("xla", "pallas"):
        loss = lambda w, x, win, impl=impl: jnp.sum(conv.short_conv(w, x, jnp.asarray(seg), win, impl=impl)[0]  # noqa: E731
                                                    .astype(jnp.float32) * cy)
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        out["fwd_bwd"].append(dict(impl=impl, ms=ms_per_call(fn, w, x, win)))
        profiled(fn, w, x, win, trace_dir=trace(f"fwd_bwd_{impl}"))
        print(out["fwd_bwd"][-1], flush=True)
        save()
    from k3jax.layers.norms import l2_normalize

    head = 128
    unfused = lambda w, x, win: l2_normalize(conv.short_conv(w, x, jnp.asarray(seg), win, impl="xla")[0]  # noqa: E731
                                             .reshape(B, T, P // head, head), 1e-6).reshape(B, T, P)
    forms = [("conv then norm, xla", unfused)] + [
        (f"one vjp, {impl}", lambda w, x, win, impl=impl: conv.short_conv_normalized(
            w, x, jnp.asarray(seg), win, head, 1e-6, impl=impl)[0]) for impl in ("xla", "pallas")]
    want = None
    for name, f in [] if a.backward_only else forms:
        loss = lambda w, x, win, f=f: jnp.sum(f(w, x, win).astype(jnp.bfloat16).astype(jnp.float32) * cy)  # noqa: E731
        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        got = fn(w, x, win)
        want = got if want is None else want
        out["normalized_fwd_bwd"].append(dict(form=name, ms=ms_per_call(fn, w, x, win),
                                              **{f"rel_{n}": rel_err(u, v) for n, u, v in
                                                 zip(("dw", "dx", "dwindow"), got, want)}))
        profiled(fn, w, x, win, trace_dir=trace("normalized_" + name.replace(" ", "_").replace(",", "")))
        print(out["normalized_fwd_bwd"][-1], flush=True)
        save()
    # the normalised backward alone: XLA's two backwards in a row against the kernel's settings
    out["normalized_backward"] = []
    norm = (head, 1e-6)
    xla_nbwd = jax.jit(lambda w, x, win, r, g: conv._conv_silu_norm_bwd(head, 1e-6, "xla", (w, x, win, r), g)[:3])
    want = xla_nbwd(w, x, win, r, g)
    out["normalized_backward"].append(dict(form="xla", ms=ms_per_call(xla_nbwd, w, x, win, r, g)))
    print(out["normalized_backward"][-1], flush=True)
    for setting in [s for s in a.norm_sweep.split(";") if s]:
        rows, warps, tiles, form = _setting(setting, 3)
        name = f"pallas {rows}x{head} w{warps} tiles{tiles} {form}"
        try:
            fn = jax.jit(lambda w, x, win, r, g, rows=rows, warps=warps, tiles=tiles, form=form: short_conv_grad(
                w, x, win, r, g, rows=rows, warps=warps, tiles=tiles, normalize=norm, form=form))
            got = fn(w, x, win, r, g)
            row = dict(form=name, ms=ms_per_call(fn, w, x, win, r, g),
                       **{f"rel_{n}": rel_err(u, v) for n, u, v in zip(("dw", "dx", "dwindow"), got, want)})
        except Exception as e:  # a setting Triton refuses: say so and go on
            row = dict(form=name, error=f"{type(e).__name__}: {str(e)[:200]}")
        out["normalized_backward"].append(row)
        print(row, flush=True)
        save()
    return verdicts.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
