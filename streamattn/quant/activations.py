"""Activations of :mod:`streamattn.quant.matmul` quantized to 8 bits (llama.cpp's Q8_1 layout), with the
elementwise work fused in front of it (RMSNorm, the gated activation). Plain Numba; the dot products
themselves are in streamattn.quant.kernels."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from streamattn.backends.cpu_simd import pow2


@njit(cache=True, inline="always")
def _quantize_row(y, b, xq, xd, xs, xc):
    """Quantize y: float32 [K] into row b of xq, xd, xs, xc, per 32 columns (see :func:`quantize_rows`)."""
    for i in range(y.shape[0] // 32):
        amax = np.float32(0.0)
        for j in range(32):
            amax = max(amax, abs(y[i * 32 + j]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        s = 0
        for h in range(2):
            sh = 0
            for j in range(16 * h, 16 * h + 16):
                q = np.int32(np.rint(y[i * 32 + j] * inv))
                xq[b, i * 32 + j] = q
                sh += q
            xc[b, 2 * i + h] = -128 * sh
            s += sh
        xd[b, i] = d
        xs[b, i] = d * np.float32(s)


@njit(cache=True)
def quantize_rows(x, xq, xd, xs, xc):
    """Quantize x: float32 [B, K] per 32 columns: xq int8 [B, K], xd = amax / 127, xs = xd * sum(xq)
    (float32 [B, K/32]), and xc = -128 * sum(xq) per 16 columns (int32 [B, K/16]: what the kernels take
    back out of the dot products of the "q8" weights' biased bytes)."""
    for b in range(x.shape[0]):
        _quantize_row(x[b], b, xq, xd, xs, xc)


@njit(cache=True)
def norm_quantize_rows(x, w, eps, xq, xd, xs, xc):
    """Fused RMSNorm and quantization: rows of ``x / sqrt(mean(x²) + eps) * w`` (x: float32 [B, K],
    w: [K]) into xq, xd, xs, xc as :func:`quantize_rows`."""
    K = x.shape[1]
    y = np.empty(K, np.float32)                                     # one normed row
    for b in range(x.shape[0]):
        ss = np.float32(0.0)
        for j in range(K):
            ss += x[b, j] * x[b, j]
        inv = np.float32(1.0) / np.sqrt(ss * np.float32(1.0 / K) + np.float32(eps))
        for j in range(K):
            y[j] = x[b, j] * inv * w[j]
        _quantize_row(y, b, xq, xd, xs, xc)


@njit(cache=True, inline="always")
def _exp(x):
    """e^x for a float32 x, in plain arithmetic that LLVM vectorises (libm's expf is a scalar call, which
    kept the gated activation at ~10 ns an element). x = k ln2 + r with |r| <= ln2/2; e^r from Cephes
    expf's degree-5 polynomial (relative error < 1e-7 here), 2^k written into the exponent bits. Above
    88 the result is inf (e^88.7 overflows float32 anyway), so g / (1 + e^x) is a signed 0 there, not
    g * 6e-39; below -87 it stays e^-87 = 1.6e-38, the last normal power of 2 (1 + e^x is 1 there)."""
    over = x > np.float32(88.0)
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    k = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - k * np.float32(0.693359375) - k * np.float32(-2.12194440e-4)     # ln2 in two parts
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    e = (p * r * r + r + np.float32(1.0)) * pow2(np.int32(k))
    return np.float32(np.inf) if over else e


@njit(cache=True, error_model="numpy")
def glu_quantize_rows(gu, gelu, xq, xd, xs, xc):
    """Fused gated activation and quantization: rows of ``act(g) * u`` where gu = [g | u] float32
    [B, 2F]; act is gelu-tanh when ``gelu`` else silu, both as ``g / (1 + e^-a)`` (silu: a = g; gelu:
    0.5 g (1 + tanh z) = g / (1 + e^-2z), which for z << 0 keeps the digits 1 + tanh z would cancel),
    e^x by :func:`_exp`. ``error_model="numpy"``: a float division without Python's zero check, which
    would stop the loop from vectorising (1 + e^x is never 0)."""
    F = gu.shape[1] // 2
    y = np.empty(F, np.float32)                                     # one activated row
    c2 = np.float32(2.0 * np.sqrt(2.0 / np.pi))
    for b in range(gu.shape[0]):
        if gelu:
            for j in range(F):
                g = gu[b, j]
                y[j] = g / (np.float32(1.0) + _exp(-c2 * (g + np.float32(0.044715) * g * g * g))) * gu[b, F + j]
        else:
            for j in range(F):
                g = gu[b, j]
                y[j] = g / (np.float32(1.0) + _exp(-g)) * gu[b, F + j]
        _quantize_row(y, b, xq, xd, xs, xc)


#: Rows per piece of the parallel quantizers below at most (a prefill chunk's rows split over threads).
PIECE_ROWS = 16
#: Rows from which the parallel drivers quantize over threads: a decode batch of 8 rows quantized on
#: one thread left the other spinning for ~9% of the step (docs/PERF.md, 2026-12-03).
SPLIT_ROWS = 8


@njit(cache=True, inline="always")
def _piece_rows(n):
    """Rows per piece for n rows: :data:`PIECE_ROWS`, or fewer so that there are at least 4 pieces (a
    decode batch's rows reach more than one thread; Numba's thread count inside a kernel would be a
    dynamic global, which its cache refuses)."""
    return min(PIECE_ROWS, max(1, n // 4))


@njit(parallel=True, cache=True)
def norm_quantize_rows_parallel(x, w, eps, xq, xd, xs, xc):
    """:func:`norm_quantize_rows` with the rows split over Numba's threads in pieces of at most
    :data:`PIECE_ROWS` (:func:`_piece_rows`): each row is quantized by the same code, so the same bits."""
    n = x.shape[0]
    piece = _piece_rows(n)
    for p in prange((n + piece - 1) // piece):
        lo, hi = p * piece, min(n, (p + 1) * piece)
        norm_quantize_rows(x[lo:hi], w, eps, xq[lo:hi], xd[lo:hi], xs[lo:hi], xc[lo:hi])


@njit(parallel=True, cache=True)
def glu_quantize_rows_parallel(gu, gelu, xq, xd, xs, xc):
    """:func:`glu_quantize_rows` with the rows split over Numba's threads (as above: the same bits).
    In a prefill chunk the serial version was ~1/4 of the FFN's second matmul on 2 threads."""
    n = gu.shape[0]
    piece = _piece_rows(n)
    for p in prange((n + piece - 1) // piece):
        lo, hi = p * piece, min(n, (p + 1) * piece)
        glu_quantize_rows(gu[lo:hi], gelu, xq[lo:hi], xd[lo:hi], xs[lo:hi], xc[lo:hi])
