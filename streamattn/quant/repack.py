"""Compiled repacking of the most common GGUF types (Q4_0, Q8_0, Q4_K, Q6_K) straight into the interleaved
planes of :mod:`streamattn.quant.weights` (its module docstring has the layout).

The numpy path (``weights._PACKERS`` then ``weights.interleave``) builds several full-size temporaries
per tensor on one thread; for Llama-3.2-1B's Q4_K_M file it took 8.5-10.7 s of a 10.4-12.8 s load on a
2-vCPU AVX2 host. These kernels read each block once and write each output byte once, over row groups in
parallel. They give the same planes bit for bit (tests/test_quant_repack.py holds them to the numpy path
for every type and both lane widths): the same integer arithmetic, and scale products computed in
float32 as numpy computes them. Q4_K and Q6_K ("q4k", "q6k") are the file's four-byte words moved, the
float16 super-block scales widened: no arithmetic.

Output index of row-major byte t (a q4 nibble byte, or a q8 value) of row ``lane`` of a group:
``(t >> 2) * lanes * 4 + lane * 4 + (t & 3)``: block b's ``steps`` four-byte vectors follow one another,
each holding four consecutive bytes of every row of the group.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from streamattn.runtime import kernel_cache
from streamattn.quant.levels import Q6K_WORDS

kernel_cache.register(__name__)    # (its kernels call only its own code)

#: float32 of every float16 bit pattern (numpy's exact widening, NaN payloads included).
F16_TO_F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True)
def _pad(qs, scale, minv, g, lane, lanes, fill):
    """Row ``lane`` of group g past the tensor's last row: bytes ``fill`` (the zero value: q4 and q6k 0, q8
    0 + 128) and zero scales, as weights.interleave pads."""
    for w in range(qs.shape[1] // (lanes * 4)):
        for j in range(4):
            qs[g, w * lanes * 4 + lane * 4 + j] = fill
    for k in range(scale.shape[1] // lanes):
        scale[g, k * lanes + lane] = 0
        if minv.shape[1]:
            minv[g, k * lanes + lane] = 0


@njit(cache=True, inline="always")
def _word(b, r, k, at):
    """Bytes at .. at + 3 of block k of row r as one little-endian word (blocks of 210 bytes are not
    4-byte aligned, so no uint32 view of the file)."""
    return (np.int64(b[r, k, at]) | (np.int64(b[r, k, at + 1]) << 8) | (np.int64(b[r, k, at + 2]) << 16)
            | (np.int64(b[r, k, at + 3]) << 24))


@njit(parallel=True, cache=True)
def _to_float16(plane, out):
    """out[...] = the float16 bits of each float32 of plane [rows, cols]; returns whether every value is a
    float16 exactly (NaN is not: numpy's round trip compares unequal), as weights.compact decides."""
    exact = np.ones(plane.shape[0], np.bool_)
    bits = plane.view(np.uint32)
    for i in prange(plane.shape[0]):
        for j in range(plane.shape[1]):
            u = bits[i, j]
            sign = np.uint16((u >> 16) & 0x8000)
            e = np.int64((u >> 23) & 0xFF) - 127
            m = u & 0x7FFFFF
            if e == 128:                                     # inf exact; NaN never
                if m:
                    exact[i] = False
                out[i, j] = sign | np.uint16(0x7C00)
            elif e == -127 and m == 0:                       # +-0
                out[i, j] = sign
            elif -14 <= e <= 15 and (m & 0x1FFF) == 0:       # a normal float16
                out[i, j] = sign | np.uint16(((e + 15) << 10) | (m >> 13))
            elif -24 <= e <= -15:                            # a subnormal float16, if no bit is lost
                full = m | 0x800000
                shift = -(e + 1)                             # 14 .. 23
                if full & ((np.uint32(1) << shift) - 1):
                    exact[i] = False
                out[i, j] = sign | np.uint16(full >> shift)
            else:
                exact[i] = False
    return exact.all()


@njit(parallel=True, cache=True)
def _q4_0(b, lanes, f16, qs, scale, minv):
    # b: uint8 [n, nb, 18] (d, 16 nibble bytes); qs: uint8 [groups, nb * 16 * lanes]; scale, minv: [groups, nb * lanes]
    n, nb = b.shape[0], b.shape[1]
    for g in prange(qs.shape[0]):
        for lane in range(lanes):
            r = g * lanes + lane
            if r >= n:
                _pad(qs, scale, minv, g, lane, lanes, np.uint8(0))
                continue
            for k in range(nb):
                d = f16[np.int64(b[r, k, 0]) | (np.int64(b[r, k, 1]) << 8)]
                scale[g, k * lanes + lane] = d
                minv[g, k * lanes + lane] = np.float32(-8.0) * d
                for t in range(16):
                    c = k * 16 + t
                    qs[g, (c >> 2) * lanes * 4 + lane * 4 + (c & 3)] = b[r, k, 2 + t]


@njit(parallel=True, cache=True)
def _q8_0(b, lanes, f16, qs, scale, minv):
    # b: uint8 [n, nb, 34] (d, 32 int8); qs: uint8 [groups, nb * 32 * lanes] (q + 128); scale: [groups, nb * lanes]
    n, nb = b.shape[0], b.shape[1]
    for g in prange(qs.shape[0]):
        for lane in range(lanes):
            r = g * lanes + lane
            if r >= n:
                _pad(qs, scale, minv, g, lane, lanes, np.uint8(0x80))
                continue
            for k in range(nb):
                scale[g, k * lanes + lane] = f16[np.int64(b[r, k, 0]) | (np.int64(b[r, k, 1]) << 8)]
                for t in range(32):
                    c = k * 32 + t
                    qs[g, (c >> 2) * lanes * 4 + lane * 4 + (c & 3)] = b[r, k, 2 + t] ^ np.uint8(0x80)


@njit(parallel=True, cache=True)
def _q4_k(b, lanes, f16, qs, scale, minv):
    # b: uint8 [n, ns, 144] (d, dmin, 12 bytes of 6-bit scales and mins, 128 nibble bytes);
    # qs: uint8 [groups, ns * 140 * lanes]: each super-block's bytes 4 .. 143 of each row, word-interleaved;
    # scale, minv: [groups, ns * lanes] (d, -dmin)
    n, ns = b.shape[0], b.shape[1]
    q32 = qs.view(np.uint32)
    for g in prange(qs.shape[0]):
        for lane in range(lanes):
            r = g * lanes + lane
            if r >= n:
                _pad(qs, scale, minv, g, lane, lanes, np.uint8(0))
                continue
            for k in range(ns):
                scale[g, k * lanes + lane] = f16[np.int64(b[r, k, 0]) | (np.int64(b[r, k, 1]) << 8)]
                minv[g, k * lanes + lane] = -f16[np.int64(b[r, k, 2]) | (np.int64(b[r, k, 3]) << 8)]
                for v in range(35):
                    q32[g, (k * 35 + v) * lanes + lane] = _word(b, r, k, 4 + 4 * v)


@njit(parallel=True, cache=True)
def _q6_k(b, lanes, f16, qs, scale, minv, words, shift):
    # b: uint8 [n, ns, 210] (128 low-nibble bytes, 64 high-bit bytes, 16 int8 scales, d);
    # qs: uint8 [groups, ns * 2 * 104 * lanes]: per half h of a super-block, 26 words of each row (the file's
    # bytes at words[v] + shift[v] h: weights.Q6K_WORDS), word-interleaved; scale: [groups, ns * lanes] d
    n, ns = b.shape[0], b.shape[1]
    q32 = qs.view(np.uint32)
    for g in prange(qs.shape[0]):
        for lane in range(lanes):
            r = g * lanes + lane
            if r >= n:
                _pad(qs, scale, minv, g, lane, lanes, np.uint8(0))
                continue
            for k in range(ns):
                scale[g, k * lanes + lane] = f16[np.int64(b[r, k, 208]) | (np.int64(b[r, k, 209]) << 8)]
                for h in range(2):
                    u = (k * 2 + h) * 26
                    for v in range(26):
                        q32[g, (u + v) * lanes + lane] = _word(b, r, k, words[v] + shift[v] * h)


#: GGUF type -> (kind, columns per block, columns per scale (the QWeight's group), bytes per block, has a min
#: plane, columns per value of the scale planes, bytes per row of 256 columns in ``qs``)
TYPES = {"Q4_0": ("q4", 32, 32, 18, True, 32, 128), "Q8_0": ("q8", 32, 32, 34, False, 32, 256),
         "Q4_K": ("q4k", 256, 32, 144, True, 256, 140), "Q6_K": ("q6k", 256, 16, 210, False, 256, 208)}
_KERNELS = {"Q4_0": _q4_0, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def repack(type_name: str, blocks: np.ndarray, shape: tuple, lanes: int):
    """The interleaved planes of one tensor: (qs uint8 [groups, ...], scale float32 [groups, blocks *
    lanes], minv float32 or None), what ``weights.interleave(weights._PACKERS[type_name](...), lanes)``
    gives before its scale planes are compacted (padding rows included).

    ``blocks``: the file's block bytes, uint8 [rows, blocks per row, bytes per block]; ``shape``:
    (rows, cols); ``lanes``: 8 or 16."""
    _, per_block, _, size, has_min, per_scale, per_256 = TYPES[type_name]
    n, k = shape
    groups = -(-n // lanes)
    row_bytes = k * per_256 // 256
    # padding rows: zero bytes ("q4", "q6k") or 0x80, the zero value stored + 128 ("q8"); their scales 0
    qs = np.empty((groups, row_bytes * lanes), np.uint8)                # every byte written by the kernel
    scale = np.empty((groups, k // per_scale * lanes), np.float32)
    minv = np.empty_like(scale) if has_min else np.empty((groups, 0), np.float32)
    b = np.asarray(blocks).view(np.ndarray).reshape(n, k // per_block, size)
    layout = ()
    if type_name == "Q6_K":                   # each word's file offset in the first half, its shift in the second
        words = np.array(Q6K_WORDS, np.int64)
        layout = (words, np.where(words < 128, 64, np.where(words < 192, 32, 8)))
    _KERNELS[type_name](b, lanes, F16_TO_F32, qs, scale, minv, *layout)
    return qs, scale, minv if has_min else None


def compact(plane: np.ndarray) -> np.ndarray:
    """:func:`streamattn.quant.weights.compact` of a float32 plane [rows, cols], compiled: float16 bits
    (uint16) when every value is a float16 exactly, else the plane unchanged."""
    out = np.empty(plane.shape, np.uint16)
    return out if _to_float16(plane, out) else plane
