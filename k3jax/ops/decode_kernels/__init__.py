"""Pallas kernels for decoding and cached prefill (Triton lowering on GPU, the interpreter on CPU).

    mla_decode.latent_decode_attention   one query token per row over MLA's latent cache (absorbed form)
    mla_prefill.expanded_prefill_attention  a prompt chunk over the cache (expanded keys, flash style)
    kda_step.kda_decode_step              KDA's recurrent step, state read once and written once

Each module keeps its XLA reference beside the kernel; `common.resolve_impl` picks one.
"""
