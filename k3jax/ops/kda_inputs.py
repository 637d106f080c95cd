"""Random inputs of the KDA operator as the layer feeds it, for the tests and the GPU benchmarks.

q and k l2-normalised per head, v and the initial state standard normal, K3's bounded gate
g = lower_bound * sigmoid(x - 1) (per channel, or per head for the scalar-decay relatives) and a
sigmoid beta. float64 NumPy arrays, drawn in one fixed order from `seed`, so a test and a
benchmark given the same seed and shapes see the same inputs.
"""

from __future__ import annotations

import numpy as np


def kda_inputs(seed: int, B: int, T: int, H: int, K: int, V: int, *, lower_bound: float = -5.0,
               decay: str = "channel") -> tuple[np.ndarray, ...]:
    """(q [B,T,H,K], k [B,T,H,K], v [B,T,H,V], g [B,T,H,K] with decay="channel", else [B,T,H]
    (one decay per head), beta [B,T,H], s0 [B,H,K,V])."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, V))
    shape = (B, T, H, K) if decay == "channel" else (B, T, H)
    g = lower_bound / (1 + np.exp(-rng.standard_normal(shape) - 1.0))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    s0 = rng.standard_normal((B, H, K, V))
    return q, k, v, g, beta, s0
