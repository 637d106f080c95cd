"""The segment contract: how packed documents are marked, stated once for every mixer.

segment_ids [B,T] int32 marks which document each token of a row belongs to:

1. PAD_ID (0) is reserved for padding. Documents have ids >= 1 (DEFAULT_ID when a row
   holds one document and the caller gave no ids).
2. Within a row, a document's tokens are contiguous and its id is used by no other
   document of that row. So "same id" and "no document start in between" mean the same
   thing, and the mixers that join tokens by equal ids (attention) agree with the mixers
   that reset where the id changes (the delta-rule state, the short convolutions).
3. A document starts at token t exactly where `segment_starts` says: the id differs from
   token t-1's. At t = 0 the caller says whether the row continues what came before
   (decode: the cache's last slot; context parallelism: the upstream shard's last token).
4. What a mixer may assume, and must guarantee: nothing crosses a document start (no
   state, no conv input, no key). Padding is a run like any other, so it never leaks into
   a document; what is computed *for* padding tokens is ignored.
5. The loss and the routing statistics skip padding: `not_padding` is the one test.

`check_segment_ids` enforces 1 and 2 on host arrays where ids enter (the data pipeline,
the decode API) with a clear error; inside jit the contract is assumed, not checked.
The helpers work on numpy arrays (host data pipeline) and jax arrays alike.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from k3jax.config import ConfigError

PAD_ID = 0
DEFAULT_ID = 1


def _xp(x):
    return np if isinstance(x, np.ndarray) else jnp


def segment_starts(segment_ids, first=None):
    """[B,T] bool: True where a document starts (the id differs from the previous token's).

    first: [B] bool, whether t = 0 starts one (None: it continues what came before)."""
    xp = _xp(segment_ids)
    B = segment_ids.shape[0]
    head = xp.zeros((B, 1), bool) if first is None else xp.reshape(first, (B, 1)).astype(bool)
    return xp.concatenate([head, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def segment_counter(segment_ids, first=None):
    """[B,T] int32: the number of document starts at or before t (0 on the tokens that
    continue the state or window a call began with)."""
    xp = _xp(segment_ids)
    return xp.cumsum(segment_starts(segment_ids, first).astype(xp.int32), axis=1).astype(xp.int32)


def not_padding(segment_ids):
    """[B,T] bool: the tokens that belong to a document (loss, routing statistics)."""
    return segment_ids != PAD_ID


def positions_from_segments(segment_ids, start=None):
    """[B,T] int32 position of each token inside its document; `start` [B] offsets the
    row's first run (a document continued from a cache)."""
    xp = _xp(segment_ids)
    B, T = segment_ids.shape
    idx = xp.broadcast_to(xp.arange(T, dtype=xp.int32), (B, T))
    first = document_start(segment_ids)
    pos = idx - first
    if start is not None:
        pos = pos + xp.where(first == 0, start[:, None], 0)
    return pos.astype(xp.int32)


def document_start(segment_ids):
    """[B,T] int32: the position of the first token of each token's document within the
    row (0 for the row's first run). Attention's visible keys for query t are
    document_start[t] .. t, one integer per query instead of a [T,T] mask."""
    xp = _xp(segment_ids)
    B, T = segment_ids.shape
    idx = xp.broadcast_to(xp.arange(T, dtype=xp.int32), (B, T))
    return _cummax(xp, xp.where(segment_starts(segment_ids), idx, 0)).astype(xp.int32)


def _cummax(xp, x):
    if xp is np:
        return np.maximum.accumulate(x, axis=1)
    import jax

    return jax.lax.cummax(x, axis=1)


def contract_violation(segment_ids, previous=None) -> str | None:
    """Why host ids [B,T] break the contract, or None. previous: [B,S] ids already in a
    decode cache for these rows (-1 = empty slot), which the new tokens continue."""
    seg = np.asarray(segment_ids)
    if seg.ndim != 2:
        return f"segment_ids must be [B,T], got shape {seg.shape}"
    if not np.issubdtype(seg.dtype, np.integer):
        return f"segment_ids must be integers, got {seg.dtype}"
    if seg.size and seg.min() < 0:
        b, t = np.argwhere(seg < 0)[0]
        return f"segment id {seg[b, t]} at row {b}, token {t} is negative (ids are >= 0; {PAD_ID} is padding)"
    prev = None if previous is None else np.asarray(previous)
    for b in range(seg.shape[0]):
        row = seg[b]
        if prev is not None:  # the cache's filled slots come first, in order
            filled = prev[b][prev[b] >= 0]
            row = np.concatenate([filled, row])
        starts = np.flatnonzero(np.concatenate([[True], row[1:] != row[:-1]]))
        ids = row[starts]
        docs = ids[ids != PAD_ID]
        uniq, counts = np.unique(docs, return_counts=True)
        if (counts > 1).any():
            bad = uniq[counts > 1][0]
            return (f"row {b}: segment id {bad} marks two separate runs of tokens; every document "
                    f"needs its own id within a row (attention would join them, the recurrence would not)")
    return None


def check_segment_ids(segment_ids, where: str, previous=None):
    """Raise ConfigError naming `where` when host ids break the contract (see module doc)."""
    why = contract_violation(segment_ids, previous)
    if why:
        raise ConfigError(why, where)
