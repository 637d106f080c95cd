"""What a mixer needs to know about the decode cache it is reading and writing.

The model owns one `DecodeContext` per call of prefill / decode_step; each mixer owns
its own cache arrays (KDA: fp32 state + conv windows; MLA: latent + shared key;
softmax: K/V). Packed prompts are allowed: a mixer attends (or carries state) only
within a segment, and a new segment id on the first token resets it.

Inside the model a mixer sees its cache through a `LayerCache`: the stage's arrays stacked
over its repeats, and this layer's repeat index. Writes are dynamic updates of the stacked
arrays at the slots written (a call's tokens, or a recurrent state), which XLA performs in
place on the scan's carry: a decode step never copies a cache it only appends to.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class DecodeContext:
    """index: int32 scalar, the cache slot of x's first token (x fills [index, index+T)).
    kv_segment_ids: [B, S] int32, segment id of every cache slot *after* this call's
        writes; -1 marks an empty slot (never attended).
    prev_segment_ids: [B] int32, segment id of slot index-1 (-1 when index == 0); a
        recurrent mixer resets its state when x's first token has another id.
    first_slot: [B] int32 or None, the first slot of the document of x's first token: no
        slot before it is visible to any of x's tokens (attention kernels start there).
    """

    index: jax.Array
    kv_segment_ids: jax.Array
    prev_segment_ids: jax.Array
    first_slot: jax.Array | None = None


class LayerCache:
    """One layer's cache inside its stage's stacked cache.

    arrays: name -> [R, B, ...] (R: the stage's repeats; the layers at one position of the
    repeated unit share them); layer: int32 scalar, this layer's repeat. Immutable: writes
    return a new view.
    """

    def __init__(self, arrays: dict, layer):
        self.arrays = dict(arrays)
        self.layer = jnp.asarray(layer, jnp.int32)

    @classmethod
    def of(cls, cache) -> tuple["LayerCache", bool]:
        """A view of `cache` (a LayerCache, or one layer's dict of arrays) and whether it was a dict."""
        if isinstance(cache, LayerCache):
            return cache, False
        return cls({k: v[None] for k, v in cache.items()}, 0), True

    def result(self, as_dict: bool):
        """What the mixer returns: the stacked arrays, or (as_dict) the layer's own dict."""
        return {k: self.get(k) for k in self.arrays} if as_dict else self.arrays

    def get(self, name):
        """This layer's array [B, ...] (a dynamic slice of the stacked one)."""
        return jax.lax.dynamic_index_in_dim(self.arrays[name], self.layer, 0, keepdims=False)

    def stacked(self, name):
        return self.arrays[name]

    def _with(self, name, value) -> "LayerCache":
        arrays = dict(self.arrays)
        arrays[name] = value
        return LayerCache(arrays, self.layer)

    def write_tokens(self, name, new, index) -> "LayerCache":
        """new [B,T,...] into this layer's slots [index, index+T)."""
        buf = self.arrays[name]
        zero = jnp.zeros((), jnp.int32)
        start = (self.layer, zero, jnp.asarray(index, jnp.int32)) + (zero,) * (buf.ndim - 3)
        return self._with(name, jax.lax.dynamic_update_slice(buf, new[None].astype(buf.dtype), start))

    def put(self, name, value) -> "LayerCache":
        """Replace this layer's whole array [B, ...]."""
        buf = self.arrays[name]
        return self._with(name, jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), self.layer, 0))

    def put_stacked(self, name, stacked) -> "LayerCache":
        """The stacked array after a kernel updated this layer's slice in place."""
        return self._with(name, stacked)
