"""Activations of :mod:`streamattn.quant.matmul` quantized to 8 bits (llama.cpp's Q8_1 layout), with the
elementwise work fused in front of it (RMSNorm, the gated activation). Plain Numba, but for a block's
quantization (LLVM IR, with streamattn.runtime.llvm_ir); the dot products themselves are in
streamattn.quant.kernels."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from streamattn.runtime import kernel_cache
from streamattn.runtime import llvm_ir
from streamattn.runtime.llvm_ir import Rows, addr, c_arrays, llvm_fn, pow2

kernel_cache.register(__name__, depends_on=[llvm_ir])


@intrinsic
def _quantize_row(typingctx, y, b, xq, xd, xs, xc):
    """Quantize y: float32 [K] into row b of xq, xd, xs, xc, per 32 columns (see :func:`quantize_rows`):
    per block d = amax / 127, q = rint(y * (1 / d)) (0 where d is 0), as two 16-lane vectors. For finite
    blocks the float operations of the scalar loop this replaced (max and integer sums are exact in any
    order), which LLVM left scalar (measured: docs/perf/2026-12-04.md). A block holding a NaN or an
    infinity gets d = xs = NaN and q = 0, so every output of
    its row is NaN (the loop's max skipped NaN, and the conversion of a NaN was undefined)."""
    if not (isinstance(y, types.Array) and y.ndim == 1 and y.layout == "C" and c_arrays(xq, xd, xs, xc)):
        return None

    def codegen(context, builder, sig, args):
        ya = context.make_array(sig.args[0])(context, builder, value=args[0])
        K = cgutils.unpack_tuple(builder, ya.shape)[0]
        yp = builder.bitcast(ya.data, ir.IntType(8).as_pointer())
        qa, da, sa, ca = (Rows(context, builder, sig.args[i], args[i]) for i in (2, 3, 4, 5))
        row = context.cast(builder, args[1], sig.args[1], types.int64)
        f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        vf, vi, vb = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(ir.IntType(8), 16)
        fabs = llvm_fn(builder, "llvm.fabs.v16f32", vf, [vf])
        vmax = llvm_fn(builder, "llvm.maxnum.v16f32", vf, [vf, vf])
        rmax = llvm_fn(builder, "llvm.vector.reduce.fmax.v16f32", f32, [vf])
        rint = llvm_fn(builder, "llvm.rint.v16f32", vf, [vf])
        radd = llvm_fn(builder, "llvm.vector.reduce.add.v16i32", i32, [vi])
        any_of = llvm_fn(builder, "llvm.vector.reduce.or.v16i1", ir.IntType(1), [ir.VectorType(ir.IntType(1), 16)])
        with cgutils.for_range(builder, builder.udiv(K, ir.Constant(i64, 32))) as loop:
            i = loop.index
            at = builder.mul(i, ir.Constant(i64, 128))                      # byte offset of block i in y
            vs = [builder.load(builder.bitcast(builder.gep(yp, [builder.add(at, ir.Constant(i64, 64 * h))],
                                                           source_etype=ir.IntType(8)), vf.as_pointer()),
                               align=4, typ=vf) for h in (0, 1)]
            # nnan: a block holding NaN is caught as `bad` below, so its amax is never read; without the
            # flag LLVM reduced the 16 lanes as a serial chain of NaN-checked scalar maxes (~100 cycles a
            # block), with it as a tree of vector maxes. A max of non-NaN floats is the same in any order.
            amax = builder.call(rmax, [builder.call(vmax, [builder.call(fabs, [v]) for v in vs],
                                                    fastmath=("nnan",))], fastmath=("nnan",))
            nan = [builder.fcmp_unordered("uno", z, z) for z in (builder.fsub(v, v) for v in vs)]  # NaN, inf
            bad = builder.call(any_of, [builder.or_(*nan)])
            d = builder.select(bad, ir.Constant(f32, float("nan")), builder.fdiv(amax, ir.Constant(f32, 127.0)))
            inv = builder.select(builder.fcmp_ordered(">", d, ir.Constant(f32, 0.0)),
                                 builder.fdiv(ir.Constant(f32, 1.0), d), ir.Constant(f32, 0.0))
            invv = builder.shuffle_vector(builder.insert_element(ir.Constant(vf, ir.Undefined), inv,
                                                                 ir.Constant(i32, 0)),
                                          ir.Constant(vf, ir.Undefined), ir.Constant(vi, [0] * 16))
            total = ir.Constant(i32, 0)
            for h in (0, 1):
                q = builder.select(bad, ir.Constant(vi, [0] * 16),
                                   builder.fptosi(builder.call(rint, [builder.fmul(vs[h], invv)]), vi))
                col = builder.add(builder.mul(i, ir.Constant(i64, 32)), ir.Constant(i64, 16 * h))
                builder.store(builder.trunc(q, vb), addr(builder, qa, row, col, vb), align=1)
                sh = builder.call(radd, [q])
                c = builder.add(builder.mul(i, ir.Constant(i64, 2)), ir.Constant(i64, h))
                builder.store(builder.mul(sh, ir.Constant(i32, -128)), addr(builder, ca, row, c, i32), align=4)
                total = builder.add(total, sh)
            builder.store(d, addr(builder, da, row, i, f32), align=4)
            builder.store(builder.fmul(d, builder.sitofp(total, f32)), addr(builder, sa, row, i, f32), align=4)
        return context.get_dummy_value()
    return types.void(y, b, xq, xd, xs, xc), codegen


@njit(cache=True)
def quantize_rows(x, xq, xd, xs, xc):
    """Quantize x: float32 [B, K] per 32 columns: xq int8 [B, K], xd = amax / 127, xs = xd * sum(xq)
    (float32 [B, K/32]), and xc = -128 * sum(xq) per 16 columns (int32 [B, K/16]: what the kernels take
    back out of the dot products of the "q8" weights' biased bytes)."""
    for b in range(x.shape[0]):
        _quantize_row(np.ascontiguousarray(x[b]), b, xq, xd, xs, xc)   # (a row of a column slice: no copy)


@njit(cache=True)
def norm_quantize_rows(x, w, eps, xq, xd, xs, xc):
    """Fused RMSNorm and quantization: rows of ``x / sqrt(mean(x²) + eps) * w`` (x: float32 [B, K],
    w: [K]) into xq, xd, xs, xc as :func:`quantize_rows`. The squares are summed in column order (a
    serial chain; 16 lanes and a tree were faster, but they change the bits of every model's greedy
    text: docs/perf/2026-12-05.md)."""
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
    kept the gated activation slow; measured: docs/perf/figures-from-docstrings.md). x = k ln2 + r
    with |r| <= ln2/2; e^r from Cephes
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
#: one thread left the other spinning (measured: docs/perf/2026-12-03.md).
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
