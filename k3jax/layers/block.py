"""One decoder layer: mixer + FFN, joined by Block AttnRes or by plain pre-norm residuals.

With Block AttnRes the carry is {prefix [B,T,d], blocks [NB,B,T,d], num_blocks}:

    h = attn_res(blocks, prefix, self_attention_res)
    if layer % block_size == 0: push prefix as a block; prefix = 0
    prefix += mixer(input_layernorm(h))
    h = attn_res(blocks, prefix, mlp_res)
    prefix += ffn(post_attention_layernorm(h))

Without it the carry is {h} and h += mixer(norm(h)); h += ffn(norm(h)).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from k3jax.layers import decode_gemv
from k3jax.layers.activations import GatedMLP
from k3jax.layers.attention import SoftmaxAttention
from k3jax.layers.attnres import AttnResSite, push_block, push_block_if
from k3jax.layers.kda import LINEAR_MIXERS, DeltaMixer
from k3jax.layers.mla import GatedMLA
from k3jax.layers.moe import StableLatentMoE
from k3jax.layers.norms import RMSNorm
from k3jax.layers.common import EMBED
from k3jax.layers.token_sharding import constrain_rows, gather_tokens


def make_mixer(model_cfg, kind: str, rngs: nnx.Rngs):
    if kind in LINEAR_MIXERS:
        return DeltaMixer(model_cfg, kind, rngs=rngs)
    if kind == "mla":
        return GatedMLA(model_cfg, rngs=rngs)
    if kind == "softmax":
        return SoftmaxAttention(model_cfg, rngs=rngs)
    raise ValueError(f"unknown mixer {kind!r}")


class DecoderLayer(nnx.Module):
    def __init__(self, model_cfg, mixer: str, ffn: str, *, rngs: nnx.Rngs):
        d, eps = model_cfg.d_model, model_cfg.rms_norm_eps
        self.mixer_kind, self.ffn_kind = mixer, ffn
        self.attn_res = model_cfg.attn_res_block_size > 0
        if self.attn_res:
            self.self_attention_res = AttnResSite(d, eps=eps, impl=model_cfg.attn_res_impl)
            self.mlp_res = AttnResSite(d, eps=eps, impl=model_cfg.attn_res_impl)
        self.input_layernorm = RMSNorm(d, eps=eps, axis_name=EMBED)
        self.self_attn = make_mixer(model_cfg, mixer, rngs)
        self.post_attention_layernorm = RMSNorm(d, eps=eps, axis_name=EMBED)
        if ffn == "moe":
            self.block_sparse_moe = StableLatentMoE(model_cfg, rngs=rngs)
        else:
            self.mlp = GatedMLP(d, model_cfg.ffn_hidden, model_cfg, rngs=rngs)

    def _ffn(self, x, bias, token_mask, residual=None):
        if self.ffn_kind == "moe":
            return self.block_sparse_moe(x, bias, token_mask=token_mask, residual=residual)
        return self.mlp(x, addends=() if residual is None else (residual,)), None

    def __call__(self, carry, *, push: bool, bias=None, segment_ids, positions, token_mask=None,
                 cache=None, ctx=None, max_logits: bool = False):
        """carry as in the module docstring; `push` closes an AttnRes block first: a Python bool,
        or a traced bool scalar when the scan decides it per repetition (see `push_block_if`);
        `max_logits` (static) asks an MLA mixer for its per-head max logits (QK-Clip).

        Returns (carry, next cache or None, aux): aux holds "router_stats" (MoE layers) and
        "mla_max_logits" [H] (MLA layers, when asked), nothing else.
        """
        want_max = max_logits and self.mixer_kind == "mla"
        aux = {}

        # sequence parallelism (k3jax.layers.token_sharding.constrain_rows): the norms and AttnRes run on
        # this device's share of the tokens; the mixer and the FFN see them all, and their
        # outputs go back to the share
        def mix(x, normed=False, residual=None):
            out = self.self_attn(gather_tokens(x if normed else self.input_layernorm(x)), segment_ids=segment_ids,
                                 positions=positions, cache=cache, ctx=ctx,
                                 **({"max_logits": True} if want_max else {}),
                                 **({"residual": residual} if residual is not None else {}))
            if want_max:
                aux["mla_max_logits"] = out[2]
            return constrain_rows(out[0]), out[1]

        def ffn(x, normed=False, residual=None):
            h = x if normed else self.post_attention_layernorm(x)
            # the MoE keeps each token where it is (its exchange and router run per token);
            # a dense MLP, split over tensor, reads them all
            h = h if self.ffn_kind == "moe" else gather_tokens(h)
            f, stats = self._ffn(h, bias, token_mask, residual)
            if stats is not None:
                aux["router_stats"] = stats
            return constrain_rows(f)

        if not self.attn_res:
            h = carry["h"]
            a, new_cache = mix(h)
            h = h + a
            return {"h": h + ffn(h)}, new_cache, aux

        prefix, blocks, n = carry["prefix"], carry["blocks"], carry["num_blocks"]
        # a decode step: each AttnRes site and the norm after it in one kernel (AttnResSite.mix_norm)
        fused = decode_gemv.active()
        if fused:
            h = self.self_attention_res.mix_norm(blocks, n, prefix, self.input_layernorm)
        else:
            # each site passes the block buffer through (AttnResSite.mix): later uses read the
            # returned buffer, so the site's backward adds its gradient to theirs in place
            h, blocks = self.self_attention_res.mix(blocks, n, prefix)
        if isinstance(push, bool):
            if push:
                blocks, n = push_block(blocks, n, prefix)
                prefix = jnp.zeros_like(prefix)
        else:
            blocks, n, prefix = push_block_if(push, blocks, n, prefix)
        if fused:  # the residual adds inside the output projections' kernels (prefix + a, prefix + ffn)
            pushed = isinstance(push, bool) and push  # the prefix was just zeroed: nothing to add
            prefix, new_cache = mix(h, normed=True, residual=None if pushed else prefix)
            h = self.mlp_res.mix_norm(blocks, n, prefix, self.post_attention_layernorm)
            return {"prefix": ffn(h, normed=True, residual=prefix), "blocks": blocks, "num_blocks": n}, new_cache, aux
        a, new_cache = mix(h)
        prefix = prefix + a
        h, blocks = self.mlp_res.mix(blocks, n, prefix)
        return {"prefix": prefix + ffn(h), "blocks": blocks, "num_blocks": n}, new_cache, aux
