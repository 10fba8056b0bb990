"""attend(): the one public attention call over a KV cache."""

from __future__ import annotations

import functools

import numpy as np

from . import backends
from .cache import KVCache
from .sink_parts import attend_parts
from .rotation import rotate
from .spec import QUANTIZED
from .storage import EXPONENT_BITS, bits, check_stored_finite, non_finite_error
from ..runtime.threads import serial_kernels


def attend(q, cache: KVCache, *, backend: str = "auto", scale: float | None = None, counts=None,
           q_sink=None, softcap: float | None = None):
    """Attention of the tokens just appended to ``cache`` over everything each may see.

    Write, then attend: append the chunk's K/V first, then call this with the chunk's queries.

    Parameters
    ----------
    q : [batch, q_heads, T, head_dim] float array on the cache's device; q_heads a multiple of kv_heads
    cache : KVCache
    backend : {"auto", "cpu", "gpu", "reference"}
    scale : float, optional
        Multiplier of q.k; default 1/sqrt(head_dim) (we divide by sqrt(d), as the scaled dot product does).
        Must be finite; q must be finite floats (NaN or inf in q or scale raises ValueError).
    counts : int [batch], optional
        Real query rows per sequence; default: the counts of the cache's most recent append.
        Query t < counts[b] sits at absolute position ``lengths[b] - counts[b] + t``.
    q_sink : [batch, q_heads, T, head_dim], optional
        The queries scored against the sink keys instead of q (sinks caches; ignored otherwise). A model
        that positions keys within the cache passes q rotated at its cache position here (see
        docs/DESIGN.md §5); default q, i.e. absolute positions throughout.

    A ``rotate_k`` cache (a quantized K by default) stores its keys as ``k @ H``; q and q_sink are rotated by
    the same H here, before any backend sees them (:mod:`streamattn.kv.rotation`), so callers pass q as for any
    cache and the scores are q·k in exact arithmetic.
    softcap : float, optional
        Attention logit soft-capping (Gemma-2): each scaled score s becomes softcap * tanh(s / softcap)
        before the mask and the softmax. None (default): none. Must be a finite number > 0.

    Returns
    -------
    out : [batch, q_heads, T, head_dim], q's dtype; padding rows are 0
    lse : [batch, q_heads, T] float32, log-sum-exp of the scaled scores (-inf on padding rows)

    A real row that sees a NaN or inf key or value (stored with ``check_finite=False``) comes back NaN in
    ``out`` and ``lse``, as the float64 oracle answers; never zeros, which would look like padding.

    At the float32 edge, with finite q, k and v (a ``check_finite`` cache): values so large that the
    weighted sum overflows while the answer does not (v = 3e38) are answered exactly (those rows are
    recomputed by the float64 reference, as it answers them); scores whose log-sum-exp is past float32
    (``|scale * q.k|`` > 3.4e38) raise ValueError naming the row. Both cost nothing on ordinary input:
    one check of ``out`` (q-sized) per call. (Host caches; a GPU cache keeps the NaN rule there.)

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
    if q.dtype.kind != "f" and q.dtype.name != "bfloat16":
        raise TypeError(f"q must hold floats (float16, float32 or float64; got dtype {q.dtype})")
    xp = cache.xp
    if not bool(xp.isfinite(q).all()):
        raise ValueError("q holds NaN or inf: attention of a non-finite query has no answer (the cache is "
                         "unchanged)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, np.number))
                              or not np.isfinite(float(scale))):
        raise ValueError(f"scale must be a finite number (got {scale!r})")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.number))
                                or not np.isfinite(float(softcap)) or softcap <= 0):
        raise ValueError(f"softcap must be a finite number > 0, or None for no soft-capping (got {softcap!r})")
    T = q.shape[2]
    if q_sink is not None and (tuple(q_sink.shape) != tuple(q.shape) or type(q_sink) is not type(q)):
        raise ValueError(f"q_sink must be an array like q, shape {tuple(q.shape)} "
                         f"(got {type(q_sink).__name__} {tuple(getattr(q_sink, 'shape', ()))})")
    if not spec.sinks:
        q_sink = None                                   # no sink keys: nothing scores against it
    if counts is None:
        counts = cache.last_counts
    else:
        raw = np.asarray(counts)
        if raw.dtype.kind not in "iu":   # bool, float (0.7 would truncate to 0), object: refused
            raise ValueError(f"counts must be an int array of shape ({spec.batch},) (got dtype {raw.dtype}: "
                             f"{raw.tolist()!r})")
        counts = raw.astype(np.int64)
    if counts.shape != (spec.batch,) or counts.min() < 0 or counts.max() > T \
            or (counts > cache.lengths).any():
        raise ValueError(f"counts must be {spec.batch} ints in 0..min(T={T}, lengths) "
                         f"(got {counts.tolist()}, lengths {cache.lengths.tolist()})")
    if spec.window is not None and counts.max() > spec.max_chunk:
        raise ValueError(f"counts {counts.tolist()} exceed max_chunk={spec.max_chunk}: queries older than "
                         "one chunk may have lost keys to the ring")
    _check_answerable(cache, counts)
    q, q_sink = _frame(q, q_sink, cache)
    return _run(fn, q, cache, 1.0 / float(np.sqrt(spec.head_dim)) if scale is None else float(scale), counts,
                q_sink, None if softcap is None else float(softcap), edge=True)


def append_attend(q, k, v, cache: KVCache, *, backend: str, scale: float, counts=None, q_sink=None,
                  softcap: float | None = None, v_rounding=None, k_search=False):
    """``cache.append(k, v, counts)`` then ``attend(q, cache, ...)`` for the model, which built q, k, v
    itself: float [batch, heads, T, head_dim] arrays of the cache's shape and device, scale a finite
    float, counts None or int [batch], q_sink None or like q, softcap None or a finite float > 0 (see
    :func:`attend` for the arguments); ``v_rounding``, ``k_search``: how a q4_0 V and K are rounded
    (``KVCache.stage``; ``k_search`` also hands it q as ``k_queries``, each key's codes rounded for its own
    token's queries).

    Skips the checks that cannot fail for such a caller (types, shapes, dtypes, scale, counts against
    the lengths just appended) and keeps those that can: what ``KVCache.append_trusted`` keeps (counts
    in 0..T, max_chunk, max_len, k and v finite as stored), what a rewound ring can still answer, and
    the NaN on rows whose lse is not finite. q is not checked for NaN or inf: a non-finite query row
    makes its scores non-finite, so its lse is too, and the row comes back NaN, never as a number.
    """
    spec = cache.spec
    q, q_sink = _frame(q, q_sink if spec.sinks else None, cache)
    kq = q if k_search else None                       # in the keys' frame, as the cache stores them
    if (counts is None and spec.window is None and spec.sinks == 0 and cache.device == "cpu"
            and backend in ("cpu", "auto") and q.dtype == np.float32 and q.flags.c_contiguous):
        return _append_attend_cpu(q, k, v, cache, scale, softcap, v_rounding, k_search, kq)
    cache.append_trusted(k, v, counts, v_rounding, k_search, kq)
    counts = cache.last_counts if counts is None else counts
    _check_answerable(cache, counts)
    return _run(backends.get(backend, cache.device), q, cache, scale, counts, q_sink if spec.sinks else None,
                softcap)


def _frame(q, q_sink, cache: KVCache):
    """The queries in the frame the cache stores keys in: ``q @ H`` (and ``q_sink @ H``) for a ``rotate_k``
    cache, whose keys are stored as ``k @ H`` (H orthonormal: the scores are q·k), else q and q_sink as given."""
    if not cache.spec.rotate_k:
        return q, q_sink
    return rotate(q, cache.xp), None if q_sink is None else rotate(q_sink, cache.xp)


def _append_attend_cpu(q, k, v, cache: KVCache, scale: float, softcap, v_rounding, k_search, k_queries=None):
    """:func:`append_attend` for a causal CPU cache without sinks, every row real: the cache's own
    staging (cast, refuse before growing, grow), then one compiled call for the write and the attention
    (:func:`streamattn.kv.backends.cpu.write_attend`: the same kernels, the same bits)."""
    spec = cache.spec
    counts = np.full(spec.batch, k.shape[2], np.int64)
    if spec.max_len is not None:
        cache.check_room(counts)
    ks, vs = cache.stage(k, v, counts, v_rounding, k_search, k_queries)
    kst, vst = bits(cache.k), bits(cache.v)
    ka = cache.k if spec.dtype == "float32" else kst
    va = cache.v if spec.v_dtype == "float32" else vst
    mixed = spec.dtype_v is not None or spec.dtype in QUANTIZED   # checked here: no one exponent pattern
    if mixed and spec.check_finite:
        check_stored_finite(ks, vs, counts, spec.dtype, np, spec.v_dtype)
    cpu = _cpu()
    bad, out, lse, finite = cpu.write_attend(q, scale, kst, vst, bits(ks), bits(vs), ka, va, cache.lengths, counts,
                                             cache.last_counts, cache.held_from, cache.ring,
                                             spec.check_finite and not mixed, EXPONENT_BITS.get(spec.dtype, 0),
                                             cpu.KIND[spec.dtype], cpu.KIND[spec.v_dtype],
                                             None if softcap is None else np.float32(softcap), serial_kernels())
    if bad >= 0:
        raise non_finite_error("kv"[bad % 2], bad // 2, spec.dtype)
    return (out, lse) if finite else _poison_non_finite(out, lse, counts, np)


@functools.cache
def _cpu():
    """The CPU backend module, imported on first use (its kernels load then)."""
    from .backends import cpu
    return cpu


def _check_answerable(cache: KVCache, counts) -> None:
    """ValueError unless every sequence's ring still holds the keys its ``counts`` newest queries need."""
    if cache.spec.window is None:
        return
    short = np.nonzero(counts > cache.answerable())[0]
    if len(short):
        b = int(short[0])
        raise ValueError(f"sequence {b} can attend only its newest {int(cache.answerable()[b])} tokens exactly "
                         f"(asked for {int(counts[b])}): after a rewind its ring holds keys from position "
                         f"{int(cache.held_from[b])} on; append new tokens and attend those")


def _run(fn, q, cache: KVCache, scale: float, counts, q_sink, softcap, *, edge: bool = False):
    """The backend call on validated arguments, then the NaN rule (and with ``edge``, the float32 edge
    rule of :func:`attend`)."""
    spec = cache.spec

    # a GPU cache's counters already on the device: no upload (sinks apart: the mask of real rows below)
    device = {}
    if cache.counters is not None and getattr(fn, "reads_device_counters", False):
        device = dict(zip(("device_lengths", "device_counts"), cache.counters.match(cache.lengths, counts)))

    def call(fn):
        if cache.sink_k is not None:           # sinks apart: two parts, merged exactly (docs/DESIGN.md §6)
            return attend_parts(fn, q, cache, scale=scale, counts=counts, q_sink=q_sink, softcap=softcap)
        return fn(q, cache.k, cache.v, cache.lengths, counts, window=spec.window or 0, sinks=spec.sinks,
                  scale=scale, kind=spec.dtype, q_sink=q_sink, kind_v=spec.v_dtype, softcap=softcap,
                  **(device if fn is backend else {}))
    backend = fn
    out, lse = call(fn)

    def float32_edge(out, lse, real, bad):
        if not spec.check_finite or not np.isfinite(q).all():
            return out, lse                       # a non-finite input: the NaN rule answers
        if bad.any():
            b, h, t = (int(i[0]) for i in np.nonzero(bad))
            raise ValueError(f"attention scores overflow float32 (sequence {b}, query head {h}, row {t}): the "
                             "log-sum-exp of scale * q.k is past 3.4e38 although q, k and v are finite; scale "
                             "q, k or scale down (attend changes nothing)")
        wrong = real & ~np.isfinite(out).all(axis=-1)                           # [batch, q_heads, T]
        if wrong.any():                           # only the weighted sum of huge values overflowed
            ref_out, _ = call(backends.get("reference", "cpu"))
            out[wrong] = ref_out[wrong]
        return out, lse
    return _poison_non_finite(out, lse, counts, cache.xp, edge=float32_edge if edge else None,
                              device_counts=device.get("device_counts"))


def _poison_non_finite(out, lse, counts, xp, edge=None, device_counts=None):
    """NaN on every real row whose log-sum-exp is not finite, as the float64 oracle answers.

    A real query always sees at least its own key, so its lse is finite unless a key or value it sees is
    NaN or inf (possible only with ``check_finite=False``) or the scores overflow float32. The kernels
    would answer zeros with lse = -inf there, which reads exactly like a padding row: a wrong number must
    never look like a valid empty answer. Costs one pass over lse [batch, q_heads, T]. ``device_counts``:
    counts as int32 [batch] on lse's device (a GPU cache's), so the mask of real rows is built there.
    """
    on_host = not hasattr(lse, "__cuda_array_interface__")     # (tests' stand-in device arrays are numpy's)
    if on_host and np.isfinite(lse).all() and (edge is None or np.isfinite(out).all()):
        return out, lse                                     # no padding row, no bad row: the usual decode
    T = lse.shape[2]
    if device_counts is not None and not on_host:
        real = (xp.arange(T, dtype=xp.int32)[None, :] < device_counts[:, None])[:, None, :]  # [batch, 1, T]
        return _poison_on_device(out, lse, real, xp)
    real = (np.arange(T)[None, :] < np.asarray(counts)[:, None])[:, None, :]      # [batch, 1, T], host
    if on_host:
        bad = real & ~np.isfinite(lse)                                            # [batch, q_heads, T]
        if edge is not None:
            out, lse = edge(out, lse, real, bad)
        if bad.any():
            out[bad] = np.nan
            lse[bad] = np.nan
        return out, lse
    return _poison_on_device(out, lse, real, xp)


def _poison_on_device(out, lse, real, xp):
    """The same on device arrays: no host sync, no boolean indexing; where() costs a copy of out (q-sized)."""
    bad = xp.asarray(real) & ~xp.isfinite(lse)
    return xp.where(bad[..., None], xp.nan, out).astype(out.dtype, copy=False), xp.where(bad, xp.nan, lse)
