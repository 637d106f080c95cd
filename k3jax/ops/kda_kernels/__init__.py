"""Fused GPU kernels (Pallas, Triton lowering) for the chunked delta rule; see op.py."""

from k3jax.ops.kda_kernels.common import Tuning
from k3jax.ops.kda_kernels.op import chunk_delta_rule_fused, unsupported_reason

__all__ = ["Tuning", "chunk_delta_rule_fused", "unsupported_reason"]
