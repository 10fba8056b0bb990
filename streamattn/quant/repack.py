"""Compiled repacking of the most common GGUF types (Q4_0, Q8_0, Q4_K, Q6_K) straight into the interleaved
planes of :mod:`streamattn.quant.weights` (its module docstring has the layout).

The numpy path (``weights._PACKERS`` then ``weights.interleave``) builds several full-size temporaries
per tensor on one thread; for Llama-3.2-1B's Q4_K_M file it took 8.5-10.7 s of a 10.4-12.8 s load on a
2-vCPU AVX2 host. These kernels read each block once and write each output byte once, over row groups in
parallel. They give the same planes bit for bit (tests/test_quant_repack.py holds them to the numpy path
for every type and both lane widths): the same integer arithmetic, and scale products computed in
float32 as numpy computes ``float32 * uint8`` / ``float32 * float32(int8)``.

Output index of row-major byte t (a q4 nibble byte, or a q8 value) of row ``lane`` of a group:
``(t >> 2) * lanes * 4 + lane * 4 + (t & 3)``: block b's ``steps`` four-byte vectors follow one another,
each holding four consecutive bytes of every row of the group.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from streamattn import kernel_cache

kernel_cache.register(__name__)    # (its kernels call only its own code)

#: float32 of every float16 bit pattern (numpy's exact widening, NaN payloads included).
F16_TO_F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True)
def _pad(qs, scale, minv, g, lane, lanes):
    """Row ``lane`` of group g past the tensor's last row: the zero value (q4: byte 0; q8: 0 + 128 if the
    min plane is empty, i.e. 0x80) and zero scales, as weights.interleave pads."""
    fill = np.uint8(0x80) if minv.shape[1] == 0 else np.uint8(0)
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
                _pad(qs, scale, minv, g, lane, lanes)
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
                _pad(qs, scale, minv, g, lane, lanes)
                continue
            for k in range(nb):
                scale[g, k * lanes + lane] = f16[np.int64(b[r, k, 0]) | (np.int64(b[r, k, 1]) << 8)]
                for t in range(32):
                    c = k * 32 + t
                    qs[g, (c >> 2) * lanes * 4 + lane * 4 + (c & 3)] = b[r, k, 2 + t] ^ np.uint8(0x80)


@njit(parallel=True, cache=True)
def _q4_k(b, lanes, f16, qs, scale, minv):
    # b: uint8 [n, ns, 144] (d, dmin, 12 bytes of 6-bit scales and mins, 128 nibble bytes);
    # qs: uint8 [groups, ns * 128 * lanes] (sub-block j's 32 values as 16 bytes, the Q4_1 order);
    # scale, minv: [groups, ns * 8 * lanes] (d * sc, -(dmin * m) per 32 columns)
    n, ns = b.shape[0], b.shape[1]
    q32 = qs.view(np.uint32)                            # [groups, ns * 32 * lanes]: four bytes at a time
    for g in prange(qs.shape[0]):
        for lane in range(lanes):
            r = g * lanes + lane
            if r >= n:
                _pad(qs, scale, minv, g, lane, lanes)
                continue
            for k in range(ns):
                d = f16[np.int64(b[r, k, 0]) | (np.int64(b[r, k, 1]) << 8)]
                dmin = f16[np.int64(b[r, k, 2]) | (np.int64(b[r, k, 3]) << 8)]
                for j in range(8):                      # ggml's get_scale_min_k4
                    if j < 4:
                        sc = b[r, k, 4 + j] & 63
                        mn = b[r, k, 8 + j] & 63
                    else:
                        sc = (b[r, k, 8 + j] & 15) | ((b[r, k, j] >> 6) << 4)
                        mn = (b[r, k, 8 + j] >> 4) | ((b[r, k, 4 + j] >> 6) << 4)
                    at = (k * 8 + j) * lanes + lane
                    scale[g, at] = d * np.float32(sc)
                    minv[g, at] = -(dmin * np.float32(mn))
                for q in range(4):      # bytes l and l + 16 of each 32 -> sub-blocks 2q (low nibbles), 2q + 1
                    for i in range(4):  # bytes 4i .. 4i + 3 of each half, as one word (SWAR)
                        lo = _word(b, r, k, 16 + q * 32 + 4 * i)
                        hi = _word(b, r, k, 16 + q * 32 + 16 + 4 * i)
                        w = k * 32 + q * 8 + i                  # word of sub-block 2q; + 4: of 2q + 1
                        q32[g, w * lanes + lane] = (lo & 0x0F0F0F0F) | ((hi & 0x0F0F0F0F) << 4)
                        q32[g, (w + 4) * lanes + lane] = ((lo >> 4) & 0x0F0F0F0F) | (hi & 0xF0F0F0F0)


@njit(parallel=True, cache=True)
def _q6_k(b, lanes, f16, qs, scale, minv):
    # b: uint8 [n, ns, 210] (128 low-nibble bytes, 64 high-bit bytes, 16 int8 scales, d);
    # qs: uint8 [groups, ns * 256 * lanes] (the 6-bit value - 32 + 128); scale: [groups, ns * 16 * lanes]
    n, ns = b.shape[0], b.shape[1]
    q32 = qs.view(np.uint32)
    for g in prange(qs.shape[0]):
        for lane in range(lanes):
            r = g * lanes + lane
            if r >= n:
                _pad(qs, scale, minv, g, lane, lanes)
                continue
            for k in range(ns):
                d = f16[np.int64(b[r, k, 208]) | (np.int64(b[r, k, 209]) << 8)]
                for j in range(16):
                    sc = np.int64(b[r, k, 192 + j])
                    scale[g, (k * 16 + j) * lanes + lane] = d * np.float32(sc - 256 if sc > 127 else sc)
                for h in range(2):
                    for i in range(8):  # values 4i .. 4i + 3 (+ 32, 64, 96) of half h, four at a time (SWAR)
                        ql0 = _word(b, r, k, h * 64 + 4 * i)
                        ql1 = _word(b, r, k, h * 64 + 32 + 4 * i)
                        qh = _word(b, r, k, 128 + h * 32 + 4 * i)
                        w = k * 64 + h * 32 + i
                        # each byte v + 96 = (v - 32) + 128 <= 159: no carry between bytes
                        q32[g, w * lanes + lane] = ((ql0 & 0x0F0F0F0F) | ((qh & 0x03030303) << 4)) + 0x60606060
                        q32[g, (w + 8) * lanes + lane] = (
                            (ql1 & 0x0F0F0F0F) | (((qh >> 2) & 0x03030303) << 4)) + 0x60606060
                        q32[g, (w + 16) * lanes + lane] = (
                            ((ql0 >> 4) & 0x0F0F0F0F) | (((qh >> 4) & 0x03030303) << 4)) + 0x60606060
                        q32[g, (w + 24) * lanes + lane] = (
                            ((ql1 >> 4) & 0x0F0F0F0F) | (((qh >> 6) & 0x03030303) << 4)) + 0x60606060


#: GGUF type -> (kind, columns per block, columns per scale, bytes per block, has a min plane)
TYPES = {"Q4_0": ("q4", 32, 32, 18, True), "Q8_0": ("q8", 32, 32, 34, False),
         "Q4_K": ("q4", 256, 32, 144, True), "Q6_K": ("q8", 256, 16, 210, False)}
_KERNELS = {"Q4_0": _q4_0, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def repack(type_name: str, blocks: np.ndarray, shape: tuple, lanes: int):
    """The interleaved planes of one tensor: (qs uint8 [groups, ...], scale float32 [groups, blocks *
    lanes], minv float32 or None), what ``weights.interleave(weights._PACKERS[type_name](...), lanes)``
    gives before its scale planes are compacted (padding rows included).

    ``blocks``: the file's block bytes, uint8 [rows, blocks per row, bytes per block]; ``shape``:
    (rows, cols); ``lanes``: 8 or 16."""
    kind, per_block, group, size, has_min = TYPES[type_name]
    n, k = shape
    groups = -(-n // lanes)
    row_bytes = k // 2 if kind == "q4" else k
    # padding rows: zero bytes ("q4") or 0x80, the zero value stored + 128 ("q8"); their scales 0
    qs = np.empty((groups, row_bytes * lanes), np.uint8)                # every byte written by the kernel
    scale = np.empty((groups, k // group * lanes), np.float32)
    minv = np.empty_like(scale) if has_min else np.empty((groups, 0), np.float32)
    b = np.asarray(blocks).view(np.ndarray).reshape(n, k // per_block, size)
    _KERNELS[type_name](b, lanes, F16_TO_F32, qs, scale, minv)
    return qs, scale, minv if has_min else None


def compact(plane: np.ndarray) -> np.ndarray:
    """:func:`streamattn.quant.weights.compact` of a float32 plane [rows, cols], compiled: float16 bits
    (uint16) when every value is a float16 exactly, else the plane unchanged."""
    out = np.empty(plane.shape, np.uint16)
    return out if _to_float16(plane, out) else plane
