"""k3jax: pretrain the Kimi K3 hybrid architecture (KDA + gated MLA + Stable LatentMoE +
Block AttnRes) in JAX/Flax."""

__version__ = "0.1.0"
