"""KDA's short convolution on the GPU: the backward as XLA fusions against the Pallas kernel.

    python -m benchmarks.ops.short_conv --json out.json [--sweep "rows,channels,warps[,tiles[,stages]];..."] [--profile DIR]

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
    a = ap.parse_args()
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
    out = {"device": jax.devices()[0].device_kind, "shape": [B, T, P, W], "backward": [], "fwd_bwd": [],
           "normalized_fwd_bwd": []}

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


if __name__ == "__main__":
    main()
