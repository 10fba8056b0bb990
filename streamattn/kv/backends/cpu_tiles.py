"""Tile-level pieces of the CPU backend: scores, exps, their sum and P·V over one tile of keys.

Each is written so that a row's result depends only on the row and the tile's keys, never on how many
rows the call has or on keys past the row's last one (the batch invariance of :mod:`.cpu`). The vector
paths need head_dim % 16 == 0 (:mod:`.cpu_simd`); ``scores`` and ``accumulate`` are the plain-Numba
fallbacks for other sizes.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ...runtime import kernel_cache
from .. import storage
from ..storage import f16_to_f32
from ...runtime import llvm_ir
from . import cpu_simd
from ...runtime.llvm_ir import I32, VF, W, bf16_to_f32, const
from .cpu_simd import PV, QK, QK_KEYS

kernel_cache.register(__name__, depends_on=[cpu_simd, llvm_ir, storage])

# Reassociation and contraction let LLVM vectorise the reductions; no 'nnan'/'ninf' because the
# masked scores are -inf on purpose.
FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}
KIND = {"float32": 0, "float16": 1, "bfloat16": 2, "q8_0": 3, "q4_0": 4}
_QK1, _QK2, _QK3, _QK4 = QK[1], QK[2], QK[3], QK[4]   # module globals: Numba cannot index the dicts in a kernel
_PV1, _PV2, _PV3, _PV4 = PV[1], PV[2], PV[3], PV[4]
_KEYS = (0, QK_KEYS[1], QK_KEYS[2], QK_KEYS[3], QK_KEYS[4])   # keys per call of QK[R] (cpu_simd.QK_KEYS)


#: The constants of :func:`exp16` (Cephes exp2f's polynomial: see exp_tile).
_EXP2_POLY = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
              2.402264791363012e-1, 6.931472028550421e-1, 1.0)
_LOG2E = 1.4426950408889634


@intrinsic
def exp16(typingctx, x, j0, mx):
    """x[j0:j0 + 16] <- exp(x - mx) in place, one <16 x float>: the arithmetic of
    :func:`exp_tile` written as vector IR, the same IEEE operations in
    the same order per element — y = max((x - mx) * log2(e), -127) (Numba's max: y when the compare
    fails, so NaN stays NaN), k = floor(y + 1/2), f = y - k, Horner's polynomial in f with one FMA per
    step, times 2^k by exponent bits. As a plain Numba loop, compiled apart from its caller, it stayed
    scalar (a call to floorf per element; measured: docs/perf/2026-12-01.md)."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.layout == "C" and x.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        j = context.cast(builder, args[1], sig.args[1], types.int64)
        m = context.cast(builder, args[2], sig.args[2], types.float32)
        ptr = builder.bitcast(builder.gep(ary.data, [j]), VF.as_pointer())
        v = builder.load(ptr, align=4)
        ms = builder.shuffle_vector(builder.insert_element(ir.Constant(VF, ir.Undefined), m, ir.Constant(I32, 0)),
                                    ir.Constant(VF, ir.Undefined), ir.Constant(ir.VectorType(I32, W), [0] * W))
        y = builder.fmul(builder.fsub(v, ms), _f32s(_LOG2E))
        lo = _f32s(-127.0)
        y = builder.select(builder.fcmp_ordered(">", lo, y), lo, y)
        floor = _vfn(builder, "llvm.floor.v16f32", [VF])
        fma = _vfn(builder, "llvm.fma.v16f32", [VF, VF, VF])
        k = builder.call(floor, [builder.fadd(y, _f32s(0.5))])
        f = builder.fsub(y, k)
        p = _f32s(_EXP2_POLY[0])
        for c in _EXP2_POLY[1:]:
            p = builder.call(fma, [p, f, _f32s(c)])
        vi = ir.VectorType(I32, W)
        e = builder.shl(builder.add(builder.fptosi(k, vi), ir.Constant(vi, [127] * W)), ir.Constant(vi, [23] * W))
        builder.store(builder.fmul(p, builder.bitcast(e, VF)), ptr, align=4)
        return context.get_dummy_value()
    return types.void(x, j0, mx), codegen


def _f32s(c: float):
    """<16 x float> of the float32 nearest to c (as Numba rounds a np.float32 constant)."""
    return ir.Constant(VF, [float(np.float32(c))] * W)


def _vfn(builder, name, args):
    mod = builder.module
    return mod.globals.get(name) or ir.Function(mod, ir.FunctionType(args[0], args), name)


