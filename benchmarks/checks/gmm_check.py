"""tokamax's sm90 grouped-GEMM kernels against an fp32 XLA reference, per launch config, on the GPU.

    python -m benchmarks.checks.gmm_check --json out.json

For k3-small's routed experts at one GPU's share (the shapes of the launch-config sweep,
benchmarks/results/gmm-2026-12-02/gmm_configs.py), three routings: uniform random
(group sizes ~4,096, not multiples of a tile), every group 4,096 rows (tile-aligned), and a
skewed one with empty groups and unrouted rows at the end (a capacity buffer's padding). Each
kernel call (forward, dx, the ragged-contracting dw) runs at tokamax's sm90 heuristic config and
at the configs the sweep found, and through tokamax's own `ragged_dot` VJP (what k3jax ran
before it chose configs); each result is compared with the padded-block form computed in fp32
(`k3jax.ops.grouped_matmul.grouped_matmul_blocked`, itself tested against float64 on CPU).
Then k3jax's expert MLP on the kernel path (`grouped_glu_mlp(impl="kernel")`: K3RaggedDot's
configs, gate|up as one GEMM) forward and backward against the blocked form in fp32 on the same
bf16 values. Errors are max |a - ref| / max |ref| and ||a - ref|| / ||ref||; a bf16 result
rounds at ~4e-3 (max) and ~2e-3 (norm).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_util import shape_args
from k3jax.ops.grouped_matmul import grouped_glu_mlp, grouped_matmul_blocked


def fixed_config_kernel(cfg, kind: str, out_dtype):
    """tokamax's Mosaic-GPU grouped GEMM at one launch config (a tokamax Config), jitted:
    f(lhs, rhs, group_sizes). kind 'dot': rhs [E,K,N] grouped over lhs rows; 'contract': lhs
    [M,K'] and rhs [M,N'] contracted over the grouped rows."""
    from tokamax._src.ops.ragged_dot import base
    from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot

    op = PallasMosaicGpuRaggedDot(config=cfg)
    dims = base.DEFAULT_RAGGED_DOT_DIM_NUMS if kind == "dot" else base.RAGGED_CONTRACTING_DOT_DIM_NUMS

    @jax.jit
    def f(lhs, rhs, gs):
        return op(lhs, rhs, group_sizes=gs, ragged_dot_dimension_numbers=dims, precision=None,
                  preferred_element_type=out_dtype)
    return f


def main():
    ap = argparse.ArgumentParser()
    shape_args(ap, tokens=32768, experts=64, top_k=8, latent=768, hidden=512)  # k3-small, 8 x 4096 tokens
    ap.add_argument("--dw-pallas", action="store_true",
                    help="also k3jax's Pallas weight-gradient kernel (k3jax.ops.grouped_dw, the default) at each launch "
                         "setting: checked like the others, timed against tokamax's (its transposes included), "
                         "and the MLP with tokamax's dw beside it")
    ap.add_argument("--dw-sweep", default="",
                    help="with --dw-pallas: Pallas launch settings to check and time, "
                         "'rows,tile_k,tile_n,warps,stages;...' (the module's defaults are always in)")
    ap.add_argument("--pallas-only", action="store_true",
                    help="skip tokamax's per-config rows (already measured) and check only the Pallas dw and the MLP paths")
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    import tokamax
    from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu_common import Config, MatmulDimension

    E, M, l, H = a.experts, a.tokens * a.top_k, a.latent, a.hidden
    rng = np.random.default_rng(0)
    routings = {
        "uniform": np.bincount(rng.integers(0, E, M), minlength=E),
        "aligned": np.full(E, M // E),
    }
    skew = rng.dirichlet(np.full(E, 0.3)) * (M - 5000)
    skew = np.floor(skew).astype(np.int64)
    skew[[3, 17, 40]] = 0
    routings["skewed_padded"] = skew  # sum < M: unrouted rows at the end
    cfg = lambda bm, bn, bk, st, w=1: Config(block_m=bm, block_n=bn, block_k=bk, num_stages=st, split_k=1,  # noqa: E731
                                             persistent=False, grid_minor_dim=MatmulDimension.M, grid_tile_width=w)
    dot_cfgs = {"heuristic": cfg(64, 64, 128, 2), "128x128x64": cfg(128, 128, 64, 2),
                "128x128x64_w4": cfg(128, 128, 64, 2, 4)}
    contract_cfgs = {"heuristic": cfg(64, 64, 128, 2), "64x64x64": cfg(64, 64, 64, 2), "64x64x128_s4": cfg(64, 64, 128, 4),
                     "64x64x64_s4": cfg(64, 64, 64, 4)}
    out = {"device": jax.devices()[0].device_kind, "rows": M, "results": []}

    def err(y, ref, rows):
        y, ref = np.asarray(y, np.float32)[:rows], np.asarray(ref, np.float32)[:rows]
        bad = int(np.sum(~np.isfinite(y)))
        y = np.nan_to_num(y, nan=1e30, posinf=1e30, neginf=-1e30)
        return dict(max_rel=float(np.max(np.abs(y - ref)) / (np.max(np.abs(ref)) + 1e-30)),
                    norm_rel=float(np.linalg.norm(y - ref) / (np.linalg.norm(ref) + 1e-30)), nonfinite=bad)

    def run(op_cfg, lhs, rhs, sizes, kind, dtype):
        return fixed_config_kernel(op_cfg, kind, dtype)(lhs, rhs, sizes)

    ref_fwd = jax.jit(lambda x, w, s: grouped_matmul_blocked(x, w, s, block=128))
    ref_vjp = jax.jit(lambda x, w, s, dy: jax.vjp(lambda x_, w_: grouped_matmul_blocked(x_, w_, s, block=128), x, w)[1](dy))

    def tokamax_vjp(x, w, s, dy):  # what k3jax ran before it chose configs
        f = lambda x_, w_: tokamax.ragged_dot(x_, w_, s, preferred_element_type=jnp.bfloat16,  # noqa: E731
                                              implementation=("mosaic", "triton"))
        y, vjp = jax.vjp(f, x, w)
        return (y,) + vjp(dy)

    glu = lambda a, b: jax.nn.silu(a) * b  # noqa: E731

    def mlp_grads(impl, cd, weight_grad="pallas"):
        def f(x, w1, w3, w2, s, cot):
            loss = lambda *p: jnp.sum(grouped_glu_mlp(*p, s, glu, compute_dtype=cd, impl=impl,  # noqa: E731
                                                      weight_grad=weight_grad) * cot)
            return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, w1, w3, w2)[1]
        return jax.jit(f)

    for rname, sizes_np in routings.items():
        sizes = jnp.asarray(sizes_np, jnp.int32)
        n = int(sizes_np.sum())
        ks = jax.random.split(jax.random.key(1), 6)
        x = jax.random.normal(ks[0], (M, l), jnp.bfloat16)
        w = (jax.random.normal(ks[1], (E, l, H), jnp.float32) * 0.03).astype(jnp.bfloat16)
        dy = jax.random.normal(ks[2], (M, H), jnp.bfloat16)
        x32, w32, dy32 = (t.astype(jnp.float32) for t in (x, w, dy))
        y_ref = ref_fwd(x32, w32, sizes)
        dx_ref, dw_ref = ref_vjp(x32, w32, sizes, dy32)
        wT = jnp.swapaxes(w, 1, 2)  # [E,H,l]: dx = dy w^T as a plain grouped dot
        for name, c in dot_cfgs.items():
            if a.pallas_only or (rname == "aligned" and name != "heuristic"):
                continue
            y = run(c, x, w, sizes, "dot", jnp.float32)
            dx = run(c, dy, wT, sizes, "dot", jnp.float32)
            out["results"].append(dict(routing=rname, call="fwd", config=name, **err(y, y_ref, n)))
            out["results"].append(dict(routing=rname, call="dx", config=name, **err(dx, dx_ref, n)))
            print(out["results"][-2], out["results"][-1], flush=True)
        for name, c in contract_cfgs.items():
            if a.pallas_only and name != "64x64x64":
                continue
            try:
                dw = run(c, x, dy, sizes, "contract", jnp.float32)
                row = dict(routing=rname, call="dw", config=name, **err(dw, dw_ref, E))
            except Exception as e:
                row = dict(routing=rname, call="dw", config=name, error=f"{type(e).__name__}: {str(e)[:160]}")
            out["results"].append(row)
            print(row, flush=True)
        if a.dw_pallas:
            from k3jax.ops.grouped_dw import grouped_dw

            from k3jax.ops import grouped_dw as gdw

            settings = [(gdw.ROWS, gdw.TILE_K, gdw.TILE_N, gdw.WARPS, gdw.STAGES)]
            settings += [tuple(int(v) for v in c.split(",")) for c in a.dw_sweep.split(";") if c.strip()]
            for st in settings if rname == "uniform" else settings[:1]:
                kw = dict(zip(("rows", "tile_k", "tile_n", "warps", "stages"), st))
                name = "pallas grouped_dw " + "x".join(map(str, st))
                try:
                    pallas_dw = jax.jit(lambda x_, d_, s: grouped_dw(x_, d_, s, out_dtype=jnp.float32, **kw))
                    out["results"].append(dict(routing=rname, call="dw", config=name, **err(pallas_dw(x, dy, sizes), dw_ref, E)))
                except Exception as e:  # a launch setting Triton refuses: say so and go on
                    out["results"].append(dict(routing=rname, call="dw", config=name,
                                               error=f"{type(e).__name__}: {str(e)[:160]}"))
                print(out["results"][-1], flush=True)
            if rname == "uniform":  # time both weight-gradient kernels, bf16 out, at both of k3-small's shapes
                for n_cols in (H, 2 * H):
                    d2 = jax.random.normal(ks[3], (M, n_cols), jnp.bfloat16)
                    fns = {"tokamax 64x64x64 (with its transpose)": jax.jit(
                               lambda x_, d_, s: run(contract_cfgs["64x64x64"], x_, d_, s, "contract", jnp.bfloat16))}
                    for st in settings:
                        kw = dict(zip(("rows", "tile_k", "tile_n", "warps", "stages"), st))
                        fns["pallas grouped_dw " + "x".join(map(str, st))] = jax.jit(
                            functools.partial(lambda x_, d_, s, kw: grouped_dw(x_, d_, s, **kw), kw=kw))
                    for fname, fn in fns.items():
                        try:
                            fn(x, d2, sizes).block_until_ready()
                            t0 = time.perf_counter()
                            for _ in range(10):
                                r = fn(x, d2, sizes)
                            r.block_until_ready()
                            ms = (time.perf_counter() - t0) / 10 * 1e3
                            row = dict(n=n_cols, kernel=fname, ms=ms, tflops=2 * M * l * n_cols / ms / 1e9)
                        except Exception as e:
                            row = dict(n=n_cols, kernel=fname, error=f"{type(e).__name__}: {str(e)[:160]}")
                        out.setdefault("dw_timing", []).append(row)
                        print(row, flush=True)
        if not a.pallas_only:
            got = jax.jit(tokamax_vjp)(x, w, sizes, dy)
            for call, g, ref, rows in zip(("fwd", "dx", "dw"), got, (y_ref, dx_ref, dw_ref), (n, n, E)):
                out["results"].append(dict(routing=rname, call=call, config="tokamax.ragged_dot vjp", **err(g, ref, rows)))
                print(out["results"][-1], flush=True)
        # k3jax's expert MLP on the kernel path (K3RaggedDot's configs, gate|up as one GEMM, per-kernel
        # jits) against the padded-block form in fp32 on the same bf16 values
        w1, w3 = w, (jax.random.normal(ks[3], (E, l, H), jnp.float32) * 0.03).astype(jnp.bfloat16)
        w2 = (jax.random.normal(ks[4], (E, H, l), jnp.float32) * 0.03).astype(jnp.bfloat16)
        cot = jax.random.normal(ks[5], (M, l), jnp.float32)
        got = mlp_grads("kernel", jnp.bfloat16)(x, w1, w3, w2, sizes, cot)
        want = mlp_grads("blocked", jnp.float32)(*(t.astype(jnp.float32) for t in (x, w1, w3, w2)), sizes, cot)
        for call, g, ref, rows in zip(("mlp dx", "mlp dw1", "mlp dw3", "mlp dw2"), got, want, (n, E, E, E)):
            out["results"].append(dict(routing=rname, call=call, config="k3jax kernel path (Pallas dw)", **err(g, ref, rows)))
            print(out["results"][-1], flush=True)
        if a.dw_pallas:
            got = mlp_grads("kernel", jnp.bfloat16, "tokamax")(x, w1, w3, w2, sizes, cot)
            for call, g, ref, rows in zip(("mlp dx", "mlp dw1", "mlp dw3", "mlp dw2"), got, want, (n, E, E, E)):
                out["results"].append(dict(routing=rname, call=call, config="k3jax kernel path, tokamax dw",
                                           **err(g, ref, rows)))
                print(out["results"][-1], flush=True)
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
