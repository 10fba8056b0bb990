"""Numba CPU backend: split-K attention straight from the ring slots, exact (out, lse) merge.

Work items are (sequence, kv head, key split), run with ``prange``; each item computes the whole GQA
group's query rows against tiles of keys, so every K/V row is read from memory once per group and the
group's dot products reuse it from cache. The hot loops are the vector micro-kernels of
:mod:`.cpu_simd` (LLVM IR through Numba intrinsics: transpose-reduced scores, register accumulators,
software prefetch for GQA groups); head_dims that are not a multiple of 16 take plain Numba loops.
16-bit storage is widened to float32 as it is loaded, never into a tile buffer first (that was half as
fast from memory: the loads came in bursts with no arithmetic to hide them behind).

Tiles are up to TILE keys, so K and V are read in long alternating runs (every switch between the two
streams costs bandwidth); the [rows, tile] score buffer is held to SCORE_FLOATS (256 KiB, in L2), so
the tile shrinks for many query rows (prefill), and to the keys the item has. Each item writes only its
own partial rows; a second kernel merges the splits exactly with their log-sum-exps. What was measured
to choose this (tile lengths, interleavings that were slower): docs/PERF.md.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from . import cpu_simd
from .cpu_simd import PV, QK, bf16_to_f32, f16_to_f32, pow2, row_max

TILE = 16384          # most keys per tile (see the module docstring)
MIN_TILE = 64         # fewest keys per tile, however many query rows
SCORE_FLOATS = 65536  # the [rows, tile] score buffer's budget: tile = SCORE_FLOATS // rows within the bounds
MIN_SPLIT_KEYS = 512  # do not split a sequence's keys finer than this
_QK1, _QK2, _QK4 = QK[1], QK[2], QK[4]   # module globals: Numba cannot index the dicts in a kernel
_PV1, _PV2, _PV4 = PV[1], PV[2], PV[4]
# Reassociation and contraction let LLVM vectorise the reductions; no 'nnan'/'ninf' because the
# masked scores are -inf on purpose.
FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}
KIND = {"float32": 0, "float16": 1, "bfloat16": 2}
_LOG2E = np.float32(1.4426950408889634)


def _wide(x, kind):
    """One storage element as float32: itself for float32, else float16 (kind 1) or bfloat16 (kind 2) bits."""


@overload(_wide)
def _wide_impl(x, kind):
    if x == types.float32:
        return lambda x, kind: x
    return lambda x, kind: f16_to_f32(x) if kind == 1 else bf16_to_f32(x)


@njit(fastmath=FASTMATH, cache=True)
def _softmax_tile(x, n, mx):
    """x[:n] <- exp(x[:n] - mx) in place and return their sum; vectorisable (libm's exp is a scalar call).

    2^y = 2^k * 2^f with k = floor(y + 1/2), f in [-1/2, 1/2]: 2^f from a degree-6 polynomial (Cephes
    exp2f coefficients, relative error ~2e-7), 2^k by writing k + 127 into a float32's exponent bits.
    y is clamped at -127, where those bits are 0: weights under 2^-127 of the running max become exactly
    0, and so do masked (-inf) scores. (Not the 1.5 * 2^23 rounding trick: under 'reassoc' LLVM may fold
    y - ((y + M) - M) to 0.)
    """
    tot = np.float32(0.0)
    for j in range(n):
        y = max((x[j] - mx) * _LOG2E, np.float32(-127.0))
        k = np.floor(y + np.float32(0.5))
        f = y - k                           # [-1/2, 1/2]
        p = np.float32(1.535336188319500e-4)
        p = p * f + np.float32(1.339887440266574e-3)
        p = p * f + np.float32(9.618437357674640e-3)
        p = p * f + np.float32(5.550332471162809e-2)
        p = p * f + np.float32(2.402264791363012e-1)
        p = p * f + np.float32(6.931472028550421e-1)
        p = p * f + np.float32(1.0)
        e = p * pow2(np.int32(k))
        x[j] = e
        tot += e
    return tot


@njit(fastmath=FASTMATH, cache=True)
def _scores(qr, kt, n, out, kind):
    """out[j] = qr . kt[j] for j < n (one query row), widening 16-bit storage as it is read.

    One key row at a time, in memory order: reading four rows interleaved (to share q's loads) streamed
    float32 K from memory ~20% slower on one thread (18.7 vs 23.0 GB/s, MHA at 16k keys).
    """
    D = qr.shape[0]
    for j in range(n):
        a = np.float32(0.0)
        kj = kt[j]
        for i in range(D):
            a += qr[i] * _wide(kj[i], kind)
        out[j] = a


@njit(fastmath=FASTMATH - {"reassoc"}, cache=True)
def _accumulate(acc, p, vt, n, rows, kind):
    """acc[r] += sum_j p[r, j] vt[j] for r < rows, j < n.

    Eight V rows per pass and every query row inside it: acc is loaded and stored once per eight keys,
    and the rows' chains are independent. No 'reassoc' here, or LLVM would fold the tree back into one
    serial chain of FMAs through acc (latency-bound: 4 cycles per key).
    acc: [rows, D], p: [rows, >= n], vt: [n, D]
    """
    D = acc.shape[1]
    n4 = n - n % 8
    for j in range(0, n4, 8):
        v0, v1, v2, v3 = vt[j], vt[j + 1], vt[j + 2], vt[j + 3]
        v4, v5, v6, v7 = vt[j + 4], vt[j + 5], vt[j + 6], vt[j + 7]
        for r in range(rows):
            a = acc[r]
            pr = p[r]
            p0, p1, p2, p3 = pr[j], pr[j + 1], pr[j + 2], pr[j + 3]
            p4, p5, p6, p7 = pr[j + 4], pr[j + 5], pr[j + 6], pr[j + 7]
            for i in range(D):
                a[i] += ((p0 * _wide(v0[i], kind) + p1 * _wide(v1[i], kind)) +
                         (p2 * _wide(v2[i], kind) + p3 * _wide(v3[i], kind))) + \
                        ((p4 * _wide(v4[i], kind) + p5 * _wide(v5[i], kind)) +
                         (p6 * _wide(v6[i], kind) + p7 * _wide(v7[i], kind)))
    for j in range(n4, n):
        vj = vt[j]
        for r in range(rows):
            a = acc[r]
            pj = p[r, j]
            for i in range(D):
                a[i] += pj * _wide(vj[i], kind)


@njit(fastmath=FASTMATH, cache=True)
def _tile_scores(qf, kt, n, sc, kind):
    """sc[r, :n] = qf[r] . kt[:n] for every row r (head_dim % 16 == 0): rows in fours, then two, one.

    qf: [rows, D] float32, kt: [n, D] storage, sc: [rows, >= n] float32
    """
    rows = qf.shape[0]
    r = 0
    while r < rows:
        R = 4 if rows - r >= 4 else (2 if rows - r >= 2 else 1)
        nb = n - n % (16 // R)                         # keys in whole blocks of 16 // R
        if R == 4:
            for j in range(0, nb, 4):
                _QK4(qf, r, kt, j, sc, kind)
        elif R == 2:
            for j in range(0, nb, 8):
                _QK2(qf, r, kt, j, sc, kind)
        else:
            for j in range(0, nb, 16):
                _QK1(qf, r, kt, j, sc, kind)
        for g in range(R):                             # the last n % (16 // R) keys
            _scores(qf[r + g], kt[nb:n], n - nb, sc[r + g, nb:], kind)
        r += R


@njit(fastmath=FASTMATH, cache=True)
def _tile_accumulate(acc, p, vt, n, kind):
    """acc[r] += sum_j p[r, j] vt[j] for every row r, j < n (head_dim % 16 == 0): rows in fours, two, one.

    acc: [rows, D] float32, p: [rows, >= n] float32, vt: [n, D] storage
    """
    rows = acc.shape[0]
    r = 0
    while r < rows:
        if rows - r >= 4:
            _PV4(acc, r, p, vt, n, kind)
            r += 4
        elif rows - r >= 2:
            _PV2(acc, r, p, vt, n, kind)
            r += 2
        else:
            _PV1(acc, r, p, vt, n, kind)
            r += 1


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _attend_splits(q, k, v, lengths, counts, window, sinks, nsplit, kind, part_out, part_lse):
    """Partial attention per (sequence, kv head, split).

    q: [B, Hq, T, D] float32, already multiplied by the scale
    k, v: [B, Hkv, S, D] float32, or uint16 bits of float16/bfloat16 (``kind`` 1/2)
    lengths, counts: int64 [B]; query t < counts[b] sits at position lengths[b] - counts[b] + t
    window: n_c, or 0 for causal; sinks: n_s
    part_out: [B, Hq, T, nsplit, D] float32, part_lse: [B, Hq, T, nsplit] float32 (outputs)
    """
    B, Hkv, S, D = k.shape
    Hq = q.shape[1]
    G = Hq // Hkv
    vector = D % 16 == 0  # the cpu_simd kernels; plain loops otherwise
    ring = S - sinks  # causal: sinks = 0 and ring = S, so slot == position
    for item in prange(B * Hkv * nsplit):
        b = item // (Hkv * nsplit)
        h = (item // nsplit) % Hkv
        sp = item % nsplit
        L = lengths[b]
        nq = counts[b]
        rows = G * nq                                    # query rows of this item: r = g * nq + t
        part_lse[b, h * G:(h + 1) * G, :, sp] = -np.inf
        part_out[b, h * G:(h + 1) * G, :, sp, :] = 0.0
        if nq == 0:
            continue
        p_first = L - nq
        p_last = L - 1
        # Keys any query of this item may see: the sink segment [0, min(n_s, p_last+1)) and the main
        # range [lo, p_last]; the main range is cut into nsplit contiguous pieces, split 0 adds sinks.
        lo = max(sinks, p_first - window + 1) if window > 0 else 0
        n_main = p_last + 1 - lo
        per = (n_main + nsplit - 1) // nsplit
        a = lo + sp * per
        z = min(p_last + 1, a + per)
        n_sink = min(sinks, p_last + 1) if (window > 0 and sp == 0) else 0

        qf = np.empty((rows, D), np.float32)             # [rows, D] the group's queries
        qpos = np.empty(rows, np.int64)                  # [rows] absolute position of each row
        qlo = np.empty(rows, np.int64)                   # [rows] first main-range key it may see
        for g in range(G):
            for t in range(nq):
                r = g * nq + t
                qf[r] = q[b, h * G + g, t]
                qpos[r] = p_first + t
                qlo[r] = max(0, p_first + t - window + 1) if window > 0 else 0
        m = np.full(rows, -np.inf, np.float32)           # [rows] running max
        # Running sums in float64: 64k keys of float32 sums drift past the 1e-5 tolerance. Each tile
        # is summed in float32 (tacc), then folded in; that costs O(D) per row per tile.
        l = np.zeros(rows, np.float64)                   # [rows] running sum of exp
        acc = np.zeros((rows, D), np.float64)            # [rows, D] running weighted sum of V
        tacc = np.empty((rows, D), np.float32)           # [rows, D] this tile's weighted sum of V
        alpha = np.empty(rows, np.float32)               # [rows] rescale of the running sums
        tile = min(TILE, max(MIN_TILE, SCORE_FLOATS // rows // 16 * 16), max(1, n_sink + max(0, z - a)))
        sc = np.empty((rows, tile), np.float32)          # [rows, tile] scores, then probabilities

        # Segments of positions: sinks first, then the main piece; each tile stays inside one run of
        # contiguous slots (a ring wraps at most once per segment).
        for seg in range(2):
            pos = 0 if seg == 0 else a
            end = n_sink if seg == 0 else z
            while pos < end:
                slot = pos if pos < sinks else sinks + (pos - sinks) % ring
                n = min(tile, end - pos, S - slot)
                kt = k[b, h, slot:slot + n]                     # [n, D] storage
                if vector:
                    _tile_scores(qf, kt, n, sc, kind)
                else:
                    for r in range(rows):
                        _scores(qf[r], kt, n, sc[r], kind)
                for r in range(rows):
                    sr = sc[r]
                    # keys pos..pos+n-1 visible to row r: j <= qpos[r], and j >= qlo[r] unless a sink
                    hi = min(n, qpos[r] - pos + 1)
                    jlo = 0 if seg == 0 else min(max(qlo[r] - pos, 0), n)
                    if jlo > 0 or hi < n:
                        for j in range(n):
                            if j < jlo or j >= hi:
                                sr[j] = -np.inf
                    mt = row_max(sr, n, m[r])
                    if mt == -np.inf:       # nothing visible yet: weights 0, nothing to rescale
                        sr[:n] = 0.0
                        alpha[r] = 1.0
                        continue
                    alpha[r] = np.float32(math.exp(m[r] - mt))
                    m[r] = mt
                    l[r] = l[r] * alpha[r] + _softmax_tile(sr, n, mt)
                vt = v[b, h, slot:slot + n]                     # [n, D] storage
                tacc[:] = 0.0
                if vector:
                    _tile_accumulate(tacc, sc, vt, n, kind)
                else:
                    _accumulate(tacc, sc, vt, n, rows, kind)
                for r in range(rows):
                    ar = acc[r]
                    tr = tacc[r]
                    al = alpha[r]
                    for i in range(D):
                        ar[i] = ar[i] * al + tr[i]
                pos += n
        for g in range(G):
            for t in range(nq):
                r = g * nq + t
                if l[r] > 0:
                    part_lse[b, h * G + g, t, sp] = m[r] + math.log(l[r])
                    inv = 1.0 / l[r]
                    for i in range(D):
                        part_out[b, h * G + g, t, sp, i] = acc[r, i] * inv


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _merge_splits(part_out, part_lse, out, lse):
    """Exact merge: out = sum_s exp(lse_s - lse) out_s with lse = logsumexp_s lse_s.

    part_out: [B, Hq, T, nsplit, D], part_lse: [B, Hq, T, nsplit] -> out: [B, Hq, T, D], lse: [B, Hq, T]
    """
    B, Hq, T, nsplit, D = part_out.shape
    for item in prange(B * Hq):
        b = item // Hq
        hq = item % Hq
        for t in range(T):
            mx = -np.inf
            for s in range(nsplit):
                mx = max(mx, part_lse[b, hq, t, s])
            o = out[b, hq, t]
            o[:] = 0.0
            if mx == -np.inf:
                lse[b, hq, t] = -np.inf
                continue
            tot = 0.0
            for s in range(nsplit):
                w = math.exp(part_lse[b, hq, t, s] - mx)
                tot += w
                po = part_out[b, hq, t, s]
                for i in range(D):
                    o[i] += w * po[i]
            for i in range(D):
                o[i] /= tot
            lse[b, hq, t] = mx + math.log(tot)


def choose_splits(batch: int, kv_heads: int, keys: int, threads: int) -> int:
    """Key splits per (sequence, kv head): enough items for every thread twice, none under MIN_SPLIT_KEYS."""
    want = math.ceil(2 * threads / (batch * kv_heads))
    return max(1, min(want, keys // MIN_SPLIT_KEYS))


def attend(q, k, v, lengths, counts, *, window: int, sinks: int, scale: float, kind: str):
    """Attention of the newest ``counts[b]`` tokens of each sequence over a ring KV cache.

    Parameters
    ----------
    q : [batch, q_heads, T, head_dim] float array
    k, v : [batch, kv_heads, slots, head_dim] storage arrays (float32, float16, or uint16 bf16 bits)
    lengths, counts : int [batch]; query t < counts[b] is at position lengths[b] - counts[b] + t
    window : n_c, or 0 for full causal; sinks : n_s
    scale : multiplier of q.k
    kind : storage dtype name, "float32" | "float16" | "bfloat16"

    Returns
    -------
    out : [batch, q_heads, T, head_dim] in q's dtype (rows t >= counts[b] are 0)
    lse : [batch, q_heads, T] float32 (-inf on padding rows)
    """
    B, Hq, T, D = q.shape
    qs = np.ascontiguousarray(q, dtype=np.float32) * np.float32(scale)       # [B, Hq, T, D]
    k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)   # (the cache's own storage: no copy)
    kb = k.view(np.float32 if kind == "float32" else np.uint16)
    vb = v.view(kb.dtype)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    span = int((counts.max() + (window - 1 if window else lengths.max())) if lengths.size else 0)
    nsplit = choose_splits(B, k.shape[1], span, _threads())
    part_out = np.empty((B, Hq, T, nsplit, D), np.float32)
    part_lse = np.empty((B, Hq, T, nsplit), np.float32)
    _attend_splits(qs, kb, vb, lengths, counts, window, sinks, nsplit, KIND[kind], part_out, part_lse)
    out = np.empty((B, Hq, T, D), np.float32)
    lse = np.empty((B, Hq, T), np.float32)
    _merge_splits(part_out, part_lse, out, lse)
    return out.astype(q.dtype, copy=False), lse


def _threads() -> int:
    from numba import get_num_threads
    return get_num_threads() or os.cpu_count() or 1


def _drop_stale_kernels(kernels=None, source=None) -> None:
    """Numba keys a cached kernel on its own source file only, not on what it inlines: after cpu_simd.py
    changes (a git pull, an edit), this module's cached kernels would still run the old vector code.
    A stamp of cpu_simd.py (``source``) beside the cache flushes ``kernels`` (default: this module's
    cached ones) when it differs."""
    try:
        if kernels is None:
            kernels = [f for f in globals().values() if getattr(f, "_cache", None) is not None
                       and hasattr(f._cache, "flush")]
        stamp = hashlib.sha256(Path(source or cpu_simd.__file__).read_bytes()).hexdigest()
        marker = Path(kernels[0]._cache._cache_path) / "streamattn_cpu_simd.sha256"
        if not marker.exists() or marker.read_text() != stamp:
            for f in kernels:
                f._cache.flush()
            marker.write_text(stamp)
    except (OSError, AttributeError, IndexError):   # no writable cache, or numba internals moved
        pass


_drop_stale_kernels()