@intrinsic
def lane_sum(typingctx, x, n16):
    """sum(x[:n16]) (n16 a multiple of 16) in the order of :func:`tile_sum`:
    16 lanes from zero (lane i adds x[i], x[i + 16], ... in turn), then lanes i + 8 onto i, i + 4 onto i,
    and (l0 + l2) + (l1 + l3). One vector add per 16 elements, whatever the caller's compilation."""
    if not (isinstance(x, types.Array) and x.ndim == 1 and x.layout == "C" and x.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        n = context.cast(builder, args[1], sig.args[1], types.int64)
        acc = cgutils.alloca_once_value(builder, ir.Constant(VF, [0.0] * W))
        base = builder.bitcast(ary.data, VF.as_pointer())
        with cgutils.for_range(builder, builder.udiv(n, const(W))) as loop:
            v = builder.load(builder.gep(base, [loop.index]), align=4)
            builder.store(builder.fadd(builder.load(acc), v), acc)
        a = builder.load(acc)

        def lanes(v, idx):
            return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, len(idx)), list(idx)))
        a8 = builder.fadd(lanes(a, range(8)), lanes(a, range(8, 16)))
        a4 = builder.fadd(lanes(a8, range(4)), lanes(a8, range(4, 8)))
        e = [builder.extract_element(a4, ir.Constant(I32, i)) for i in range(4)]
        return builder.fadd(builder.fadd(e[0], e[2]), builder.fadd(e[1], e[3]))
    return types.float32(x, n16), codegen


def _wide(x, kind):
    """One storage element as float32: itself for float32, else float16 (kind 1) or bfloat16 (kind 2) bits."""


@overload(_wide)
def _wide_impl(x, kind):
    if x == types.float32:
        return lambda x, kind: x
    return lambda x, kind: f16_to_f32(x) if kind == 1 else bf16_to_f32(x)


def _at(row, i, kind):
    """Value i of one storage row as float32: :func:`_wide` of row[i], or read from its q8_0 (kind 3) or
    q4_0 (kind 4) block for a uint8 row (the plain-loop path of head_dims that are no multiple of 16)."""


@overload(_at)
def _at_impl(row, i, kind):
    if row.dtype != types.uint8:
        return lambda row, i, kind: _wide(row[i], kind)

    def impl(row, i, kind):
        b, j = i // 32, i % 32
        if kind == 3:
            o = 34 * b
            q = np.int32(row[o + 2 + j])
            q = q - 256 if q > 127 else q
        else:
            o = 18 * b
            byte = np.int32(row[o + 2 + j % 16])
            q = (byte & 15 if j < 16 else byte >> 4) - 8
        d = f16_to_f32(np.uint16(np.int64(row[o]) | (np.int64(row[o + 1]) << 8)))
        return np.float32(q) * d
    return impl


@njit(fastmath=FASTMATH, cache=True)
def exp_tile(x, n16, mx):
    """x[:n16] <- exp(x[:n16] - mx) in place (n16 a multiple of 16); vectorisable (libm's exp is scalar).

    2^y = 2^k * 2^f with k = floor(y + 1/2), f in [-1/2, 1/2]: 2^f from a degree-6 polynomial (Cephes
    exp2f coefficients, relative error ~2e-7; one FMA per step), 2^k by writing k + 127 into a float32's
    exponent bits.
    y is clamped at -127, where those bits are 0: weights under 2^-127 of the running max become exactly
    0, and so do masked (-inf) scores. (Not the 1.5 * 2^23 rounding trick: under 'reassoc' LLVM may fold
    y - ((y + M) - M) to 0.) Blocks of 16 with a constant inner trip count: every element takes the same
    vector code, never a scalar remainder loop that could contract differently.
    """
    for j0 in range(0, n16, 16):
        exp16(x, j0, mx)                        # this arithmetic as one vector (exp16)


@njit(fastmath=FASTMATH - {"reassoc"}, cache=True)
def tile_sum(x, n16):
    """sum(x[:n16]) in one fixed order: 16 lanes (lane i holds x[i], x[i + 16], ... in turn), then a fixed
    tree. Trailing zero blocks leave it unchanged, so a tile's sum does not depend on where the call's
    keys end (batch invariance). No 'reassoc', so LLVM keeps this order."""
    return lane_sum(x, n16)                     # as one vector (lane_sum): the order above


@njit(fastmath=FASTMATH, cache=True)
def soft_cap(x, n16, cap):
    """x[:n16] <- cap * tanh(x[:n16] / cap) in place (n16 a multiple of 16; float32 x and cap): attention
    logit soft-capping, applied to a tile's scores before the mask.

    tanh(t) for t = |x| / cap: below 1/8 its Taylor series to t^7 (next term < 2e-10), else (1 - e) / (1 + e)
    with e = exp(-2t) from :func:`exp_tile` (1 - e >= 0.22 there, so a few ulp), signed. Every loop is
    straight-line float32 code that LLVM vectorises; libm's scalar tanhf made a capped decode much slower
    than a plain one (benchmarks/softcap_attention.py; measured: docs/perf/2026-12-02.md)."""
    inv = np.float32(1.0) / cap
    e = np.empty(n16, np.float32)                                   # [n16]
    for j in range(n16):
        e[j] = np.float32(-2.0) * abs(x[j]) * inv                   # -2t
    exp_tile(e, n16, np.float32(0.0))                               # exp(-2t)
    for j in range(n16):
        t = abs(x[j]) * inv
        t2 = t * t
        series = t * (np.float32(1.0) + t2 * (np.float32(-1.0 / 3.0) + t2 * (np.float32(2.0 / 15.0)
                                                                            + t2 * np.float32(-17.0 / 315.0))))
        th = series if t < np.float32(0.125) else (np.float32(1.0) - e[j]) / (np.float32(1.0) + e[j])
        x[j] = cap * th if x[j] >= 0 else -(cap * th)


