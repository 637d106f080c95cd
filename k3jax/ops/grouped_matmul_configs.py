"""Launch configs for tokamax's sm90 (H100/H200) grouped-GEMM kernels, measured on an H200.

tokamax's fallback for a shape it has no tuned config for is one small tile for every shape
(64 x 64 outputs, block_k 128, two stages). `benchmarks/results/gmm-2026-12-02/gmm_configs.py` swept k3-small's six
expert GEMMs on an H200 (2026-12-02, `benchmarks/results/gmm-2026-12-02/`, BENCHMARKS.md
§3): for every grouped dot (forward, and dx as a dot with the weights transposed) one tile,
128 x 128 outputs with block_k 64 and two stages, was the fastest or within 1 % of it, at
1.40-1.83x the fallback's speed (0.40 ms against 0.67 for x [262144, 768] . w [64, 768, 512]).
For the weight gradient tokamax's fallback is not only slower but wrong (`SM90_CONTRACT`).

Pure data and a rule, no tokamax import (`k3jax.ops.tokamax_ragged_dot` turns the fields into
tokamax's Config).
"""

from __future__ import annotations

# the grouped dot's tile: rows [M,K] by a group's [K,N]; the one setting that led every measured shape
SM90_DOT = dict(block_m=128, block_n=128, block_k=64, num_stages=2, persistent=False, grid_minor_dim="M",
                grid_tile_width=1)
# the weight gradient's (ragged-contracting) tile. tokamax's fallback for it, 64 x 64 outputs with
# block_k 128 and two stages, computed WRONG results on an H200 (`benchmarks/checks/gmm_check.py`,
# 2026-12-02: 1.2 % relative error in norm, 9 % at the worst element, against an fp32 reference,
# at k3-small's shapes with uniform routing); so did every tile with 128 rows or columns. Block_k
# 64 with two stages agreed with the reference to 5e-6 and ran 1.20-1.25 ms against 1.30-1.42 in
# that lease, but in a later one it was 1.3e-2 off on the same inputs and a training step with it
# went NaN: tokamax's kernel is not reliable on sm90 at any tile tried, so k3jax's Pallas kernel
# (`k3jax.ops.grouped_dw`) computes the weight gradient by default and this tile serves only
# model.moe.gmm_weight_grad=tokamax and shapes that kernel cannot take.
SM90_CONTRACT = dict(block_m=64, block_n=64, block_k=64, num_stages=2, persistent=False, grid_minor_dim="M",
                     grid_tile_width=1)


def sm90_config(kind: str, k: int, n: int, out_bytes: int) -> dict | None:
    """Config fields (block_m, block_n, block_k, num_stages, persistent, grid_minor_dim 'M'|'N',
    grid_tile_width) for one grouped GEMM, or None for tokamax's own choice.

    kind 'dot': rows [M,k] times a group's [k,n] -> [M,n] in out_bytes-wide elements;
    'contract': the weight gradient, rows [M,k]^T times rows [M,n] per group -> [G,k,n].
    The measured dot tile is used where it divides the shape (k by 64, n by 128); the weight
    gradient's tile always (tokamax's own fallback there is wrong on sm90: `SM90_CONTRACT`)."""
    if kind not in ("dot", "contract"):
        raise ValueError(f"grouped GEMM kind must be 'dot' or 'contract', got {kind!r}")
    if kind == "dot" and k % SM90_DOT["block_k"] == 0 and n % SM90_DOT["block_n"] == 0 and out_bytes in (2, 4):
        return dict(SM90_DOT)
    if kind == "contract":
        return dict(SM90_CONTRACT)
    return None
