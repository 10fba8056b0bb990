"""Where each head looks: attention weights of one query over the keys a cache still holds.

The core will offer its own introspection; until then this computes the weights from the query and
``KVCache.temporal_view`` (the kept keys in temporal order) with the mode's mask, in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamattn.reference import visible


@dataclass(frozen=True)
class HeadReport:
    """One head at one query: attention mass on sink tokens, on the recent window, top positions."""

    layer: int
    head: int
    sink_mass: float          # mass on positions < n_sinks
    window_mass: float        # mass on the last n_window positions (the current one included)
    top: tuple                # ((position, weight), ...) most attended first


def head_weights(q, cache, b: int, *, scale: float, query_pos: int):
    """Softmax weights of one query row over the keys sequence ``b`` still holds.

    Parameters
    ----------
    q : [q_heads, head_dim] post-RoPE query at ``query_pos``
    cache : KVCache
    Returns
    -------
    w : [q_heads, n] float64, positions : int64 [n]
    """
    k, _, pos = cache.temporal_view(b)                                   # k: [kv_heads, n, hd]
    group = q.shape[0] // k.shape[0]
    s = np.einsum("hd,hnd->hn", np.asarray(q, np.float64), np.repeat(k, group, 0).astype(np.float64)) * scale
    mask = visible(np.array([query_pos]), pos, window=cache.spec.window, sinks=cache.spec.sinks)[0]  # [n]
    s = np.where(mask[None, :], s, -np.inf)
    s -= s.max(axis=1, keepdims=True)
    w = np.exp(s)
    return w / w.sum(axis=1, keepdims=True), pos


def report(layer: int, q, cache, b: int, *, scale: float, query_pos: int, n_sinks: int = 4,
           n_window: int = 64, top: int = 3) -> list:
    """:class:`HeadReport` per query head of one layer (q: [q_heads, head_dim])."""
    w, pos = head_weights(q, cache, b, scale=scale, query_pos=query_pos)
    out = []
    for h in range(w.shape[0]):
        order = np.argsort(-w[h], kind="stable")[:top]
        out.append(HeadReport(layer=layer, head=h, sink_mass=float(w[h][pos < n_sinks].sum()),
                              window_mass=float(w[h][pos > query_pos - n_window].sum()),
                              top=tuple((int(pos[i]), float(w[h, i])) for i in order)))
    return out
