"""Building blocks shared by every layer: parameters with logical axes, Dense, dtypes.

Conventions (every module in k3jax/layers follows them):
- A parameter is `nnx.Param(value, axes=(...))`: one logical axis name per dimension
  (`k3jax/sharding` maps names to mesh axes). Stacked (scanned) copies gain leading
  dimensions with no name.
- Kernels are stored [in, out] (JAX order); checkpoint names follow the K3 release.
- A kernel holding per-head projections records its head count as `heads` metadata: its
  HEADS axis is H heads, head-major ([.., H, K], or flat [.., H*K]). Per-Head Muon
  (train/optimizer.py) orthogonalises each head's slice on its own.
- Parameters live in `param_dtype`; matmuls run in `compute_dtype` with the result in
  `compute_dtype`. Norms, gates, routers and recurrent states run in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers import decode_gemv
from k3jax.ops.matmul_f32 import matmul_f32_out

# logical axis names (see k3jax/sharding/rules.py)
EMBED = "embed"          # d_model
VOCAB = "vocab"
HEADS = "heads"          # attention / KDA heads (tensor parallel)
HEAD_DIM = "head_dim"
MLP = "mlp"              # dense / shared FFN hidden width (tensor parallel)
EXPERT = "expert"        # routed experts (expert parallel)
EXPERT_MLP = "expert_mlp"
LATENT = "latent"        # LatentMoE latent width
LORA = "lora"            # low-rank bottlenecks (q/kv LoRA, gate ranks)
CONV = "conv"            # short-conv taps
NONE = None


class RouterBias(nnx.Variable):
    """Quantile-Balancing router bias: state, not a parameter (no gradient, no optimizer)."""


@dataclass(frozen=True)
class Dtypes:
    param: jnp.dtype
    compute: jnp.dtype

    @staticmethod
    def of(model_cfg) -> "Dtypes":
        return Dtypes(jnp.dtype(model_cfg.param_dtype), jnp.dtype(model_cfg.compute_dtype))


# Each parameter records how it was initialised (`init` metadata), so `materialize` can
# redraw a whole model in one fused random draw: XLA:CPU spends ~0.15 s compiling every
# separate random call site, which made a tiny model's init take over 10 s.


def normal_param(rngs: nnx.Rngs, shape, axes, std: float, dtype) -> nnx.Param:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, axes=tuple(axes), init=("normal", float(std)))


def uniform_param(rngs: nnx.Rngs, shape, axes, low: float, high: float, *, log: bool = False,
                  dtype=jnp.float32) -> nnx.Param:
    """U(low, high), or log(U(low, high)) with log=True (KDA's A_log)."""
    value = jax.random.uniform(rngs.params(), shape, jnp.float32, low, high)
    value = (jnp.log(value) if log else value).astype(dtype)
    return nnx.Param(value, axes=tuple(axes), init=("uniform", float(low), float(high), bool(log)))


def fill_param(shape, axes, fill: float, dtype=jnp.float32) -> nnx.Param:
    return nnx.Param(jnp.full(shape, fill, dtype), axes=tuple(axes), init=("fill", float(fill)))


MATERIALIZED_DRAW_MAX = 2**31  # random numbers (8 GiB in fp32), see `materialize`


def materialize(abstract_state, key):
    """Concrete values for an abstract (eval_shape) state, drawn from each Param's `init`
    metadata with one normal and one uniform draw for the whole model. Variables without
    `init` (e.g. RouterBias) start at zero."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    leaves, treedef = jax.tree.flatten(abstract_state, is_leaf=is_var)
    kinds = [(v.get_metadata().get("init") or ("fill", 0.0)) if is_var(v) else None for v in leaves]
    sizes = {"normal": 0, "uniform": 0}
    for v, kind in zip(leaves, kinds):
        if kind and kind[0] in sizes:
            sizes[kind[0]] += int(v.get_value().size)
    k1, k2 = jax.random.split(key)
    pools = {"normal": jax.random.normal(k1, (sizes["normal"],), jnp.float32),
             "uniform": jax.random.uniform(k2, (sizes["uniform"],), jnp.float32)}
    # Left alone, XLA fuses the draw (threefry, then erfinv for the normal) into every parameter's
    # slice of it: one copy of that code per parameter, each compiled on its own. k3-small's init
    # compiled for an H200 in 62 s, and unrolled (model.scan_layers=false, ~4x the parameter
    # arrays) in over 15 minutes, against 16.0 and 24.1 s with the draw computed once into a buffer
    # (compile-only, on a 2-core CPU: benchmarks/results/unrolled-deviceless-2026-12-07); k3-tiny's
    # on XLA:CPU 3.7 -> 2.7 s. The buffer costs the draw's size in memory while the init runs, on
    # every device if XLA replicates it, so a larger draw stays fused: partitioned, each device
    # computes only its own shard's values.
    pools = {k: jax.lax.optimization_barrier(v) if 0 < v.size <= MATERIALIZED_DRAW_MAX else v for k, v in pools.items()}
    offsets = {"normal": 0, "uniform": 0}
    out = []
    for v, kind in zip(leaves, kinds):
        if kind is None:
            out.append(v)
            continue
        shape, dtype = v.get_value().shape, v.get_value().dtype
        if kind[0] == "fill":
            value = jnp.full(shape, kind[1], dtype)
        else:
            n, o = int(v.get_value().size), offsets[kind[0]]
            raw = pools[kind[0]][o:o + n].reshape(shape)
            offsets[kind[0]] = o + n
            if kind[0] == "normal":
                value = raw * kind[1]
            else:
                _, low, high, log = kind
                value = low + (high - low) * raw
                value = jnp.log(value) if log else value
        out.append(v.replace(value=value.astype(dtype)))
    return jax.tree.unflatten(treedef, out)


class Dense(nnx.Module):
    """y = x @ W for W [in, *out] (no bias: K3 has none). Output shape [..., *out].

    `heads` > 0: the kernel's HEADS axis holds that many attention heads (see the top)."""

    def __init__(self, d_in: int, out, axes, *, rngs: nnx.Rngs, std: float, dtypes: Dtypes, heads: int = 0):
        out = (out,) if isinstance(out, int) else tuple(out)
        if len(axes) != 1 + len(out):
            raise ValueError(f"Dense: {len(axes)} axis names for a [{d_in}, {out}] kernel")
        self.kernel = normal_param(rngs, (d_in, *out), axes, std, dtypes.param)
        if heads:
            size = dict(zip(axes, (d_in, *out))).get(HEADS)
            if size is None or size % heads:
                raise ValueError(f"Dense: {heads} heads need a {HEADS} axis they divide, got axes {axes} "
                                 f"of a [{d_in}, {out}] kernel")
            self.kernel.set_metadata(heads=int(heads))
        self.compute = dtypes.compute

    def __call__(self, x, out_dtype=None, residual=None):
        """x @ W in the compute dtype (or `out_dtype`); plus `residual` (a residual stream, same
        shape as the output) when given, added after the output's rounding."""
        w = self.kernel[...]
        # a decode step's few rows: one gemv kernel (k3jax.layers.decode_gemv), else the dot
        if residual is not None:
            fast = decode_gemv.project(x, [w], [self.compute], addends=[residual], round_dtype=self.compute)
            return fast[0] if fast is not None else self(x) + residual
        fast = decode_gemv.project(x, [w], [self.compute], out_dtypes=[out_dtype or self.compute])
        if fast is not None:
            return fast[0]
        x, w = x.astype(self.compute), w.astype(self.compute)
        if out_dtype is not None and jnp.dtype(out_dtype) == jnp.float32:
            # fp32 result of low-precision operands (gates, logits): the backward stays in the
            # compute dtype instead of TF32 GEMMs on an fp32 cotangent (k3jax.ops.matmul_f32)
            return matmul_f32_out(x, w)
        y = jnp.tensordot(x, w, axes=1, preferred_element_type=out_dtype)
        return y if out_dtype is not None else y.astype(self.compute)
