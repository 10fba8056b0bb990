"""The CPU kernel of :func:`streamattn.models.array_ops.heads_rope`: fused projection rows to rotated heads.

One compiled pass per layer instead of ~12 numpy calls (slice, reshape, per-head RMSNorm, RoPE,
transposes, copies): each row of the fused q/k/v projection is read once and written straight into
contiguous ``q [B, H, T, hd]``, ``k, v [B, Hk, T, hd]`` (measured: docs/perf/figures-from-docstrings.md).

Same arithmetic as the array code (array_ops' ``_heads_rope_xp``), so the two agree bit
for bit (tests/test_heads_rope.py): float32 products and sums in the same order, no FMA contraction
(no fastmath), and the per-head mean square summed in numpy's pairwise order (:func:`_pairwise_sum`).
Every row is computed alone: the result of a row never depends on the batch, the chunk or threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from streamattn.runtime import kernel_cache

kernel_cache.register(__name__)    # (its kernels call only its own code)

NO_NORM = np.zeros((0, 1), np.float32)   # qk_norm=None: a norm table with no rows


@njit(cache=True)
def _block_sum(a, lo, n):
    """float32 sum of a[lo:lo+n], n <= 128, in numpy's order: below 8 values one by one; else eight
    lanes, a fixed tree of them, then the tail."""
    if n < 8:
        res = np.float32(0.0)
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - n % 8:
        j = lo + i
        r0 += a[j]
        r1 += a[j + 1]
        r2 += a[j + 2]
        r3 += a[j + 3]
        r4 += a[j + 4]
        r5 += a[j + 5]
        r6 += a[j + 6]
        r7 += a[j + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(cache=True)
def _pairwise_sum(a, n):
    """float32 sum of a[:n] in numpy's order (pairwise_sum of numpy's loops_utils): a block of <= 128
    values as :func:`_block_sum`, a longer run as the sum of its halves, split at a multiple of 8.

    numpy recurses; this walks the same tree with an explicit stack, because Numba's on-disk cache
    crashes when it loads a recursive function (measured: a segfault in the second process)."""
    if n <= 128:
        return _block_sum(a, 0, n)
    lo = np.empty(64, np.int64)          # [depth] each open node's run: start,
    ln = np.empty(64, np.int64)          #         length,
    half = np.empty(64, np.int64)        #         where its right half starts (0: left not summed yet)
    left = np.empty(64, np.float32)      #         and its left half's sum
    lo[0], ln[0], half[0] = 0, n, 0
    sp = 1
    val = np.float32(0.0)
    while sp > 0:
        top = sp - 1
        if ln[top] <= 128:               # a leaf: its sum goes up to the parent
            val = _block_sum(a, lo[top], ln[top])
            sp -= 1
            while sp > 0:
                p = sp - 1
                if half[p] == 0:         # the parent's left half: now open its right half
                    n2 = ln[p] // 2
                    n2 -= n2 % 8
                    left[p], half[p] = val, n2
                    lo[sp], ln[sp], half[sp] = lo[p] + n2, ln[p] - n2, 0
                    sp += 1
                    break
                val = left[p] + val      # both halves done: the parent's sum goes up in turn
                sp -= 1
        else:                            # open the left half
            n2 = ln[top] // 2
            n2 -= n2 % 8
            lo[sp], ln[sp], half[sp] = lo[top], n2, 0
            sp += 1
    return val


@njit(cache=True)
def rms_row(x, w, eps, sq, out):
    """out = x * (1 / sqrt(mean(x²) + eps)) * w for one row x [n], in float32 as numpy's ``rms_norm``
    computes it: the squares (into scratch ``sq`` [n]) summed in numpy's pairwise order. eps: float32."""
    n = x.shape[0]
    for i in range(n):
        sq[i] = x[i] * x[i]
    r = np.float32(1.0) / np.sqrt(_pairwise_sum(sq, n) * np.float32(1.0 / n) + eps)
    for i in range(n):
        out[i] = x[i] * r * w[i]


