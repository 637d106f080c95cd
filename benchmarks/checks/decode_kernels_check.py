"""The decode kernels (k3jax/ops/decode_kernels) on this device against an fp32 form of the same math.

    python -m benchmarks.checks.decode_kernels_check [--json out.json] [--tiny]

At k3-small's head shapes (`SMALL`; `--tiny`: `TINY`, what the CPU tests run in the Pallas
interpreter), each kernel of a decode step (`kernel_check`: the latent decode attention, the
expanded prefill attention, the KDA step; `fused_kernel_check`: the fused step's GEMVs, AttnRes
with its norm, the KDA layer, the routed experts, MLA's prep and finish) runs on bf16 inputs and
is compared with its plain XLA form run on the same values in fp32 at HIGHEST precision (dtype
float32: none of the roundings the kernel and its bf16 plain form share). Each row gives:

    kernel_vs_f32   the verdict's figure: max |kernel - fp32 form| / max |fp32 form|
    xla_vs_f32      the plain form in bf16 against the same fp32 form (what rounding alone costs)
    kernel_vs_xla   kernel against the plain form in bf16: what this check compared until 2026-12
                    (`identical_to_xla`: the two rounded every output alike)

Why kernel_vs_xla could be exactly 0.0 (mla_prep and mla_finish, 2026-12-01): both forms round
the same fp32 values to bf16 at the same points (the prep's q_lat and cache row, the finish's
o_lat and output), and their fp32 sums differ by ~1e-7 relative, which moves a bf16 rounding
only where a value lies within ~1e-7 of a rounding boundary: summing the finish's 1,536 outputs
(256 terms each) in two fp32 orders and rounding both to bf16 gave no differing output in 9 of
10 random draws (0.09 on average). The comparison could see nothing below one bf16 step
(3.9e-3): a bug of 1e-3 would have read 0 too. Not a kernel compared with itself, but a
comparison blind below its own rounding. Against the fp32 form the kernel's error is its
rounding (a few 1e-3), never 0, and the limit sits above that and below a real bug.

Limits (benchmarks/checks/verdict.py): rounding stages x u_bf16 on the kernel's longest path,
counted in `KERNELS` (an operand or intermediate the kernel rounds to bf16, and its output when
bf16); the KDA step is fp32 throughout (4 K u_fp32: a few K-term fp32 sums in a row).

long_decode runs `kernel_check` and `fused_kernel_check` before it measures, and sends the model
to the XLA path (or the unfused step) when one fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.checks.verdict import Verdicts, max_rel, rounding_limit

CHECK = "decode_kernels"

# kernel -> (format, stages, why): the limit is stages x u(format)
KERNELS = {
    "mla_decode": ("bfloat16", 2, "p rounded for p.V, fp32 output, +1 for exp and the split merge"),
    "mla_prefill": ("bfloat16", 3, "p rounded for p.V, the bf16 output, +1 for exp"),
    "kda_step": ("float32", None, "fp32 throughout: 4 K u_fp32"),
    "gemv": ("bfloat16", 2, "the normalised x rounded, the bf16 outputs"),
    "gemv_glu_add": ("bfloat16", 3, "the GLU's hidden rounded, the product rounded, each add rounded"),
    "attnres_norm": ("bfloat16", 3, "the mix rounded, the norm's output rounded, times gamma rounded"),
    "kda_layer": ("bfloat16", 3, "the conv outputs rounded, the state's output, the gated norm's output"),
    "moe_experts": ("bfloat16", 3, "the up products rounded, the GLU's hidden rounded, +1 for the weighted sum"),
    "mla_prep": ("bfloat16", 2, "q_lat rounded; the cache row: the norm rounded, times gamma rounded"),
    "mla_finish": ("bfloat16", 3, "o_lat rounded, the W_UV product rounded, the gate's product rounded"),
}


@dataclasses.dataclass(frozen=True)
class Dims:
    """The checks' shapes (defaults: k3-small's heads, what the GPU runs)."""
    B: int = 2  # rows (kernel_check)
    S: int = 1024  # cache slots
    H: int = 12  # MLA heads
    R: int = 256  # kv_lora_rank
    r: int = 64  # rope dim
    n: int = 128  # nope dim (and v)
    C: int = 256  # prefill chunk
    K: int = 128  # KDA head dim
    d: int = 1536  # d_model
    L: int = 3  # stacked layers (read at layer 1)
    gemv_n: tuple = (1536, 64, 768)  # the fused GEMV's three outputs
    glu_in: int = 1024  # the GLU down projection's input
    H_kda: int = 12  # KDA heads (P = H_kda x K)
    R_gate: int = 128  # f_a's rank
    E: int = 64  # experts
    top_k: int = 8
    latent: int = 768  # the experts' latent width
    hidden: int = 512  # the experts' hidden width
    NS: int = 32  # splits the finish merges (a multiple of 16)
    index: int = 700  # the prep's cache slot
    prefill_at: int = 512  # the prefill chunk's first position


SMALL = Dims()
TINY = Dims(B=2, S=64, H=2, R=32, r=16, n=16, C=32, K=16, d=64, L=3, gemv_n=(64, 16, 32), glu_in=32, H_kda=2,
            R_gate=16, E=8, top_k=2, latent=32, hidden=32, NS=16, index=40, prefill_at=16)


def limit_of(name: str, dims: Dims) -> tuple[float, str]:
    fmt, stages, why = KERNELS[name]
    if stages is None:  # fp32 throughout
        return 4 * dims.K * 2.0**-24, why
    return rounding_limit(fmt, stages), f"{stages} x u_bf16: {why}"


def _f32(tree):
    """Every floating array of tree in fp32 (other leaves as they are)."""
    def cast(a):
        if isinstance(a, (jax.Array, np.ndarray)) and jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.asarray(a, jnp.float32)
        return a
    return jax.tree.map(cast, tree)


def _compare(name, got, xla, exact, dims, verdicts, case):
    """One kernel's row: its outputs (a list of arrays; integer ones must match exactly)."""
    got, xla, exact = (list(jax.tree.leaves(t)) for t in (got, xla, exact))
    floats = [i for i, a in enumerate(exact) if jnp.issubdtype(a.dtype, jnp.floating)]
    ints_equal = all(np.array_equal(np.asarray(got[i]), np.asarray(exact[i])) for i in range(len(exact))
                     if i not in floats)
    k_f32 = max(max_rel(got[i], exact[i]) for i in floats)
    x_f32 = max(max_rel(xla[i], exact[i]) for i in floats)
    k_xla = max(max_rel(got[i], xla[i]) for i in floats)
    limit, why = limit_of(name, dims)
    row = dict(kernel=name, kernel_vs_f32=k_f32, xla_vs_f32=x_f32, kernel_vs_xla=k_xla,
               identical_to_xla=bool(k_xla == 0.0), limit=limit, integers_equal=ints_equal)
    row["pass"] = verdicts.judge(case, f"{name} kernel_vs_f32", k_f32, limit, why) and ints_equal
    if not ints_equal:
        verdicts.expect(case, f"{name} integer outputs", False,
                        "the kernel's integer outputs differ from the plain form's")
    return row


