"""tokamax's grouped-GEMM kernels as k3jax calls them, with k3jax's launch configs where
tokamax has none for this GPU.

    call(lhs, rhs, group_sizes [G] int32, kind, out_dtype): kind 'dot', 'dot_trans_rhs', 'contract'

Imported only where the kernels run (a GPU with the `[gpu]` extra); `k3jax.ops.grouped_matmul`
holds the custom VJP, the per-kernel jits around these calls and the reference forms.

**Configs.** tokamax ships tuned configs for H100, B200 and A100, not for an H200, and its
sm90 fallback is one small tile for every shape (64 x 64 outputs, block_k 128, two stages).
`K3RaggedDot` is tokamax's Mosaic-GPU op with only that fallback replaced by the config
measured on an H200 (`k3jax.ops.grouped_matmul_configs`); a tuned config in
tokamax's cache (its own, or one `k3jax-train` tuned and saved: `train.autotune_budget_s`)
still wins over it, as over tokamax's own heuristic, except for the weight gradient's kernel:
on sm90 it always runs k3jax's tile, the only one it may be tuned to, because tokamax's own
fallback and several tiles of its tuning space compute wrong results there (BENCHMARKS.md §4).
That tile too was wrong in a later lease, so this kernel computes the weight gradient only with
model.moe.gmm_weight_grad=tokamax, or where k3jax's Pallas kernel cannot take the shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from tokamax._src.ops.ragged_dot import base
from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot
from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu_common import Config, MatmulDimension

from k3jax.ops.grouped_matmul_configs import SM90_CONTRACT, sm90_config

_M, _N = MatmulDimension.M, MatmulDimension.N


class K3RaggedDot(PallasMosaicGpuRaggedDot):
    """tokamax's Mosaic-GPU ragged dot; on sm90 (H100/H200) a shape with no tuned config runs
    k3jax's measured config (`grouped_matmul_configs.sm90_config`) instead of tokamax's one
    heuristic tile. Quantized operands keep tokamax's choice."""

    def _get_heuristics_config(self, ba):
        fallback = super()._get_heuristics_config(ba)
        lhs, rhs = ba.args[:2]
        if not isinstance(lhs, jax.Array | jax.ShapeDtypeStruct) or not isinstance(rhs, jax.Array | jax.ShapeDtypeStruct):
            return fallback  # QArrays: tokamax's quantized kernels
        from tokamax._src import gpu_utils

        if not gpu_utils.is_sm90():
            return fallback
        dims = ba.kwargs.get("ragged_dot_dimension_numbers", base.DEFAULT_RAGGED_DOT_DIM_NUMS)
        out = ba.kwargs.get("preferred_element_type") or jnp.result_type(lhs.dtype, rhs.dtype)
        if dims == base.RAGGED_CONTRACTING_DOT_DIM_NUMS:  # lhs [M,D], rhs [M,F] -> [G,D,F]
            chosen = sm90_config("contract", lhs.shape[1], rhs.shape[1], jnp.dtype(out).itemsize)
        else:  # lhs [M,K], rhs [G,K,N] (or [G,N,K] transposed)
            trans = dims == base.TRANS_RHS_RAGGED_DOT_DIM_NUMS
            K, N = (rhs.shape[2], rhs.shape[1]) if trans else (rhs.shape[1], rhs.shape[2])
            chosen = sm90_config("dot", K, N, jnp.dtype(out).itemsize)
        if chosen is None:
            return fallback
        return _config(chosen)

    def _get_autotuning_configs(self, ba):
        """What `train.autotune_budget_s` may pick from. The weight gradient's kernel on sm90:
        only k3jax's tile, since tokamax's space holds tiles that compute wrong results there and
        time fastest (128 x 128 x 64: garbage at 0.78 ms against 1.20 for the right tile;
        BENCHMARKS.md §4) and its autotuner times configs without checking them."""
        from tokamax._src import gpu_utils

        dims = ba.kwargs.get("ragged_dot_dimension_numbers", base.DEFAULT_RAGGED_DOT_DIM_NUMS)
        if dims == base.RAGGED_CONTRACTING_DOT_DIM_NUMS and gpu_utils.is_sm90():
            return {_config(SM90_CONTRACT)}
        return super()._get_autotuning_configs(ba)


def _config(fields: dict) -> Config:
    return Config(split_k=1, **{**fields, "grid_minor_dim": _M if fields["grid_minor_dim"] == "M" else _N})


_OP = K3RaggedDot()
# tokamax's Triton kernel where Mosaic GPU declines (not Hopper); never its "xla" fallback,
# jax.lax.ragged_dot, the dense expansion the blocked form exists to avoid: a kernel that
# declines everywhere fails loudly instead
_IMPLEMENTATIONS = (_OP, "triton")
# the weight gradient on sm90 always at k3jax's tile, even where tokamax's cache holds a config
# for the shape (its shipped H100 configs were never checked against a reference here)
_CONTRACT_IMPLEMENTATIONS = (K3RaggedDot(config=_config(SM90_CONTRACT)), "triton")


_DIMS = {"dot": base.DEFAULT_RAGGED_DOT_DIM_NUMS, "dot_trans_rhs": base.TRANS_RHS_RAGGED_DOT_DIM_NUMS,
         "contract": base.RAGGED_CONTRACTING_DOT_DIM_NUMS}


def call(lhs, rhs, group_sizes, kind: str, out_dtype):
    """One tokamax grouped GEMM. kind 'dot': lhs [M,K] rows sorted by group, rhs [G,K,N] ->
    [M,N]; 'dot_trans_rhs': rhs [G,N,K] used transposed; 'contract': lhs [M,K], rhs [M,N] ->
    [G,K,N], each group's rows contracted (the weight gradient)."""
    import tokamax
    from tokamax._src import gpu_utils

    impls = _CONTRACT_IMPLEMENTATIONS if kind == "contract" and gpu_utils.is_sm90() else _IMPLEMENTATIONS
    return tokamax.ragged_dot_general(lhs, rhs, group_sizes, _DIMS[kind], preferred_element_type=jnp.dtype(out_dtype),
                                      implementation=impls)
