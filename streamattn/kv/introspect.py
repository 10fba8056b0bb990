"""Where attention went, for debugging a model (not the hot path).

For the queries just appended, :func:`inspect_attention` reports per head the softmax weights over the
visible positions (absolute, in temporal order), the weight mass on sink tokens versus the window, and
each visible V row's contribution to the output (weight x ||v||). Weights that point at the right tokens
while the contributions look wrong mean the V rows are wrong; wrong weights mean q or K are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.arrays import check_sequence_index, to_host
from .cache import KVCache
from .rotation import rotate
from .reference import visible


@dataclass(frozen=True)
class AttentionReport:
    """Attention of one sequence's newest queries.

    positions : int64 [n], absolute positions the cache holds, ascending
    q_positions : int64 [T], absolute positions of the queries
    weights : float64 [q_heads, T, n], softmax weights (0 where masked)
    sink_mass, window_mass : float64 [q_heads, T], weight on positions < sinks, and on the rest
    contributions : float64 [q_heads, T, n], weight x ||v|| of each visible row
    out : float64 [q_heads, T, head_dim], the attention output these weights give
    """

    positions: np.ndarray
    q_positions: np.ndarray
    weights: np.ndarray
    sink_mass: np.ndarray
    window_mass: np.ndarray
    contributions: np.ndarray
    out: np.ndarray

    def top(self, head: int, t: int = -1, k: int = 5):
        """The ``k`` positions with the most weight for ``head`` and query ``t``: [(position, weight), ...]."""
        w = self.weights[head, t]
        idx = np.argsort(-w, kind="stable")[:k]
        return [(int(self.positions[i]), float(w[i])) for i in idx]


def inspect_attention(q, cache: KVCache, *, b: int = 0, scale: float | None = None,
                      softcap: float | None = None) -> AttentionReport:
    """Attention report for sequence ``b``'s most recently appended tokens.

    Parameters
    ----------
    q : [batch, q_heads, T, head_dim], the queries of the chunk just appended (as passed to ``attend``)
    cache : KVCache
    b : int, which sequence
    scale : float, optional (default 1/sqrt(head_dim))
    softcap : float, optional
        The model's attention soft cap (gemma2: scores s -> softcap * tanh(s / softcap)); None: none.

    Examples
    --------
    >>> from streamattn import CacheSpec, KVCache
    >>> cache = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=2, window=2, sinks=1))
    >>> for _ in range(4):
    ...     cache.append(np.ones((1, 1, 1, 2)), np.ones((1, 1, 1, 2)))
    >>> r = inspect_attention(np.ones((1, 1, 1, 2)), cache)
    >>> r.positions.tolist(), r.sink_mass.round(3).tolist()
    ([0, 2, 3], [[0.333]])
    """
    spec = cache.spec
    b = check_sequence_index("b", b, spec.batch)
    c = int(cache.last_counts[b])
    if c == 0:
        raise ValueError(f"sequence {b} had no tokens in the last append; nothing to inspect")
    k, v, pos = cache.temporal_view(b)                   # [kv_heads, n, d], [kv_heads, n, d], [n]
    qb = to_host(q, copy=False)[b, :, :c].astype(np.float64)      # [q_heads, T, d]
    if spec.rotate_k:                                    # keys are stored as k @ H: score them with q @ H
        qb = rotate(qb)
    group = qb.shape[0] // spec.kv_heads
    k = np.repeat(k.astype(np.float64), group, axis=0)    # [q_heads, n, d]
    v = np.repeat(v.astype(np.float64), group, axis=0)
    scale = 1.0 / np.sqrt(spec.head_dim) if scale is None else scale
    L = int(cache.lengths[b])
    q_pos = np.arange(L - c, L)
    mask = visible(q_pos, pos, window=spec.window, sinks=spec.sinks)          # [T, n]
    s = qb @ k.swapaxes(-1, -2) * scale                                         # [q_heads, T, n]
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    s = np.where(mask, s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    is_sink = pos < spec.sinks                                                  # [n]
    return AttentionReport(
        positions=pos, q_positions=q_pos, weights=w,
        sink_mass=w[..., is_sink].sum(-1), window_mass=w[..., ~is_sink].sum(-1),
        contributions=w * np.linalg.norm(v, axis=-1)[:, None, :], out=w @ v)
