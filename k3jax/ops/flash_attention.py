"""Causal softmax attention over packed documents through a fused flash-attention kernel.

    q [B,T,H,D], k [B,T,Hkv,D], v [B,T,Hkv,Dv] (Dv may differ from D: MLA's 192 / 128),
    document_start [B,T] int32 -> o [B,T,H,Dv] in q's dtype.

Token t attends to keys s with document_start[t] <= s <= t. Packed documents are contiguous
runs of one segment id (the segment contract, `k3jax.segments`), so "same document and causal" is a per-query key *range*, and the
kernel takes it as one integer per query: no [T,T] mask is ever built, and key blocks left
of a query block's earliest start are skipped, not masked.

The kernel is tokamax's flash attention (the `[gpu]` extra): Pallas Mosaic-GPU on Hopper,
its Pallas-Triton kernel as the second choice, both with a VJP. Its public
`dot_product_attention` takes only a dense mask, so this module builds tokamax's mask object
with a per-query `k_start` directly (tokamax 0.0.17's `base.Mask`). tokamax's XLA fallback is
never selected: it would build the scores this module exists to avoid.

`k3jax.ops.softmax_attn.naive_causal_softmax_attention` is the reference; the GPU check in
`benchmarks/ops/attention.py` compares the kernel with it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from k3jax import segments
from k3jax.ops.gpu_extra import tokamax_unavailable

F32 = jnp.float32
_KERNELS = ("mosaic_gpu", "triton")


def document_start(segment_ids, T: int | None = None, B: int = 1):
    """[B,T] int32: each token's document start (`k3jax.segments.document_start`, the one
    start rule every mixer uses). None -> zeros (one document)."""
    if segment_ids is None:
        return jnp.zeros((B, T), jnp.int32)
    return segments.document_start(segment_ids)


def kernel_unavailable() -> str | None:
    """Why the fused kernel cannot run here (None when it can)."""
    return tokamax_unavailable()


def resolve_impl(impl: str) -> str:
    """auto -> `kernel` on a GPU with tokamax, else `xla`; `kernel` where it cannot run is an
    error saying why. While k3jax-plan plans for a GPU, auto plans the kernel."""
    from k3jax.ops.planning import planning_target

    if impl == "xla":
        return "xla"
    if impl not in ("auto", "kernel"):
        raise ValueError(f"attention impl must be auto, kernel or xla, got {impl!r}")
    target = planning_target()
    if target is not None:
        return "kernel" if target == "gpu" else "xla"
    why = kernel_unavailable()
    if why and impl == "kernel":
        raise ValueError(f"attention impl 'kernel' cannot run: {why}")
    return "xla" if why else "kernel"


def flash_causal_attention(q, k, v, *, scale: float, doc_start):
    """The fused kernel (shapes in the module docstring); under k3jax-plan, its stand-in. Under
    an active mesh it runs per shard (`_per_shard`)."""
    from k3jax.ops.planning import planning_target

    if planning_target() is not None:
        fn = functools.partial(memory_stand_in, scale=float(scale))
    else:
        fn = functools.partial(_flash_kernel, scale=float(scale))
    return _per_shard(fn, q, k, v, doc_start.astype(jnp.int32))


def _per_shard(fn, q, k, v, doc_start):
    """fn(q, k, v, doc_start) on each device's rows and heads under an active mesh. tokamax's
    kernel is one device's program: left to XLA's SPMD partitioner, every operand would be
    gathered whole onto each device first (as the short-conv kernel's were, 2026-12-02:
    train/plan/kernels.py). tokamax shards its op itself only when q carries a concrete
    sharding, which a traced q does not. Rows over the batch axes, heads over `tensor` where it
    divides both q's and k's heads; attention is independent per row and per head. Inside a
    shard_map already (context parallelism) there is no active mesh and fn runs as it is."""
    from jax.sharding import PartitionSpec as P

    from k3jax.ops.mesh_axes import active_mesh, row_head_axes

    mesh = active_mesh(required_axes=())
    if mesh is None:
        return fn(q, k, v, doc_start)
    rows, heads = row_head_axes(mesh, q.shape[0], math.gcd(q.shape[2], k.shape[2]))
    x4 = P(rows, None, heads, None)
    return jax.shard_map(fn, mesh=mesh, in_specs=(x4, x4, x4, P(rows, None)), out_specs=x4,
                         check_vma=False)(q, k, v, doc_start)


# its own jit: tokamax's op binds and lowers its kernel in Python at every call the tracer
# meets (four MLA layers, forward, remat and backward); jitted, each shape is traced once
@functools.partial(jax.jit, static_argnames=("scale",))
def _flash_kernel(q, k, v, doc_start, scale: float):
    from tokamax._src.ops.attention import base as tk_base
    from tokamax._src.ops.attention.api import IMPLEMENTATIONS

    mask = tk_base.Mask(k_start=doc_start[:, None, :], is_causal=True)
    errors = []
    for name in _KERNELS:
        if name not in IMPLEMENTATIONS:
            continue
        try:
            return IMPLEMENTATIONS[name](q, k, v, mask=mask, logits_scale=scale)
        except NotImplementedError as e:  # tokamax's way of declining a shape or device
            errors.append(f"{name}: {e}")
    raise ValueError(f"no flash-attention kernel takes q {q.shape} {q.dtype}, k {k.shape}, v {v.shape}: "
                     + "; ".join(errors))


# --------------------------------------------------------------------------------------
# planning stand-in: what the kernel keeps (q, k, v, o and an fp32 log-sum-exp per query
# head) and allocates, by cheap elementwise ops, so XLA:CPU can compile a GPU step's memory


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def memory_stand_in(q, k, v, doc_start, scale):
    return _stand_in_fwd(q, k, v, doc_start, scale)[0]


def _stand_in_fwd(q, k, v, doc_start, scale):
    B, T, H, _ = q.shape
    rep = H // k.shape[2]
    s = (jnp.sum(q.astype(F32), -1) + jnp.repeat(jnp.sum(k.astype(F32), -1), rep, axis=2)) * scale  # [B,T,H]
    s = s + doc_start[..., None].astype(F32)
    o = (jnp.repeat(v.astype(F32), rep, axis=2) * s[..., None]).astype(q.dtype)
    return o, (q, k, v, o, jnp.moveaxis(s, 1, 2), doc_start)  # lse [B,H,T] fp32, as the kernel keeps


def _stand_in_bwd(scale, res, do):
    q, k, v, o, lse, doc_start = res
    H, Hkv = q.shape[2], k.shape[2]
    t = jnp.sum(do.astype(F32) * o.astype(F32), -1) + jnp.moveaxis(lse, 1, 2)  # [B,T,H]
    t_kv = jnp.sum(t.reshape(*t.shape[:2], Hkv, H // Hkv), -1)
    grad = lambda x, w: (x.astype(F32) * w[..., None]).astype(x.dtype)  # noqa: E731
    return grad(q, t), grad(k, t_kv), grad(v, t_kv), None


memory_stand_in.defvjp(_stand_in_fwd, _stand_in_bwd)