def _runner(dtype):
    """(run the kernel, run a plain form in `dtype`, run the plain form in fp32 at HIGHEST)."""
    ip = jax.default_backend() != "gpu"  # the interpreter off a GPU (the CPU tests)

    def kern(f, *a, **k):
        return jax.jit(functools.partial(f, interpret=ip, **k))(*a)

    def plain(f, *a, **k):
        return jax.jit(functools.partial(f, **k))(*a)

    def exact(f, *a, **k):
        k = _f32({n: (jnp.float32 if n in ("dtype", "round_dtype") else
                      (jnp.float32,) * len(v) if n == "dtypes" else v) for n, v in k.items()})
        with jax.default_matmul_precision("highest"):
            return jax.jit(functools.partial(f, **k))(*_f32(a))
    return kern, plain, exact


def kernel_check(dtype=jnp.bfloat16, dims: Dims = SMALL, verdicts: Verdicts | None = None, only=None) -> dict:
    """The latent decode attention, the expanded prefill attention and the KDA step. -> {kernel: row}."""
    from k3jax.ops.decode_kernels import kda_step, mla_decode, mla_prefill

    verdicts = verdicts or Verdicts(CHECK)
    kern, plain, exact = _runner(dtype)
    case = f"{jnp.dtype(dtype).name} {'x'.join(map(str, (dims.B, dims.S, dims.H)))}"
    out = {}
    ks = jax.random.split(jax.random.PRNGKey(0), 12)
    rnd = lambda i, s, d=dtype: jax.random.normal(ks[i], s, jnp.float32).astype(d)  # noqa: E731
    B, S, H, R, r, n, C, K = dims.B, dims.S, dims.H, dims.R, dims.r, dims.n, dims.C, dims.K
    seg = jnp.ones((B, S), jnp.int32)

    def one(name, kfn, rfn, args, **kw):
        if only is None or name in only:
            out[name] = _compare(name, kern(kfn, *args, **kw), plain(rfn, *args, **kw), exact(rfn, *args, **kw), dims,
                                 verdicts, case)

    ql, qr, lat, kr = rnd(0, (B, H, R)), rnd(1, (B, H, r)), rnd(2, (2, B, S, R)), rnd(3, (2, B, S, r))
    one("mla_decode", mla_decode.latent_decode_attention, mla_decode.latent_decode_attention_reference,
        (ql, qr, lat, kr, seg, jnp.ones((B,), jnp.int32), S - 7, 1), scale=0.07)
    qn, qrp, kn, v, krp = rnd(4, (1, C, H, n)), rnd(5, (1, C, H, r)), rnd(6, (1, S, H, n)), rnd(7, (1, S, H, n)), \
        rnd(8, (1, S, r))
    one("mla_prefill", mla_prefill.expanded_prefill_attention, mla_prefill.expanded_prefill_attention_reference,
        (qn, qrp, kn, v, krp, seg[:1], jnp.ones((1, C), jnp.int32), dims.prefill_at, jnp.zeros((1,), jnp.int32)),
        scale=0.07)
    st = rnd(9, (3, B, H, K, K), jnp.float32)
    one("kda_step", kda_step.kda_decode_step, kda_step.kda_decode_step_reference,
        (st, 2, rnd(10, (B, H, K)), 0.1 * rnd(11, (B, H, K)), rnd(10, (B, H, K)),
         -jnp.abs(rnd(9, (B, H, K), jnp.float32)), jnp.full((B, H), 0.5), jnp.array([False, True])[:B]), scale=0.088)
    return out


