"""attend(): the one public attention call over a KV cache."""

from __future__ import annotations

import numpy as np

from . import backends
from .cache import KVCache


def attend(q, cache: KVCache, *, backend: str = "auto", scale: float | None = None, counts=None,
           q_sink=None):
    """Attention of the tokens just appended to ``cache`` over everything each may see.

    Write, then attend: append the chunk's K/V first, then call this with the chunk's queries.

    Parameters
    ----------
    q : [batch, q_heads, T, head_dim] float array on the cache's device; q_heads a multiple of kv_heads
    cache : KVCache
    backend : {"auto", "cpu", "gpu", "reference"}
    scale : float, optional
        Multiplier of q.k; default 1/sqrt(head_dim) (we divide by sqrt(d), as the scaled dot product does).
    counts : int [batch], optional
        Real query rows per sequence; default: the counts of the cache's most recent append.
        Query t < counts[b] sits at absolute position ``lengths[b] - counts[b] + t``.
    q_sink : [batch, q_heads, T, head_dim], optional
        The queries scored against the sink keys instead of q (sinks caches; ignored otherwise). A model
        that positions keys within the cache passes q rotated at its cache position here (see
        docs/DESIGN.md §13); default q, i.e. absolute positions throughout.

    Returns
    -------
    out : [batch, q_heads, T, head_dim], q's dtype; padding rows are 0
    lse : [batch, q_heads, T] float32, log-sum-exp of the scaled scores (-inf on padding rows)

    Examples
    --------
    >>> from streamattn import CacheSpec, KVCache
    >>> cache = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=8, window=4))
    >>> x = np.ones((1, 1, 1, 8), np.float32)
    >>> cache.append(x, x)
    >>> out, lse = attend(x, cache, backend="cpu")
    >>> out.shape, float(out[0, 0, 0, 0])
    ((1, 1, 1, 8), 1.0)
    """
    spec = cache.spec
    fn = backends.get(backend, cache.device)
    if q.ndim != 4 or q.shape[0] != spec.batch or q.shape[3] != spec.head_dim \
            or q.shape[1] % spec.kv_heads or q.shape[1] == 0:
        raise ValueError(f"q must have shape [batch={spec.batch}, q_heads=k*{spec.kv_heads}, T, "
                         f"head_dim={spec.head_dim}] (got {tuple(q.shape)})")
    T = q.shape[2]
    if q_sink is not None and (tuple(q_sink.shape) != tuple(q.shape) or type(q_sink) is not type(q)):
        raise ValueError(f"q_sink must be an array like q, shape {tuple(q.shape)} "
                         f"(got {type(q_sink).__name__} {tuple(getattr(q_sink, 'shape', ()))})")
    if not spec.sinks:
        q_sink = None                                   # no sink keys: nothing scores against it
    counts = cache.last_counts if counts is None else np.asarray(counts, dtype=np.int64)
    if counts.shape != (spec.batch,) or counts.min() < 0 or counts.max() > T \
            or (counts > cache.lengths).any():
        raise ValueError(f"counts must be {spec.batch} ints in 0..min(T={T}, lengths) "
                         f"(got {counts.tolist()}, lengths {cache.lengths.tolist()})")
    if spec.window is not None and counts.max() > spec.max_chunk:
        raise ValueError(f"counts {counts.tolist()} exceed max_chunk={spec.max_chunk}: queries older than "
                         "one chunk may have lost keys to the ring")
    short = np.nonzero(counts > cache.answerable())[0] if spec.window is not None else ()
    if len(short):
        b = int(short[0])
        raise ValueError(f"sequence {b} can attend only its newest {int(cache.answerable()[b])} tokens exactly "
                         f"(asked for {int(counts[b])}): after a rewind its ring holds keys from position "
                         f"{int(cache.held_from[b])} on; append new tokens and attend those")
    scale = 1.0 / float(np.sqrt(spec.head_dim)) if scale is None else float(scale)
    return fn(q, cache.k, cache.v, cache.lengths, counts, window=spec.window or 0, sinks=spec.sinks,
              scale=scale, kind=spec.dtype, q_sink=q_sink)
