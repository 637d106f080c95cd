"""Decoding: init_cache / prefill / decode_step / decode_loop, and `generate` (greedy or
temperature + top-p).

    cache = init_cache(model, batch, max_len)
    logits, cache = prefill(model, prompt, cache)            # prompt [B,T]
    logits, cache = decode_step(model, token, cache)         # token [B]
    tokens, cache = decode_loop(model, token, cache, steps=32)   # on the device: one scan
    tokens = generate(model, prompt, max_new_tokens=32, temperature=0.8, top_p=0.9, seed=0)

The cache holds, per KDA layer, the fp32 state [H,K,V] and the short-conv windows; per
MLA layer, only the 576-value latent per token. AttnRes and MoE keep nothing across time.

`generate` prefills in chunks (`prefill_chunk` tokens per call, the logits of each chunk's last
token only) and decodes with `decode_loop`: one compiled `lax.scan` over the new tokens, with
sampling on the device, so no token makes a round trip to the host. The fast paths of a step
(model.decode_impl: MLA's latent attention and KDA's fused step as Pallas kernels; the MoE
reading only its routed experts at small batch) are checked against the plain ones in
tests/test_decode_fast.py.
"""

from __future__ import annotations

import functools

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


def prefill(model, tokens, cache, *, segment_ids=None, last_only: bool = False):
    """tokens [B,T] -> (logits [B,T,V] fp32, cache). segment_ids [B,T] may pack several
    documents (ids >= 1 per document, unique per row, also against the cache's documents).
    last_only (static): the last token's logits only, [B,1,V]."""
    _check_ids(segment_ids, cache, "prefill segment_ids")
    return model.forward_cached(tokens, cache, segment_ids=segment_ids, last_only=last_only)


def decode_step(model, token, cache, *, segment_ids=None):
    """token [B] -> (logits [B,V] fp32, cache). segment_ids [B] may start a new document."""
    seg = None if segment_ids is None else segment_ids[:, None]
    _check_ids(seg, cache, "decode_step segment_ids")
    logits, cache = model.forward_cached(token[:, None], cache, segment_ids=seg)
    return logits[:, 0], cache


def decode_loop(model, token, cache, *, steps: int, key=None, temperature: float = 0.0, top_p: float = 1.0,
                return_logits: bool = False):
    """`steps` decode steps in one `lax.scan` (call it under jit; steps, temperature, top_p and
    return_logits are static). token [B]: the last sampled token, not yet in the cache.

    Returns (tokens [steps, B] int32, the tokens each step sampled; cache), and the logits
    [steps, B, V] fp32 of every step when return_logits. Each row continues its last document."""
    graphdef, state = nnx.split(model)
    key = jax.random.PRNGKey(0) if key is None else key

    def body(carry, _):
        token, cache, key = carry
        logits, cache = decode_step(nnx.merge(graphdef, state), token, cache)
        key, sub = jax.random.split(key)
        token = sample_logits(logits, sub, temperature=temperature, top_p=top_p)
        return (token, cache, key), ((token, logits) if return_logits else token)

    (_, cache, _), out = jax.lax.scan(body, (token.astype(jnp.int32), cache, key), None, length=steps)
    if return_logits:
        return out[0], cache, out[1]
    return out, cache


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
             seed: int = 0, max_len: int | None = None, prefill_chunk: int = 8192):
    """prompt [B,T] int -> [B, T + max_new_tokens] (the prompt followed by the new tokens).

    The prompt is prefilled `prefill_chunk` tokens per call; the new tokens come from one
    compiled on-device loop (`decode_loop`)."""
    prompt = jnp.asarray(prompt, jnp.int32)
    B, T = prompt.shape
    max_len = max_len or T + max_new_tokens
    if T + max_new_tokens > max_len:
        raise ValueError(f"generate: prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds max_len={max_len}")
    if prefill_chunk < 1:
        raise ValueError(f"generate: prefill_chunk must be >= 1, got {prefill_chunk}")
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def _prefill(state, tokens, cache):
        logits, cache = prefill(nnx.merge(graphdef, state), tokens, cache, last_only=True)
        return logits[:, -1], cache

    @functools.partial(jax.jit, static_argnums=(4,), donate_argnums=(2,))
    def _decode(state, token, cache, key, steps):
        return decode_loop(nnx.merge(graphdef, state), token, cache, steps=steps, key=key, temperature=temperature,
                           top_p=top_p)

    key = jax.random.PRNGKey(seed)
    cache = model.init_cache(B, max_len)
    for start in range(0, T, prefill_chunk):
        logits, cache = _prefill(state, prompt[:, start:start + prefill_chunk], cache)
    key, sub = jax.random.split(key)
    token = sample_logits(logits, sub, temperature=temperature, top_p=top_p)
    out = [token[:, None]]
    if max_new_tokens > 1:
        tokens, cache = _decode(state, token, cache, key, max_new_tokens - 1)
        out.append(tokens.T)
    return jnp.concatenate([prompt] + out, axis=1)
