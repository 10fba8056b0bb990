"""The oracle: float64 full masked attention over a whole history, one expression.

It shares no code with the kernels or the cache: tests keep the full K/V history beside a cache and
compare every backend with this.
"""

from __future__ import annotations

import numpy as np

# Agreement of every backend with this oracle, stated once for tests, benchmarks and the stream:
# max |out - oracle| / max |oracle|, the oracle run over the ORIGINAL float32 history, so storage
# rounding is included.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def visible(q_pos, k_pos, *, window: int | None, sinks: int = 0):
    """Mask [..., n_q, n_k]: may the query at ``q_pos`` see the key at ``k_pos``?

    causal: j <= i;  window n_c: i - n_c < j <= i;  sinks n_s: also j < n_s (and j <= i).
    """
    i = np.asarray(q_pos)[..., :, None]
    j = np.asarray(k_pos)[..., None, :]
    causal = j <= i
    if window is None:
        return causal
    return causal & ((j > i - window) | (j < sinks))


def attention(q, k, v, q_pos, *, window: int | None = None, sinks: int = 0, scale: float | None = None,
              k_pos=None):
    """softmax(q K^T scale + mask) V in float64, with its log-sum-exp.

    Parameters
    ----------
    q : [heads_q, n_q, d]
    k, v : [heads_kv, n_k, d], in any order; heads_q must be a multiple of heads_kv (GQA)
    q_pos : int [n_q], absolute positions of the queries
    k_pos : int [n_k], absolute positions of the keys (default 0..n_k-1: the whole history)

    Returns
    -------
    out : [heads_q, n_q, d] float64
    lse : [heads_q, n_q] float64, natural-log normaliser of the scaled scores

    Examples
    --------
    >>> q = np.ones((1, 1, 2)); k = v = np.eye(2)[None]
    >>> out, lse = attention(q, k, v, [1])
    >>> out.round(3).tolist()
    [[[0.5, 0.5]]]
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # [heads_q, n_k, d]
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    k_pos = np.arange(k.shape[1]) if k_pos is None else k_pos
    s = np.where(visible(q_pos, k_pos, window=window, sinks=sinks), q @ k.swapaxes(-1, -2) * scale, -np.inf)
    lse = np.logaddexp.reduce(s, axis=-1)                              # [heads_q, n_q]
    return np.exp(s - lse[..., None]) @ v, lse