@njit(cache=True)
def _heads_rope(h, cos, sin, neox, norm_w, eps, q, k, v, m0, m1):
    """Rows m0 <= m < m1 of:
    h: [M, (H + 2*Hk) * hd] float32, row m = b * T + t (q heads, then k heads, then v heads)
    cos, sin: [M, hd] float32 full-width tables (``rope_tables``: sin carries the pair's sign)
    neox: pairs (i, i + hd/2) if True, else (2i, 2i + 1)
    norm_w: [H + Hk, hd] float32 per-head RMSNorm weights of q then k heads, or no rows for none
    eps: float32; q: [B, H, T, hd], k, v: [B, Hk, T, hd] float32 (outputs)
    """
    B, H, T, hd = q.shape
    Hk = k.shape[1]
    half = hd // 2
    norm = norm_w.shape[0] > 0
    x = np.empty(hd, np.float32)                 # [hd] one head, normed
    sq = np.empty(hd, np.float32)                # [hd] its squares
    for m in range(m0, m1):
        b, t = m // T, m % T
        for j in range(H + Hk):
            c0 = j * hd
            if norm:
                rms_row(h[m, c0:c0 + hd], norm_w[j], eps, sq, x)
            else:
                for i in range(hd):
                    x[i] = h[m, c0 + i]
            out = q[b, j, t] if j < H else k[b, j - H, t]       # [hd]
            for i in range(hd):
                p = (i + half) % hd if neox else i ^ 1           # the pair partner of i
                out[i] = x[i] * cos[m, i] + x[p] * sin[m, i]
        for j in range(Hk):
            c0 = (H + Hk + j) * hd
            for i in range(hd):
                v[b, j, t, i] = h[m, c0 + i]


def heads_rope_cpu(h, cos, sin, *, style, n_heads, n_kv_heads, qk_norm=None, eps=0.0):
    """numpy implementation of :func:`streamattn.models.array_ops.heads_rope` (same arguments): one
    call of the compiled kernel. h: [B, T, (H + 2*Hk) * hd]; cos, sin: [B, T, 1, hd] -> q, k, v."""
    B, T, W = h.shape
    hd = W // (n_heads + 2 * n_kv_heads)
    rows = np.ascontiguousarray(h.reshape(B * T, W), np.float32)                # [M, W]
    norm_w = NO_NORM if qk_norm is None else np.ascontiguousarray(qk_norm, np.float32)
    return heads_rope_alloc(rows, np.ascontiguousarray(cos.reshape(B * T, hd), np.float32),
                           np.ascontiguousarray(sin.reshape(B * T, hd), np.float32), style == "neox", norm_w,
                           np.float32(eps), B, n_heads, n_kv_heads)


@njit(cache=True)
def heads_rope_alloc(h, cos, sin, neox, norm_w, eps, B, H, Hk):
    """:func:`_heads_rope` into new q [B, H, T, hd], k, v [B, Hk, T, hd] (made here: one call from Python
    instead of three numpy allocations and a call, run between weight reads that evict their data)."""
    q, k, v = _new_heads(h, B, H, Hk)
    _heads_rope(h, cos, sin, neox, norm_w, eps, q, k, v, 0, h.shape[0])
    return q, k, v


@njit(cache=True)
def _new_heads(h, B, H, Hk):
    """Empty q [B, H, T, hd], k, v [B, Hk, T, hd] for the rows h [B*T, (H + 2*Hk) * hd]."""
    M, W = h.shape
    hd = W // (H + 2 * Hk)
    return (np.empty((B, H, M // B, hd), np.float32), np.empty((B, Hk, M // B, hd), np.float32),
            np.empty((B, Hk, M // B, hd), np.float32))


@njit(parallel=True, cache=True)
def heads_rope_rows_parallel(h, cos, sin, neox, norm_w, eps, B, H, Hk):
    """:func:`heads_rope_alloc` with the rows split over Numba's threads in pieces of 16 (a prompt chunk;
    every row is computed alone, so the same bits)."""
    M = h.shape[0]
    q, k, v = _new_heads(h, B, H, Hk)
    for p in prange((M + 15) // 16):
        _heads_rope(h, cos, sin, neox, norm_w, eps, q, k, v, 16 * p, min(M, 16 * p + 16))
    return q, k, v
