"""Cache state: fork a sequence, rewind a sequence (snapshots to a file: ``streamattn.kv.snapshot``).

The state of one layer's ``KVCache`` is everything attention depends on:

    spec          CacheSpec (mode, sizes, dtype)
    k, v          [batch, kv_heads, slots, head_dim] storage (bfloat16 as uint16 bits)
    lengths       int64 [batch]   tokens seen = next absolute position
    last_counts   int64 [batch]   queries of the last append (what ``attend`` answers by default)
    held_from     int64 [batch]   oldest ring position still held (window caches; see cache.py)

Only ``KVCache`` writes these fields: this module decides whether a fork or rewind is allowed and then
calls the cache's own operations (``export_state``, ``write_sequence``, ``truncate``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..runtime.arrays import check_sequence_index
from .cache import KVCache
from .spec import POLICY_FIELDS, CacheSpec

__all__ = ["fork", "rewind", "can_rewind", "refusal", "RewindError"]


class RewindError(ValueError):
    """A rewind a window cache cannot do exactly; the message names the numbers; nothing changed."""


# -- fork ----------------------------------------------------------------------------------------
def fork(cache: KVCache, src: int, dst: int, *, into: KVCache | None = None) -> None:
    """Copy sequence ``src``'s state into sequence ``dst`` of the same cache or of ``into``.

    Both branches then continue independently; each equals full attention over its own history.
    ``into`` must have the same spec apart from ``batch`` (and ``check_finite``); it may live on
    another device. ``dst``'s previous state is replaced.

    Examples
    --------
    >>> cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=8, window=4, max_chunk=3))
    >>> cache.append(np.ones((2, 1, 3, 8)), np.ones((2, 1, 3, 8)), counts=[3, 0])
    >>> fork(cache, 0, 1); cache.lengths.tolist()
    [3, 3]
    """
    target = cache if into is None else into
    for name, c in (("cache", cache), ("into", target)):
        if not isinstance(c, KVCache):
            raise TypeError(f"{name} must be a KVCache (got {type(c).__name__})")
    src = check_sequence_index("src", src, cache.spec.batch)
    dst = check_sequence_index("dst", dst, target.spec.batch)
    diff = [n for n in (f.name for f in dataclasses.fields(CacheSpec))
            if n not in POLICY_FIELDS + ("batch",) and getattr(cache.spec, n) != getattr(target.spec, n)]
    if diff:
        raise ValueError(f"cannot fork into a cache with another spec: {', '.join(diff)} differ "
                         f"({cache.spec} vs {target.spec})")
    if target is cache and src == dst:
        return
    st = cache.export_state(slice(src, src + 1))              # k, v: [1, kv_heads, n, head_dim]
    sinks = {n: st[n][0] for n in ("sink_k", "sink_v") if n in st}   # sinks kept apart: their rows too
    target.write_sequence(dst, st["k"][0], st["v"][0], length=int(st["lengths"][0]),
                          last_count=int(st["last_counts"][0]), held_from=int(st["held_from"][0]), **sinks)


# -- rewind --------------------------------------------------------------------------------------
def rewind(cache: KVCache, b: int, k: int) -> None:
    """Drop the last ``k`` tokens of sequence ``b``: afterwards it is as if they were never appended.

    Always possible in a causal cache. In a window cache it is possible exactly when the keys the next
    query needs have not been overwritten; otherwise ``RewindError`` names the numbers and nothing changes.

    When a window rewind is exact. Notation: n_s sinks, n_c window, C = max_chunk, R = slots - n_s =
    n_c + C - 1 ring slots, L the length before and L' = L - k after.

    * What the ring holds. Position j >= n_s lives in slot n_s + (j - n_s) mod R, so writing j destroys
      j - R. After appends alone the ring holds the last R positions, max(n_s, L - R) .. L - 1; the cache
      records the oldest one it still holds as ``held_from[b]`` (a rewind cannot bring back what the
      dropped tokens overwrote, so after one it can be higher than max(n_s, L - R)).
    * What the future needs. Next, a chunk of T <= C tokens is written at L' .. L'+T-1 and then attended.
      Its earliest query, at L', sees the sinks and max(n_s, L' - n_c + 1) .. L'; the old keys among them
      are  need = max(n_s, L' - n_c + 1) .. L' - 1.  The chunk's own writes destroy only L' - R ..
      L' + T - 1 - R, all below L' - n_c + 1 because T <= C (the C - 1 slack), and every later chunk moves
      both ends forward by the same count; so if the first query after the rewind is exact, all are.
    * The rule: the rewind is allowed iff  need >= held_from  or  need >= L'  (no old key needed).

    With no earlier rewind (held_from = max(n_s, L - R)) this reads: allowed iff
      - L <= slots (the ring never wrapped: nothing was overwritten), or
      - k <= C: the ring holds R = n_c + C - 1 positions, R - k of them below L', and the next query
        needs n_c - 1 of those: R - k >= n_c - 1 <=> k <= C; or
      - L' <= n_s (back into the sinks, which are never overwritten) or n_c = 1 (a query sees itself).
    In general, once the ring has wrapped, held_from = H - R for H the longest length reached since the
    ring last refilled, so the rule is L' >= H - C: rewinds add up (from a full ring, rewinding k1,
    appending T <= k1 and rewinding k2 is allowed while k1 - T + k2 <= C) until R new tokens past H
    have refilled the ring.
    Dropped tokens' slots are zeroed (they never share a slot with a held position, since
    held_from >= L - R); ``last_counts[b]`` becomes 0; ``held_from[b]`` becomes max(n_s, min(held_from, L')).
    Right after a rewind the newest remaining tokens can be re-attended only while their own keys are
    held: ``cache.answerable()`` says how many (after a rewind of exactly C, none until the next append).

    Examples
    --------
    >>> cache = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=8, window=4, max_chunk=2))  # R = 5
    >>> for _ in range(9): cache.append(np.ones((1, 1, 1, 8)), np.ones((1, 1, 1, 8)))
    >>> rewind(cache, 0, 2); cache.lengths.tolist()
    [7]
    >>> rewind(cache, 0, 1)
    Traceback (most recent call last):
    ...
    streamattn.kv.state.RewindError: cannot rewind sequence 0 by 1 (length 7 -> 6) in this window cache: ...
    """
    b = check_sequence_index("b", b, cache.spec.batch)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= cache.lengths[b]:
        raise ValueError(f"k must be an integer in 0..lengths[{b}]={int(cache.lengths[b])} (got {k!r})")
    why = refusal(cache, b, int(k))
    if why:
        raise RewindError(why)
    cache.truncate(b, int(k))


def can_rewind(cache: KVCache, b: int, k: int) -> bool:
    """Whether ``rewind(cache, b, k)`` is allowed: False for an integer ``k`` outside 0..lengths[b].

    Raises ValueError for ``b`` that is not a sequence index or ``k`` that is not an integer (as ``rewind``).
    """
    check_sequence_index("b", b, cache.spec.batch)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"k must be an integer (got {k!r})")
    return 0 <= k <= cache.lengths[b] and refusal(cache, b, int(k)) is None


def refusal(cache: KVCache, b: int, k: int) -> str | None:
    """Why sequence b of a window cache cannot be rewound by k (see :func:`rewind`), or None."""
    s = cache.spec
    if s.window is None or k == 0:
        return None
    L, held = int(cache.lengths[b]), int(cache.held_from[b])
    Lp = L - k
    need = max(s.sinks, Lp - s.window + 1)   # oldest old key the next query (at L') sees
    if need >= held or need >= Lp:
        return None
    return (f"cannot rewind sequence {b} by {k} (length {L} -> {Lp}) in this window cache: the next query "
            f"(position {Lp}) needs keys from position {need}, but the ring (R={cache.ring} slots) still holds "
            f"only positions {held}..{L - 1}; rewind it to length >= {held + s.window - 1} (at most "
            f"max_chunk={s.max_chunk} below the newest token the ring has held), "
            + (f"or to length <= {s.sinks} (sinks only), " if s.sinks else "or reset it, ")
            + "or build the cache with a larger max_chunk")
