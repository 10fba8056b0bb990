"""The oracle: float64 full masked attention over a whole history, one expression.

It shares no code with the kernels or the cache: tests keep the full K/V history beside a cache and
compare every backend with this.
"""

from __future__ import annotations

import numpy as np

# Agreement of every backend with this oracle, stated once for tests, benchmarks and the stream:
# max |out - oracle| / max |oracle|, the oracle run over the ORIGINAL float32 history, so storage
# rounding is included.
# Quantized storage (q8_0, q4_0) is checked against the oracle over the dequantized STORED values (its
# rounding is far above any float tolerance and is measured as perplexity instead), so only the kernels'
# float32 arithmetic is measured: the float32 tolerance.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2, "q8_0": 1e-5, "q4_0": 1e-5}


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
              k_pos=None, q_sink=None, softcap: float | None = None):
    """softmax(cap(q K^T scale) + mask) V in float64, with its log-sum-exp.

    cap(s) = softcap * tanh(s / softcap) with ``softcap`` (Gemma-2's attention logit soft-capping), the
    identity without it.

    Parameters
    ----------
    q : [heads_q, n_q, d]
    k, v : [heads_kv, n_k, d], in any order; heads_q must be a multiple of heads_kv (GQA)
    q_pos : int [n_q], absolute positions of the queries
    k_pos : int [n_k], absolute positions of the keys (default 0..n_k-1: the whole history)
    q_sink : [heads_q, n_q, d], optional
        Queries scored against the sink keys (k_pos < sinks, with a window) instead of q.
    softcap : float, optional
        The soft cap of the scaled scores (None: none).

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
    qk = q @ k.swapaxes(-1, -2)                                        # [heads_q, n_q, n_k]
    if q_sink is not None and window is not None:
        is_sink = np.asarray(k_pos) < sinks                            # [n_k]
        qk = np.where(is_sink, np.asarray(q_sink, dtype=np.float64) @ k.swapaxes(-1, -2), qk)
    s = qk * scale
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    s = np.where(visible(q_pos, k_pos, window=window, sinks=sinks), s, -np.inf)
    lse = np.logaddexp.reduce(s, axis=-1)                              # [heads_q, n_q]
    return np.exp(s - lse[..., None]) @ v, lse


def cache_position(pos, *, window: int | None, sinks: int = 0):
    """Position of token ``pos`` inside the cache a query at ``pos`` sees: min(pos, n_s + n_c - 1).

    Sinks keep 0..n_s-1 and the window's keys follow them in order, so the newest token (the query)
    sits at n_s + n_c - 1 once the window is full; causal caches keep absolute positions.
    """
    pos = np.asarray(pos)
    return pos if window is None else np.minimum(pos, sinks + window - 1)


def rope(x, pos, *, base: float):
    """Rotate adjacent pairs (2m, 2m+1) of x: [..., n, d] by angle pos * base^(-2m/d), in float64.

    pos : int [n]. The oracle's own rotary embedding (the kernels never see it; models rotate before
    the cache).
    """
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    ang = np.asarray(pos, np.float64)[:, None] * base ** (-np.arange(0, d, 2) / d)   # [n, d/2]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return out


def attention_cache_positions(q, k, v, q_pos, *, window: int | None, sinks: int = 0, base: float = 1e4,
                              scale: float | None = None):
    """The oracle for caches that assign positions within the cache (StreamingLLM, sec. 3.2), float64.

    q, k hold UNrotated rows; every query i sees the keys its mode allows and, for each one, rotates
    itself and them at their positions inside the cache of that moment: sinks at 0..n_s-1, the window's
    keys at n_s.. in order, the query (the newest key) at :func:`cache_position`. One query at a time,
    straight from that rule; it shares nothing with the kernels' q/q_sink split.

    Parameters
    ----------
    q : [heads_q, n_q, d] unrotated queries;  k, v : [heads_kv, n_k, d] unrotated keys, key j at position j
    q_pos : int [n_q] absolute positions (each < n_k)
    window, sinks : the mode (window None: causal, where cache positions are absolute ones)
    base : RoPE base

    Returns
    -------
    out : [heads_q, n_q, d] float64;  lse : [heads_q, n_q] float64
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)   # [heads_q, n_k, d]
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    out = np.zeros(q.shape)
    lse = np.zeros(q.shape[:2])
    for t, i in enumerate(np.asarray(q_pos)):
        j = np.nonzero(visible([i], np.arange(k.shape[1]), window=window, sinks=sinks)[0])[0]  # [n] visible
        slid = max(0, i - (sinks + window - 1)) if window is not None else 0   # tokens the window dropped
        kpos = np.where(j < sinks, j, j - slid)                          # [n] cache positions of the keys
        qr = rope(q[:, t:t + 1], [i - slid], base=base)                  # [heads_q, 1, d]
        s = (qr @ rope(k[:, j], kpos, base=base).swapaxes(-1, -2))[:, 0] * scale   # [heads_q, n]
        lse[:, t] = np.logaddexp.reduce(s, axis=-1)
        out[:, t] = np.einsum("hn,hnd->hd", np.exp(s - lse[:, t, None]), v[:, j])
    return out, lse
