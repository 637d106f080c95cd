"""A short tour of the operators: chunk KDA against a float64 loop, and the lineage.

    k3jax-demo [--T 256] [--heads 2] [--dim 64]

Prints the error of the chunkwise forms against float64 truth (fp32 and bf16
inputs) and the time of each form on this machine. The truth is the token loop
`recurrent_kda` run in float64 (x64 mode); the tests check that loop against an
independent numpy one (tests/reference.py).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import ops
from k3jax.local_platform import cpu_unless_accelerator


def _float64_truth(q, k, v, g, beta, s0):
    """(o [B,T,H,V], S [B,H,K,V]) as float64 numpy: the token recurrence in x64 mode."""
    with jax.enable_x64(True):
        q, k, v, g, beta, s0 = (jnp.asarray(x, jnp.float64) for x in (q, k, v, g, beta, s0))
        o, S = ops.recurrent_kda(q, k, v, g, beta, initial_state=s0)
        return np.asarray(o), np.asarray(S)


def _rel(x, ref):
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _timed(fn, *args):
    out = jax.block_until_ready(fn(*args))  # compile
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, default=256)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    a = p.parse_args(argv)
    cpu_unless_accelerator()  # no GPU or TPU here: keep JAX's plugins from probing (k3jax/local_platform.py)
    B, T, H, K = a.batch, a.T, a.heads, a.dim
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, K))
    g = -5.0 / (1 + np.exp(-rng.standard_normal((B, T, H, K))))  # K3's lower-bounded gate
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    s0 = rng.standard_normal((B, H, K, K))

    print(f"KDA  B={B} T={T} H={H} K=V={K}   backend={jax.default_backend()}  jax {jax.__version__}")
    ref_o, ref_S = _float64_truth(q, k, v, g, beta, s0)
    chunk = jax.jit(lambda *x: ops.chunk_kda(*x[:5], initial_state=x[5], decay_bound=-5.0, impl="xla"))
    # the fused GPU kernels; on a CPU the Pallas interpreter runs them (slow, but the same numbers)
    fused = jax.jit(lambda *x: ops.chunk_kda(*x[:5], initial_state=x[5], decay_bound=-5.0, impl="pallas"))
    rec = jax.jit(lambda *x: ops.recurrent_kda(*x[:5], initial_state=x[5]))
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, s0)]
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + f32[3:]
    # bf16 truth: the same loop on the bf16-rounded q/k/v isolates the operator's own error
    rounded = [np.asarray(x.astype(jnp.float32), np.float64) for x in bf16[:3]]
    ref_bf = _float64_truth(*rounded, g, beta, s0)
    print("relative error against float64 truth (on the inputs as given; bf16 also vs unrounded inputs)")
    print(f"{'form':<16}{'inputs':<8}{'o':>10}{'S':>10}{'o vs unrounded':>16}{'time':>10}")
    fused_name = "chunk_kda fused" if jax.default_backend() == "gpu" else "fused (interp.)"
    for name, fn in (("chunk_kda xla", chunk), (fused_name, fused), ("recurrent_kda", rec)):
        for dname, args, (ro, rS) in (("fp32", f32, (ref_o, ref_S)), ("bf16", bf16, ref_bf)):
            (o, S), dt = _timed(fn, *args)
            print(f"{name:<16}{dname:<8}{_rel(o, ro):>10.1e}{_rel(S, rS):>10.1e}{_rel(o, ref_o):>16.1e}"
                  f"{dt * 1e3:>8.1f}ms")

    print("\nlineage, chunk vs recurrent form (fp32), same inputs:")
    gs = g.mean(-1)
    pairs = {
        "gated_deltanet": (ops.chunk_gated_deltanet, ops.recurrent_gated_deltanet, (q, k, v, gs, beta)),
        "deltanet": (ops.chunk_deltanet, ops.recurrent_deltanet, (q, k, v, beta)),
        "linear": (ops.chunk_linear_attn, ops.recurrent_linear_attn, (q, k, v)),
    }
    for name, (c, r, args) in pairs.items():
        args = [jnp.asarray(x, jnp.float32) for x in args]
        (oc, _), tc = _timed(jax.jit(c), *args)
        (orr, _), tr = _timed(jax.jit(r), *args)
        print(f"  {name:<16} |chunk - recurrent| / |recurrent| = {_rel(oc, np.asarray(orr, np.float64)):.1e}"
              f"   chunk {tc * 1e3:.1f}ms  recurrent {tr * 1e3:.1f}ms")
    qs = jnp.asarray(q, jnp.float32)
    fast = ops.causal_softmax_attention(qs, qs, jnp.asarray(v, jnp.float32))
    naive = ops.naive_causal_softmax_attention(qs, qs, jnp.asarray(v, jnp.float32))
    print(f"  {'softmax':<16} |dot_product_attention - naive| / |naive| = "
          f"{_rel(fast, np.asarray(naive, np.float64)):.1e}")


if __name__ == "__main__":
    main()
