"""Storage of the ring: allocation, the slot rule as arithmetic, and the bfloat16 bit conversions.

Pure functions over arrays, shared by the cache, the backends and the benchmarks; the rule they
compute is explained in streamattn/cache.py and docs/DESIGN.md.
"""

from __future__ import annotations

import numpy as np
from numba import njit

STORAGE_ALIGN = 64  # bytes: one cache line, one AVX-512 vector


def storage_zeros(xp, shape, dtype):
    """Zeroed K or V storage whose data starts on a STORAGE_ALIGN-byte boundary.

    numpy's large arrays start 16 bytes past a line, so every 64-byte vector load of a row touched two
    cache lines (measured: docs/PERF.md). CuPy's allocations are 256-byte aligned already.
    """
    if xp is not np:
        return xp.zeros(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + STORAGE_ALIGN, np.uint8)
    start = -raw.ctypes.data % STORAGE_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@njit(cache=True)
def slot_of(pos, sinks, ring):
    """Slot of absolute position ``pos`` in a cache with ``sinks`` fixed and ``ring`` rotating slots: the
    rule, written once (:func:`ring_slots` maps it over arrays, :func:`write_rows` calls it per row).
    Causal caches are the case ``sinks=0, ring=capacity`` (then slot == position)."""
    return pos if pos < sinks else sinks + (pos - sinks) % ring


@njit(cache=True)
def _map_slots(positions, sinks, ring, out):
    for i in range(positions.size):
        out[i] = slot_of(positions[i], sinks, ring)


def ring_slots(positions, *, sinks: int, ring: int):
    """Slots of absolute ``positions`` (an int or an int array; int64 array out) by :func:`slot_of`.

    >>> ring_slots(np.arange(8), sinks=2, ring=3).tolist()
    [0, 1, 2, 3, 4, 2, 3, 4]
    >>> int(ring_slots(7, sinks=2, ring=3))
    4
    """
    positions = np.asarray(positions, np.int64)
    out = np.empty(positions.shape, np.int64)
    _map_slots(np.ascontiguousarray(positions).reshape(-1), sinks, ring, out.reshape(-1))
    return out


def slot_positions(length: int, *, slots: int, sinks: int):
    """Absolute position held by each slot after ``length`` tokens, or -1 for a slot never written.

    >>> slot_positions(7, slots=5, sinks=2).tolist()   # ring of 3 holds positions 4, 5, 6
    [0, 1, 5, 6, 4]
    """
    s = np.arange(slots)
    ring = slots - sinks
    pos = np.where(s < sinks, s, (length - 1) - ((length - 1 - s) % ring))
    return np.where((pos >= 0) & (pos < length) & ((s < sinks) | (pos >= sinks)), pos, -1)


def widen_bf16(bits, xp=np):
    """bfloat16 raw bits (uint16) -> float32: a 16-bit shift."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def to_storage(x, dtype: str, xp):
    """Cast a float array to the spec's storage (bf16: round-to-nearest-even raw bits)."""
    if dtype == "bfloat16":
        if x.dtype.name == "bfloat16":  # ml_dtypes input: already bf16
            return x.view(xp.uint16)
        bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
        rounding = ((bits >> 16) & 1) + 0x7FFF
        return ((bits + rounding) >> 16).astype(xp.uint16)
    return x.astype(dtype, copy=False)


def check_stored_finite(ks, vs, counts, dtype: str, xp) -> None:
    """Refuse a chunk whose real rows (``counts[b]`` per sequence) are NaN or inf *as stored*: run after
    the cast, so a float32 1e5 that overflows a float16 cache is refused too. ks, vs: [batch, kv_heads, T, d].
    One pass over the whole chunk first: when it is all finite (the usual case), no per-sequence look."""
    for name, x in (("k", ks), ("v", vs)):
        if bool(xp.isfinite(widen_bf16(x, xp) if dtype == "bfloat16" else x).all()):
            continue
        for b in range(x.shape[0]):
            rows = x[b, :, :int(counts[b])]
            if not rows.size:
                continue
            wide = widen_bf16(rows, xp) if dtype == "bfloat16" else rows
            if not bool(xp.isfinite(wide).all()):
                raise non_finite_error(name, b, dtype)


def non_finite_error(name: str, b: int, dtype: str) -> ValueError:
    """The refusal of a chunk whose ``name`` ("k" or "v") rows of sequence ``b`` are NaN or inf as stored."""
    return ValueError(f"{name} holds NaN or inf for sequence {b}; the cache is unchanged (checked as stored in "
                      f"{dtype}: float16 overflows past 65504; pass check_finite=False in the spec to skip this "
                      "check)")


#: Exponent bits of each storage, as unsigned integers: a value is NaN or inf iff all of them are set.
EXPONENT_BITS = {"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}


def bits(x):
    """The storage bits of x as unsigned integers of its width (float32 -> uint32; 16-bit -> uint16)."""
    return x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)


@njit(cache=True)
def write_rows(kst, vst, ks, vs, lengths, counts, last_counts, held_from, sinks, ring, window, check, expbits):
    """One chunk into a CPU ring, as bits: ``kst, vst`` [B, H, slots, D] and ``ks, vs`` [B, H, T, D] unsigned
    views of the storage and of the chunk cast to it (:func:`bits`); row t < counts[b] of sequence b goes
    to the slot of position lengths[b] + t (:func:`slot_of`); then the counters move (held_from only
    for a window cache). With ``check``, first looks for a NaN or inf (all ``expbits`` set) among the
    real rows, k before v, and returns ``2 b + (0 for k, 1 for v)`` of the first without writing anything;
    else returns -1. One compiled call where the Python path took ~15 array operations per layer."""
    B, H, T, D = ks.shape
    if check:
        for which in range(2):
            x = ks if which == 0 else vs
            for b in range(B):
                for h in range(H):
                    for t in range(counts[b]):
                        for d in range(D):
                            if x[b, h, t, d] & expbits == expbits:
                                return 2 * b + which
    for b in range(B):
        L = lengths[b]
        for t in range(counts[b]):
            s = slot_of(L + t, sinks, ring)
            for h in range(H):
                kst[b, h, s, :] = ks[b, h, t, :]
                vst[b, h, s, :] = vs[b, h, t, :]
        if window:
            held_from[b] = max(held_from[b], L + counts[b] - ring)
        lengths[b] = L + counts[b]
        last_counts[b] = counts[b]
    return -1
