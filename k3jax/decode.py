"""Decoding: init_cache / prefill / decode_step, and `generate` (greedy or temperature + top-p).

    cache = init_cache(model, batch, max_len)
    logits, cache = prefill(model, prompt, cache)            # prompt [B,T]
    logits, cache = decode_step(model, token, cache)         # token [B]
    tokens = generate(model, prompt, max_new_tokens=32, temperature=0.8, top_p=0.9, seed=0)

The cache holds, per KDA layer, the fp32 state [H,K,V] and the short-conv windows; per
MLA layer, only the 576-value latent per token. AttnRes and MoE keep nothing across time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.segments import check_segment_ids


def init_cache(model, batch: int, max_len: int, dtype=None):
    return model.init_cache(batch, max_len, dtype)


def _check_ids(segment_ids, cache, where):
    """The segment contract (k3jax/segments.py) on ids given as host values: ids >= 0, one id
    per document per row, counting the documents already in the cache (an id reused for a new
    document would join the old one in attention but not in the recurrent state). Traced ids
    (inside jit) are not checked."""
    if segment_ids is None or isinstance(segment_ids, jax.core.Tracer):
        return
    previous = cache.get("segment_ids")
    if isinstance(previous, jax.core.Tracer):
        previous = None
    check_segment_ids(np.asarray(segment_ids), where, None if previous is None else np.asarray(previous))


def prefill(model, tokens, cache, *, segment_ids=None):
    """tokens [B,T] -> (logits [B,T,V] fp32, cache). segment_ids [B,T] may pack several
    documents (ids >= 1 per document, unique per row, also against the cache's documents)."""
    _check_ids(segment_ids, cache, "prefill segment_ids")
    return model.forward_cached(tokens, cache, segment_ids=segment_ids)


def decode_step(model, token, cache, *, segment_ids=None):
    """token [B] -> (logits [B,V] fp32, cache). segment_ids [B] may start a new document."""
    seg = None if segment_ids is None else segment_ids[:, None]
    _check_ids(seg, cache, "decode_step segment_ids")
    logits, cache = model.forward_cached(token[:, None], cache, segment_ids=seg)
    return logits[:, 0], cache


def sample_logits(logits, key, *, temperature: float, top_p: float):
    """logits [B,V] -> token [B]: argmax at temperature 0, else nucleus sampling."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always the top token)
        keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(model, prompt, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, max_len: int | None = None):
    """prompt [B,T] int -> [B, T + max_new_tokens] (the prompt followed by the new tokens)."""
    prompt = jnp.asarray(prompt, jnp.int32)
    B, T = prompt.shape
    max_len = max_len or T + max_new_tokens
    if T + max_new_tokens > max_len:
        raise ValueError(f"generate: prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds max_len={max_len}")
    graphdef, state = nnx.split(model)

    @jax.jit
    def _prefill(state, tokens, cache):
        return prefill(nnx.merge(graphdef, state), tokens, cache)

    @jax.jit
    def _step(state, token, cache, key):
        logits, cache = decode_step(nnx.merge(graphdef, state), token, cache)
        return sample_logits(logits, key, temperature=temperature, top_p=top_p), cache

    key = jax.random.PRNGKey(seed)
    cache = model.init_cache(B, max_len)
    logits, cache = _prefill(state, prompt, cache)
    key, sub = jax.random.split(key)
    token = sample_logits(logits[:, -1], sub, temperature=temperature, top_p=top_p)
    out = [np.asarray(token)]
    for _ in range(max_new_tokens - 1):
        key, sub = jax.random.split(key)
        token, cache = _step(state, token, cache, sub)
        out.append(np.asarray(token))
    return jnp.concatenate([prompt, jnp.asarray(np.stack(out, axis=1))], axis=1)