def fused_kernel_check(dtype=jnp.bfloat16, dims: Dims = SMALL, verdicts: Verdicts | None = None, only=None) -> dict:
    """The fused decode step's kernels (model.decode_fused), stacked parameters read at layer 1
    of dims.L. -> {kernel: row}."""
    from k3jax.ops.decode_kernels import attnres_norm, gemv, kda_layer, mla_layer, moe_experts

    verdicts = verdicts or Verdicts(CHECK)
    kern, plain, exact = _runner(dtype)
    case = f"{jnp.dtype(dtype).name} d{dims.d}"
    ks = iter(jax.random.split(jax.random.PRNGKey(1), 64))
    rnd = lambda s, d=dtype, scale=1.0: (scale * jax.random.normal(next(ks), s, jnp.float32)).astype(d)  # noqa: E731
    out = {}

    def one(name, kfn, rfn, args, pick=lambda o: o, **kw):
        if only is None or name in only:
            got, xla, ex = (pick(f(g, *args, **kw)) for f, g in ((kern, kfn), (plain, rfn), (exact, rfn)))
            out[name] = _compare(name, got, xla, ex, dims, verdicts, case)

    d, L = dims.d, dims.L
    x = rnd((1, d))
    n1, n2, n3 = dims.gemv_n
    ws = [rnd((L, d, n1), scale=0.02), rnd((L, d, n2), jnp.float32, 0.02), rnd((L, d, n3), scale=0.02)]
    one("gemv", gemv.fused_gemv, gemv.fused_gemv_reference, (x, ws), dtypes=(dtype, jnp.float32, dtype),
        layers=(1, 1, 1), norm=1.0 + rnd((L, d), jnp.float32, 0.1), norm_layer=1, eps=1e-5)
    a, b, r1 = rnd((1, dims.glu_in)), rnd((1, dims.glu_in)), rnd((1, d))
    w2 = [rnd((L, dims.glu_in, d), scale=0.02)]
    one("gemv_glu_add", gemv.fused_gemv, gemv.fused_gemv_reference, (a, w2), pick=lambda o: o[0], dtypes=(dtype,),
        layers=(1,), glu=("situ", 4.0, 25.0), x2=b, addends=[rnd((1, d), jnp.float32), r1], round_dtype=dtype)
    blocks, prefix = rnd((4, 1, d)), rnd((1, d))
    vecs = (1.0 + rnd((L, d), jnp.float32, 0.1), rnd((L, d, 1), jnp.float32, 0.1))
    one("attnres_norm", attnres_norm.attnres_norm, attnres_norm.attnres_norm_reference,
        (blocks, jnp.int32(3), prefix, vecs, 1.0 + rnd((L, d), jnp.float32, 0.1)), eps_attn=1e-5, eps_norm=1e-5,
        layers=(1, 1, 1))
    H, K, Rg = dims.H_kda, dims.K, dims.R_gate
    P = H * K
    proj = {"q": rnd((1, P)), "k": rnd((1, P)), "v": rnd((1, P)), "f_a": rnd((1, Rg)), "g": rnd((1, P), jnp.float32)}
    params = {"conv_q": rnd((L, 4, P), jnp.float32, 0.5), "conv_k": rnd((L, 4, P), jnp.float32, 0.5),
              "conv_v": rnd((L, 4, P), jnp.float32, 0.5), "f_b": rnd((L, Rg, P), scale=0.05),
              "dt_bias": rnd((L, P), jnp.float32), "A_log": rnd((L, H), jnp.float32, 0.3),
              "b": rnd((L, d, H), scale=0.02), "o_norm": 1.0 + rnd((L, K), jnp.float32, 0.1)}
    params = {k: (v, 1) for k, v in params.items()}
    state, wins = rnd((L, 1, H, K, K), jnp.float32, 0.1), tuple(rnd((L, 1, 3, P)) for _ in range(3))
    one("kda_layer", kda_layer.kda_decode_layer, kda_layer.kda_decode_layer_reference,
        (proj, rnd((1, d)), jnp.array([1], jnp.int32), jnp.array([1], jnp.int32), state, wins, params),
        layer=1, gate="lower_bound", lower_bound=-5.0, eps=1e-5, dtype=dtype)
    E, l, Hd = dims.E, dims.latent, dims.hidden
    one("moe_experts", moe_experts.routed_experts_decode, moe_experts.routed_experts_decode_reference,
        (rnd((1, E), jnp.float32), rnd((L, E), jnp.float32, 0.1), rnd((1, l)), rnd((L, E, l, Hd), scale=0.03),
         rnd((L, E, l, Hd), scale=0.03), rnd((L, E, Hd, l), scale=0.03)),
        top_k=dims.top_k, scaling=1.0, glu=("situ", 4.0, 25.0), dtype=dtype, layers=(1, 1, 1, 1))
    S, Hm, Rk, r, n, v = dims.S, dims.H, dims.R, dims.r, dims.n, dims.n
    w_kvb = rnd((L, Rk, Hm, n + v), scale=0.05)
    idx = dims.index

    def prep_outputs(o):  # q_lat, q_rope, meta, and the cache rows the prep wrote (the rest is the input)
        ql, qr, meta, lat, kr = o
        return [ql, qr, meta, lat[1, :, idx], kr[1, :, idx]]
    one("mla_prep", mla_layer.mla_decode_prep, mla_layer.mla_decode_prep_reference,
        (rnd((1, Hm, n + r)), rnd((1, Rk + r)), w_kvb, 1.0 + rnd((L, Rk), jnp.float32, 0.1), rnd((L, 1, S, Rk)),
         rnd((L, 1, S, r))), pick=prep_outputs,
        index=jnp.int32(idx), layer=jnp.int32(1), lo=jnp.zeros((1,), jnp.int32), q_seg=jnp.ones((1,), jnp.int32),
        eps=1e-6, dtype=dtype, layers=(1, 1))
    NS = dims.NS
    one("mla_finish", mla_layer.mla_decode_finish, mla_layer.mla_decode_finish_reference,
        (rnd((1, NS, 16, Rk), jnp.float32), rnd((1, NS, 16), jnp.float32), jnp.abs(rnd((1, NS, 16), jnp.float32)),
         w_kvb, rnd((1, Hm * v), jnp.float32)), nope=n, dtype=dtype, layer=1)
    return out


def failed(rows: dict) -> list[str]:
    return [k for k, r in rows.items() if not r["pass"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="the CPU tests' shapes")
    a = ap.parse_args(argv)
    dims = TINY if a.tiny else SMALL
    v = Verdicts(CHECK)
    rows = {"kernel_check": kernel_check(dims=dims, verdicts=v), "fused_kernel_check": fused_kernel_check(dims=dims,
                                                                                                        verdicts=v)}
    for part in rows.values():
        for name, row in part.items():
            print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows, "verdicts": v.rows}, f, indent=1)
    return v.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
