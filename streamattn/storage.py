"""Storage of the ring: allocation, the slot rule as arithmetic, and the bfloat16 bit conversions.

Pure functions over arrays, shared by the cache, the backends and the benchmarks; the rule they
compute is explained in streamattn/cache.py and docs/DESIGN.md.
"""

from __future__ import annotations

import numpy as np

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


def ring_slots(positions, *, sinks: int, ring: int):
    """Slots of absolute ``positions`` (any int array) in a cache with ``sinks`` fixed and ``ring`` rotating slots.

    Causal caches are the case ``sinks=0, ring=capacity`` (then slot == position).

    >>> ring_slots(np.arange(8), sinks=2, ring=3).tolist()
    [0, 1, 2, 3, 4, 2, 3, 4]
    >>> ring_slots(7, sinks=2, ring=3)                  # one Python int: the same rule in int arithmetic
    4
    """
    if isinstance(positions, int):
        return positions if positions < sinks else sinks + (positions - sinks) % ring
    positions = np.asarray(positions)
    return np.where(positions < sinks, positions, sinks + (positions - sinks) % ring)


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
                raise ValueError(f"{name} holds NaN or inf for sequence {b}; the cache is unchanged (checked "
                                 f"as stored in {dtype}: float16 overflows past 65504; pass "
                                 "check_finite=False in the spec to skip this check)")