@njit(fastmath=FASTMATH, cache=True)
def scores(qr, kt, n, out, kind):
    """out[j] = qr . kt[j] for j < n (one query row), widening 16-bit storage as it is read.

    One key row at a time, in memory order: reading four rows interleaved (to share q's loads) streamed
    float32 K from memory slower on one thread (measured: docs/perf/figures-from-docstrings.md).
    """
    D = qr.shape[0]
    for j in range(n):
        a = np.float32(0.0)
        kj = kt[j]
        for i in range(D):
            a += qr[i] * _at(kj, i, kind)
        out[j] = a


@njit(fastmath=FASTMATH - {"reassoc"}, cache=True)
def accumulate(acc, p, vt, n, rows, kind):
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
                a[i] += ((p0 * _at(v0, i, kind) + p1 * _at(v1, i, kind)) +
                         (p2 * _at(v2, i, kind) + p3 * _at(v3, i, kind))) + \
                        ((p4 * _at(v4, i, kind) + p5 * _at(v5, i, kind)) +
                         (p6 * _at(v6, i, kind) + p7 * _at(v7, i, kind)))
    for j in range(n4, n):
        vj = vt[j]
        for r in range(rows):
            a = acc[r]
            pj = p[r, j]
            for i in range(D):
                a[i] += pj * _at(vj, i, kind)


@njit(fastmath=FASTMATH, cache=True)
def _qk_rows(R, qf, r, kt, n, sc, kind):
    """sc[r + g, :n] = qf[r + g] . kt[:n] for g < R with the R-row kernel (n a multiple of 16)."""
    for j in range(0, n, _KEYS[R]):
        if R == 4:
            _QK4(qf, r, kt, j, sc, kind)
        elif R == 2:
            _QK2(qf, r, kt, j, sc, kind)
        else:
            _QK1(qf, r, kt, j, sc, kind)


@njit(fastmath=FASTMATH, cache=True)
def _qk_rows3(qf, r, kt, n, sc, kind):
    """sc[r + g, :n] = qf[r + g] . kt[:n] for g < 3 with the 3-row kernel (n a multiple of 16)."""
    for j in range(0, n, _KEYS[3]):
        _QK3(qf, r, kt, j, sc, kind)


@njit(fastmath=FASTMATH, cache=True)
def tile_scores(qf, kt, n, sc, kind, kpad, stail):
    """sc[r, :n] = qf[r] . kt[:n] for every row r (head_dim % 16 == 0): rows in fours, then two, one (three
    left over, a GQA group of 3 as SmolLM2's: one 3-row pass, which reads each key once for the three
    where a 2-row and a 1-row pass read it twice).

    Every score is the same arithmetic whichever kernel computes it (lane-wise FMAs over head_dim, then
    one fixed tree), and the keys past the last whole 16 go through the same kernels on a zero-padded
    copy, so a score does not depend on the row count or on where the tile ends (batch invariance).
    qf: [rows, D] float32, kt: [n, D] storage, sc: [rows, >= n] float32, kpad: [16, D] storage scratch,
    stail: [rows, 16] float32 scratch
    """
    rows = qf.shape[0]
    nb = n - n % 16                                    # keys in whole blocks of 16
    tail = n - nb
    if tail:
        kpad[:tail] = kt[nb:n]
        kpad[tail:] = 0
    # r and the tail's 16 as int64, not Numba's literal types (r's first value would be typed
    # Literal[int](0)): one copy of each row kernel per storage, not four (docs/DESIGN.md §29).
    r, block = np.int64(0), np.int64(16)
    while r < rows:
        if rows - r == 3:
            _qk_rows3(qf, r, kt, nb, sc, kind)
            if tail:
                _qk_rows3(qf, r, kpad, block, stail, kind)
            r += 3
            continue
        R = 4 if rows - r >= 4 else (2 if rows - r >= 2 else 1)
        _qk_rows(R, qf, r, kt, nb, sc, kind)
        if tail:
            _qk_rows(R, qf, r, kpad, block, stail, kind)
        r += R
    if tail:
        for r in range(rows):
            sc[r, nb:n] = stail[r, :tail]


@njit(fastmath=FASTMATH, cache=True)
def tile_accumulate(acc, p, vt, n, kind):
    """acc[r] += sum_j p[r, j] vt[j] for every row r, j < n (head_dim % 16 == 0): rows in fours, two, one
    (three left over: one 3-row pass, as in :func:`tile_scores`).

    acc: [rows, D] float32, p: [rows, >= n] float32, vt: [n, D] storage
    """
    rows = acc.shape[0]
    r = 0
    while r < rows:
        if rows - r >= 4:
            _PV4(acc, r, p, vt, n, kind)
            r += 4
        elif rows - r == 3:
            _PV3(acc, r, p, vt, n, kind)
            r += 3
        elif rows - r >= 2:
            _PV2(acc, r, p, vt, n, kind)
            r += 2
        else:
            _PV1(acc, r, p, vt, n, kind)
            r += 1
