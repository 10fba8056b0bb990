"""Attention over a cache that keeps its sinks apart (float16 or float32 sinks beside a quantized ring), as
two exact parts merged by their log-sum-exps.

A cache with ``spec.sink_dtype`` "float16" or "float32" holds the n_s sink tokens in ``sink_k``, ``sink_v``
([batch, kv_heads, n_s, head_dim] of that dtype) and the ring in ``k``, ``v`` as a window cache without sinks
over positions shifted by n_s (streamattn/kv/cache.py). Each part is a cache every backend already attends, so
no kernel learns a new layout: the sink part is a causal call over the n_s rows (scored with ``q_sink``),
the ring part a window call over the ring, and softmax over the union of two disjoint key sets is

    out = (e^(lse_s - m) out_s + e^(lse_r - m) out_r) / (e^(lse_s - m) + e^(lse_r - m)),
    lse = m + log(e^(lse_s - m) + e^(lse_r - m)),   m = max(lse_s, lse_r),

the merge the split-K kernels use. Why this and not a kernel that reads two dtypes: docs/DESIGN.md §6.
"""

from __future__ import annotations

import numpy as np

def attend_parts(fn, q, cache, *, scale: float, counts, q_sink, softcap):
    """(out, lse) of the newest ``counts[b]`` queries of each sequence over a ``cache`` that keeps its sinks
    apart.

    Parameters
    ----------
    fn : a backend (``streamattn.kv.backends.get``): ``fn(q, k, v, lengths, counts, *, window, sinks, scale,
        kind, q_sink, kind_v, softcap) -> (out, lse)``
    q : [batch, q_heads, T, head_dim] on the cache's device; query t < counts[b] at position
        ``lengths[b] - counts[b] + t``
    q_sink : like q or None (q): the queries scored against the sinks (docs/DESIGN.md §5)
    scale, softcap : as :func:`streamattn.kv.dispatch.attend` (resolved: a float, None or a float)

    Returns
    -------
    out : [batch, q_heads, T, head_dim], q's dtype (padding rows 0)
    lse : [batch, q_heads, T] float32 (-inf on padding rows; NaN or inf where a part's is, for the caller's
        NaN rule)

    Which rows go where. A query at i >= n_s sees all n_s sinks and the ring keys of its window: it runs
    in the sink part as a one-row head of a call over the n_s sink rows (every row of the chunk becomes a
    head of [batch, q_heads * T, 1, head_dim], so all of them see every sink whatever their position), and
    in the ring part at ring position i - n_s. A query at i < n_s (a prompt's first tokens) sees sinks
    0..i and no ring key: a causal call over the sinks, at its own position. A chunk that starts below n_s
    and ends past it has rows of both kinds; its ring rows are moved to the front of a copy of q for the
    ring call (the backends place a sequence's queries from row 0) and moved back.
    """
    spec, xp = cache.spec, cache.xp
    n_s = spec.sinks
    B, Hq, T, D = q.shape
    counts = np.asarray(counts, np.int64)
    lengths = cache.lengths
    late = np.minimum(counts, np.maximum(lengths - n_s, 0))      # [batch] rows at positions >= n_s
    early = counts - late                                        # [batch] rows at positions < n_s
    qs = q if q_sink is None else q_sink
    kw = dict(scale=scale, softcap=softcap, q_sink=None)
    sink_kw = dict(window=0, sinks=0, kind=spec.sink_dtype, kind_v=spec.sink_dtype, **kw)   # the sink store
    s_out = xp.zeros((B, Hq, T, D), np.float32)                  # [batch, q_heads, T, head_dim] the sink part
    s_lse = xp.full((B, Hq, T), -np.inf, np.float32)             # [batch, q_heads, T]
    r_out, r_lse = xp.zeros_like(s_out), xp.full_like(s_lse, -np.inf)   # the ring part
    if late.any():
        # every row past the sinks (decode): the parts' counters made on the device from the cache's
        dev_sink, dev_ring = {}, {}
        if cache.counters is not None and getattr(fn, "reads_device_counters", False) and not early.any():
            d_len, d_cnt = cache.counters.match(lengths, counts)                   # [batch] int32 each
            dev_sink = dict(device_lengths=xp.full(B, n_s, np.int32), device_counts=(d_cnt > 0).astype(np.int32))
            dev_ring = dict(device_lengths=xp.maximum(d_len - np.int32(n_s), 0).astype(np.int32, copy=False),
                            device_counts=d_cnt)                                   # late = counts here
        heads = xp.ascontiguousarray(qs).reshape(B, Hq * T, 1, D)          # row (h, t) as head h * T + t
        o, lse = fn(heads, cache.sink_k, cache.sink_v, np.full(B, n_s, np.int64), (late > 0).astype(np.int64),
                    **sink_kw, **dev_sink)
        s_out[...], s_lse[...] = o.reshape(B, Hq, T, D), lse.reshape(B, Hq, T)
        shift = np.where(late > 0, early, 0)                     # rows before a sequence's first ring query
        qr = q
        if shift.any():
            qr = xp.zeros_like(q)
            for b in np.nonzero(late)[0]:
                qr[b, :, :late[b]] = q[b, :, shift[b]:shift[b] + late[b]]
        o, lse = fn(qr, cache.k, cache.v, np.maximum(lengths - n_s, 0), late, window=spec.window, sinks=0,
                    kind=spec.dtype, kind_v=spec.v_dtype, **kw, **dev_ring)
        if shift.any():
            for b in np.nonzero(late)[0]:
                r_out[b, :, shift[b]:shift[b] + late[b]] = o[b, :, :late[b]]
                r_lse[b, :, shift[b]:shift[b] + late[b]] = lse[b, :, :late[b]]
        else:
            r_out, r_lse = o.astype(np.float32, copy=False), lse
    if early.any():
        o, lse = fn(qs, cache.sink_k, cache.sink_v, np.minimum(lengths, n_s), early, **sink_kw)
        for b in np.nonzero(early)[0]:
            s_out[b, :, :early[b]] = o[b, :, :early[b]]
            s_lse[b, :, :early[b]] = lse[b, :, :early[b]]
    if (counts == T).all():                     # every row real (decode): no mask to upload
        out, lse = merge(s_out, s_lse, r_out, r_lse, xp)
        return out.astype(q.dtype, copy=False), lse
    real = xp.asarray(np.arange(T)[None, :] < counts[:, None])[:, None, :]     # [batch, 1, T]
    s_lse = xp.where(real, s_lse, -np.inf)      # rows past counts[b] ran in the sink call too: not answers
    out, lse = merge(s_out, s_lse, r_out, r_lse, xp)
    return xp.where(real[..., None], out, 0).astype(q.dtype, copy=False), lse


def merge(out_a, lse_a, out_b, lse_b, xp=np):
    """The exact merge of two partial answers over disjoint sets of keys (module docstring), in float64,
    element by element (a row's bits depend on its two parts alone).

    out_a, out_b : [..., head_dim]; lse_a, lse_b : [...] (-inf: that part sees no key)
    Returns out [..., head_dim] float32 and lse [...] float32 (-inf where neither part sees a key).
    """
    a, b = lse_a.astype(np.float64), lse_b.astype(np.float64)
    m = xp.maximum(a, b)
    m = xp.where(m == -np.inf, 0.0, m)                          # neither sees a key: both weights 0
    wa, wb = xp.exp(a - m), xp.exp(b - m)
    total = wa + wb
    seen = total > 0
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / xp.where(seen, total, 1.0)[..., None]
    lse = xp.where(seen, m + xp.log(xp.where(seen, total, 1.0)), -np.inf)
    lse = xp.where(xp.isnan(total), np.nan, lse)                # a NaN part stays NaN (the NaN rule)
    return out.astype(np.float32), lse.astype(np.float32)
