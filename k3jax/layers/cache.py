"""What a mixer needs to know about the decode cache it is reading and writing.

The model owns one `DecodeContext` per call of prefill / decode_step; each mixer owns
its own cache arrays (KDA: fp32 state + conv windows; MLA: latent + shared key;
softmax: K/V). Packed prompts are allowed: a mixer attends (or carries state) only
within a segment, and a new segment id on the first token resets it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax


@jax.tree_util.register_dataclass
@dataclass
class DecodeContext:
    """index: int32 scalar, the cache slot of x's first token (x fills [index, index+T)).
    kv_segment_ids: [B, S] int32, segment id of every cache slot *after* this call's
        writes; -1 marks an empty slot (never attended).
    prev_segment_ids: [B] int32, segment id of slot index-1 (-1 when index == 0); a
        recurrent mixer resets its state when x's first token has another id.
    """

    index: jax.Array
    kv_segment_ids: jax.Array
    prev_segment_ids: jax.Array
