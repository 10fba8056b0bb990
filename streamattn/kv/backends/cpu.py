"""Numba CPU backend: paged split-K attention straight from the ring slots, exact (out, lse) merge.

Work items are (sequence, kv head, page, block of query rows), run with ``prange``; each item computes
up to ROW_BLOCK of the GQA group's query rows against its page of keys, so in decode every K/V row is
read from memory once per group and the group's dot products reuse it from cache. The hot loops are the vector micro-kernels of
:mod:`.cpu_simd` (LLVM IR through Numba intrinsics: transpose-reduced scores, register accumulators,
software prefetch for GQA groups); head_dims that are not a multiple of 16 take plain Numba loops.
16-bit storage is widened to float32 as it is loaded, never into a tile buffer first (that was half as
fast from memory: the loads came in bursts with no arithmetic to hide them behind).

Batch invariance: a query's output bits depend only on the query, the keys it sees and the cache's
spec — not on the chunk it came in, the other sequences of the call, or the thread count. So every
reduction runs on a grid fixed in key positions: pages of PAGE keys (from 0 for sinks, from n_s for
the rest), tiles of SUB keys from each run of contiguous slots (a run ends at a page end or where the
ring wraps, fixed points of the spec), exps summed in 16 fixed lanes, P·V summed in one order for
every row count, the pages merged in position order. Keys no row of the item may see are skipped in
whole blocks of 16 or cut off the end, which is exact because they would add zeros. Why it matters:
packed weights quantize activations per matmul, so a last-bit difference in attention can flip a
rounding and change greedy text (docs/DESIGN.md §7). Each item writes only its own partial rows; a
second kernel merges the pages with their log-sum-exps. What was measured (tile lengths, interleavings
that were slower): docs/PERF.md.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ...runtime import kernel_cache
from .. import storage
from ...runtime.kernel_cache import variant
from ..storage import write_rows
from ...runtime.threads import serial_kernels
from . import cpu_simd, cpu_tiles
from .cpu_simd import row_max
from .cpu_tiles import FASTMATH, KIND, accumulate, exp_tile, soft_cap, tile_sum, scores, tile_accumulate, tile_scores

kernel_cache.register(__name__, depends_on=[cpu_simd, cpu_tiles, storage])   # write_attend calls write_rows

PAGE = 2048           # keys per page: a work item's keys, merged by log-sum-exp (the module docstring)
SUB = 512             # keys per tile inside a page: runs of K, then of V, of 128 KiB (float32, d = 64)
ROW_BLOCK = 32        # query rows per work item: [ROW_BLOCK, SUB] scores stay in L1/L2 in prefill


@njit(cache=True)
def _main_pages(L, nq, window, sinks):
    """(sink pages, first main page, main pages) of a sequence whose newest ``nq`` of ``L`` keys query.

    Sink pages tile positions [0, n_s) from 0; main pages tile [base, ...) from base = n_s (causal: 0),
    each PAGE positions, the same grid for every call (see the module docstring)."""
    if nq == 0:
        return 0, 0, 0
    p_first, p_last = L - nq, L - 1
    if window > 0:
        n_sink_pages = (min(sinks, p_last + 1) + PAGE - 1) // PAGE
        lo = max(sinks, p_first - window + 1)
    else:
        n_sink_pages, lo = 0, 0
    if p_last < lo:
        return n_sink_pages, 0, 0
    base = sinks if window > 0 else 0
    first = (lo - base) // PAGE
    return n_sink_pages, first, (p_last - base) // PAGE - first + 1


def _pages_kernels(items):
    """:func:`attend_pages` and :func:`_merge_splits` with their work items in ``items`` (``prange``: over
    Numba's threads; ``range``: serially). One source for both; a call on one thread takes the serial
    pair (:func:`attend_all`), which skips the parallel launch (measured: docs/perf/2026-12-01.md). Each copy is
    compiled under its own name (:func:`streamattn.runtime.kernel_cache.variant`)."""

    def attend_pages(q, qs, k, v, lengths, counts, window, sinks, npages, nblocks, kind, kind_v, softcap, part_out,
                     part_lse, rb=ROW_BLOCK):
        """Partial attention per (sequence, kv head, page, block of query rows).

        q: [B, Hq, T, D] float32, already multiplied by the scale
        qs: [B, Hq, T, D] float32, scaled: the queries scored against the sink keys (q itself unless the
            model rotates its queries at cache positions for them, see docs/DESIGN.md §5)
        k, v: [B, Hkv, S, D] float32, or uint16 bits of float16/bfloat16 (``kind`` 1/2), or [B, Hkv, S, row
            bytes] uint8 q8_0/q4_0 blocks (kind 3/4), read in place; ``kind`` is K's, ``kind_v`` V's
        lengths, counts: int64 [B]; query t < counts[b] sits at position lengths[b] - counts[b] + t
        window: n_c, or 0 for causal; sinks: n_s
        npages: pages per sequence in this call (sink pages first, then main pages in position order)
        nblocks: blocks of ``rb`` query rows (r = g * counts[b] + t) per (sequence, kv head); ``rb``
            (default ROW_BLOCK) changes which item computes a row, never its bits
        softcap: None, or a float32 c > 0: every scaled score s becomes c * tanh(s / c) before the mask
            (Gemma-2's attention soft-capping). None is a compile-time specialization (Numba types it
            ``none`` and prunes the branch): uncapped calls run the code, and give the bits, they had
            before the cap existed.
        part_out: [B, Hq, T, npages, D] float32, part_lse: [B, Hq, T, npages] float32 (outputs)
        """
        B, Hkv, S = k.shape[:3]
        D = q.shape[3]
        Hq = q.shape[1]
        G = Hq // Hkv
        vector = D % 16 == 0  # the cpu_simd kernels; plain loops otherwise
        ring = S - sinks  # causal: sinks = 0 and ring = S, so slot == position
        for item in items(B * Hkv * npages * nblocks):
            b = item // (Hkv * npages * nblocks)
            h = (item // (npages * nblocks)) % Hkv
            pg = (item // nblocks) % npages
            r0 = (item % nblocks) * rb
            L = lengths[b]
            nq = counts[b]
            r1 = min(G * nq, r0 + rb)                  # this item's query rows r0..r1-1: r = g * nq + t
            for r in range(r0, r1):
                part_lse[b, h * G + r // nq, r % nq, pg] = -np.inf
                part_out[b, h * G + r // nq, r % nq, pg, :] = 0.0
            if r0 == 0:                                    # the first block also clears the padding rows
                part_lse[b, h * G:(h + 1) * G, nq:, pg] = -np.inf
                part_out[b, h * G:(h + 1) * G, nq:, pg, :] = 0.0
            if r1 <= r0:
                continue
            n_sink_pages, first, n_main = _main_pages(L, nq, window, sinks)
            p_first = L - nq
            if pg < n_sink_pages:                          # [a, z): this page's keys that any row may see
                a = pg * PAGE
                z = min(a + PAGE, sinks, L)
            elif pg - n_sink_pages < n_main:
                a = (sinks if window > 0 else 0) + (first + pg - n_sink_pages) * PAGE
                z = min(a + PAGE, L)
            else:
                continue                                   # past this sequence's pages: its rows stay empty
            sink_page = pg < n_sink_pages
            rows = r1 - r0
            qf = np.empty((rows, D), np.float32)             # [rows, D] the block's queries (sinks: qs)
            qpos = np.empty(rows, np.int64)                  # [rows] absolute position of each row
            qlo = np.empty(rows, np.int64)                   # [rows] first position it may see (sink: 0)
            for i in range(rows):
                g, t = (r0 + i) // nq, (r0 + i) % nq
                qf[i] = qs[b, h * G + g, t] if sink_page else q[b, h * G + g, t]
                qpos[i] = p_first + t
                qlo[i] = max(0, p_first + t - window + 1) if (window > 0 and not sink_page) else 0
            m = np.full(rows, -np.inf, np.float32)           # [rows] running max
            # Sums in float64 across tiles; a tile is summed in float32 (tacc), then folded in.
            l = np.zeros(rows, np.float64)                   # [rows] running sum of exp
            acc = np.zeros((rows, D), np.float64)            # [rows, D] running weighted sum of V
            tacc = np.empty((rows, D), np.float32)           # [rows, D] this tile's weighted sum of V
            alpha = np.empty(rows, np.float32)               # [rows] rescale of the running sums
            sc = np.empty((rows, SUB + 16), np.float32)      # [rows, tile + pad] scores, then probabilities
            kpad = np.zeros((16, k.shape[3]), k.dtype)       # [16, D] a tile's last keys, zero-padded
            stail = np.empty((rows, 16), np.float32)         # [rows, 16] their scores
            lo_all = qlo.min()                               # keys outside [lo_all, hi_all) are no row's
            hi_all = min(z, qpos.max() + 1)
            # Tiles: runs of contiguous slots inside the page, cut only where the ring wraps (fixed points
            # of the spec). Keys before every row's window are skipped in whole blocks of 16 from the run's
            # start: they would add exact zeros, so the sums are those of the whole run.
            run = a
            while run < z:
                slot0 = run if run < sinks else sinks + (run - sinks) % ring
                run_end = min(z, run + (S - slot0))
                stop = min(run_end, hi_all)
                t0 = run                                    # sub-tiles of SUB keys from the run's start
                while t0 < stop:
                    t1 = min(t0 + SUB, stop)
                    pos = t0 + max(0, (lo_all - t0) // 16 * 16)
                    t0 += SUB
                    if pos >= t1:
                        continue
                    slot = slot0 + (pos - run)
                    n = t1 - pos
                    kt = k[b, h, slot:slot + n]                     # [n, D] storage
                    if vector:
                        tile_scores(qf, kt, n, sc, kind, kpad, stail)
                    else:
                        for r in range(rows):
                            scores(qf[r], kt, n, sc[r], kind)
                    n16 = (n + 15) // 16 * 16
                    for r in range(rows):
                        sr = sc[r]
                        if softcap is not None:
                            soft_cap(sr, n16, softcap)           # (past n: masked below)
                        # keys pos..pos+n-1 visible to row r: qlo[r] <= j <= qpos[r]
                        hi = min(n, qpos[r] - pos + 1)
                        jlo = min(max(qlo[r] - pos, 0), n)
                        for j in range(jlo):
                            sr[j] = -np.inf
                        for j in range(max(hi, 0), n16):
                            sr[j] = -np.inf
                        mt = row_max(sr, n, m[r])
                        if mt == -np.inf:       # nothing visible yet: weights 0, nothing to rescale
                            sr[:n] = 0.0
                            alpha[r] = 1.0
                            continue
                        alpha[r] = np.float32(math.exp(m[r] - mt))
                        m[r] = mt
                        exp_tile(sr, n16, mt)
                        l[r] = l[r] * alpha[r] + tile_sum(sr, n16)
                    vt = v[b, h, slot:slot + n]                     # [n, D] storage
                    tacc[:] = 0.0
                    if vector:
                        tile_accumulate(tacc, sc, vt, n, kind_v)
                    else:
                        accumulate(tacc, sc, vt, n, rows, kind_v)
                    for r in range(rows):
                        ar = acc[r]
                        tr = tacc[r]
                        al = alpha[r]
                        for i in range(D):
                            ar[i] = ar[i] * al + tr[i]
                run = run_end
            for i in range(rows):
                g, t = (r0 + i) // nq, (r0 + i) % nq
                if l[i] > 0:
                    part_lse[b, h * G + g, t, pg] = m[i] + math.log(l[i])
                    inv = 1.0 / l[i]
                    for j in range(D):
                        part_out[b, h * G + g, t, pg, j] = acc[i, j] * inv

    def _merge_splits(part_out, part_lse, out, lse):
        """Exact merge: out = sum_s exp(lse_s - lse) out_s with lse = logsumexp_s lse_s.

        part_out: [B, Hq, T, nsplit, D], part_lse: [B, Hq, T, nsplit] -> out: [B, Hq, T, D], lse: [B, Hq, T]
        """
        B, Hq, T, nsplit, D = part_out.shape
        for item in items(B * Hq):
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

    return attend_pages, _merge_splits


attend_pages, _merge_splits = (njit(parallel=True, fastmath=FASTMATH, cache=True)(variant(f, "parallel"))
                                for f in _pages_kernels(prange))
_attend_pages_serial, _merge_splits_serial = (njit(fastmath=FASTMATH, cache=True)(variant(f, "serial"))
                                              for f in _pages_kernels(range))


@njit(cache=True)
def _grid(lengths, counts, window, sinks, group):
    """(npages, nblocks) of :func:`attend_pages`: the most pages any sequence reads (at least 1), and
    blocks of ROW_BLOCK rows for the ``group * max(counts)`` query rows of a kv head (at least 1)."""
    npages, most = 1, 0
    for b in range(lengths.shape[0]):
        n_sink, _, n_main = _main_pages(lengths[b], counts[b], window, sinks)
        npages = max(npages, n_sink + n_main)
        most = max(most, counts[b])
    return npages, max(1, (group * most + ROW_BLOCK - 1) // ROW_BLOCK)


@njit(cache=True)
def attend_all(q, qs, k, v, lengths, counts, window, sinks, kind, kind_v, softcap, serial):
    """:func:`attend_pages` then :func:`_merge_splits`, with their buffers: one call from Python instead
    of two calls and four allocations. Arguments as for attend_pages;
    ``serial`` (:func:`streamattn.runtime.threads.serial_kernels`): True takes the serial pair (one thread now,
    under a higher ceiling), False the parallel one; None the serial pair, decided when the call is typed:
    the parallel pair is then never compiled (a quarter of a one-thread model's first compile,
    docs/PERF.md). Returns out [B, Hq, T, D], lse [B, Hq, T] float32."""
    B, Hq, T, D = q.shape
    npages, nblocks = _grid(lengths, counts, window, sinks, Hq // k.shape[1])
    rb, rows = ROW_BLOCK, (Hq // k.shape[1]) * counts.max()
    part_out = np.empty((B, Hq, T, npages, D), np.float32)      # [B, Hq, T, npages, D]
    part_lse = np.empty((B, Hq, T, npages), np.float32)         # [B, Hq, T, npages]
    out = np.empty((B, Hq, T, D), np.float32)                   # [B, Hq, T, D]
    lse = np.empty((B, Hq, T), np.float32)                      # [B, Hq, T]
    if serial is None or serial:                  # (Numba prunes the test of a None argument when typing)
        _attend_pages_serial(q, qs, k, v, lengths, counts, window, sinks, npages, nblocks, kind, kind_v, softcap, part_out,
                             part_lse)
        _merge_splits_serial(part_out, part_lse, out, lse)
        return out, lse
    if B * k.shape[1] * npages * nblocks == 1 and rows >= 2:
        nblocks, rb = 2, (rows + 1) // 2            # one item (a decode step, one kv head): its rows in two
    attend_pages(q, qs, k, v, lengths, counts, window, sinks, npages, nblocks, kind, kind_v, softcap, part_out, part_lse, rb)
    _merge_splits(part_out, part_lse, out, lse)
    return out, lse


@njit(cache=True)
def write_attend(q, scale, kst, vst, ks, vs, ka, va, lengths, counts, last_counts, held_from, ring, check,
                 expbits, kind, kind_v, softcap, serial):
    """Append then attend for a causal cache without sinks, one call from Python (the model's decode and
    prefill chunks): :func:`streamattn.kv.storage.write_rows` of the chunk (kst, vst: the storage as bits;
    ks, vs: the chunk as stored, as bits; refused whole if not finite), then :func:`attend_all` of
    ``q * scale`` (q: float32 [B, Hq, T, D]) over ka, va (the storage as the kernels read it; ``kind``,
    ``kind_v``, ``softcap`` as :func:`attend_pages`; quantized rows arrive quantized and checked, ``check`` False). The same
    calls and bits as ``KVCache.append`` then :func:`attend`, without the Python between them (which runs
    with its data evicted inside a model's step; measured: docs/perf/2026-12-01.md).
    Returns (bad, out, lse, finite): bad >= 0 names the refused rows (nothing written; out, lse empty);
    finite: every lse is finite (else the caller applies the NaN rule)."""
    # The constants as int64 and bool, not Numba's literal types: these calls then reuse the write_rows,
    # attend_all and attend_pages that Python and the compiled layer call, not copies compiled for them.
    no_sinks, no_window = np.int64(0), np.bool_(False)
    bad = write_rows(kst, vst, ks, vs, lengths, counts, last_counts, held_from, no_sinks, ring, no_window, check,
                     expbits)
    if bad >= 0:
        return bad, np.empty((0, 0, 0, 0), np.float32), np.empty((0, 0, 0), np.float32), True
    qs = q * np.float32(scale)
    out, lse = attend_all(qs, qs, ka, va, lengths, counts, no_sinks, no_sinks, kind, kind_v, softcap, serial)
    return bad, out, lse, bool(np.isfinite(lse).all())


_VIEW = {"float32": np.float32, "float16": np.uint16, "bfloat16": np.uint16, "q8_0": np.uint8, "q4_0": np.uint8}


def count_pages(lengths, counts, window: int, sinks: int) -> int:
    """Most pages any sequence of the call reads (at least 1): the ``npages`` of :func:`attend_pages`."""
    return _grid(np.asarray(lengths, np.int64), np.asarray(counts, np.int64), window, sinks, 1)[0]


def attend(q, k, v, lengths, counts, *, window: int, sinks: int, scale: float, kind: str, q_sink=None,
           kind_v: str | None = None, softcap: float | None = None):
    """Attention of the newest ``counts[b]`` tokens of each sequence over a ring KV cache.

    Parameters
    ----------
    q : [batch, q_heads, T, head_dim] float array
    k, v : [batch, kv_heads, slots, head_dim] storage arrays (float32, float16, or uint16 bf16 bits; uint8
        [batch, kv_heads, slots, row bytes] of q8_0 / q4_0 blocks)
    lengths, counts : int [batch]; query t < counts[b] is at position lengths[b] - counts[b] + t
    window : n_c, or 0 for full causal; sinks : n_s
    scale : multiplier of q.k
    kind : K's storage dtype name, "float32" | "float16" | "bfloat16" | "q8_0" | "q4_0"
    q_sink : [batch, q_heads, T, head_dim] float array, optional
        The queries scored against the sink keys (positions < sinks); default q. A model that assigns
        positions within the cache passes q rotated at the query's cache position here.
    kind_v : V's storage dtype name; default ``kind``
    softcap : float, optional
        Attention logit soft-capping: each scaled score s becomes softcap * tanh(s / softcap) before the
        mask and the softmax (Gemma-2); None (default) for none. Must be finite and > 0.

    Returns
    -------
    out : [batch, q_heads, T, head_dim] in q's dtype (rows t >= counts[b] are 0)
    lse : [batch, q_heads, T] float32 (-inf on padding rows)
    """
    qs = np.ascontiguousarray(q, dtype=np.float32) * np.float32(scale)       # [B, Hq, T, D]
    qss = qs if q_sink is None else np.ascontiguousarray(q_sink, dtype=np.float32) * np.float32(scale)
    k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)   # (the cache's own storage: no copy)
    kind_v = kind if kind_v is None else kind_v
    kb, vb = (x.view(_VIEW[kd]) for x, kd in ((k, kind), (v, kind_v)))
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    cap = None if softcap is None else np.float32(softcap)
    out, lse = attend_all(qs, qss, kb, vb, lengths, counts, window, sinks, KIND[kind], KIND[kind_v], cap,
                          serial_kernels())
    return out.astype(q.dtype, copy=False), lse
