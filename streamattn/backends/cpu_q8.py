"""Scores against q8_0 keys by integer byte dot products (``vpdpbusd``), the query split into three bytes.

A q8_0 key is 32 int8 values per block and one float16 scale d. Its score against a float32 query row is
sum_b d_b * sum_j q_j k_j. The float kernels (:mod:`.cpu_simd`) widen every key byte to a float
(sign extension, conversion, a multiply by d) and then sum each key's 16 lanes by a transpose: per key
of SmolLM2 (head_dim 64, GQA 3) ~41 vector instructions on the two ports that run 512-bit work, more than
float16's ~31, so q8_0 decoded only 1.3x as fast as float16 at 32k keys though it reads half the bytes.

Here the key bytes are never converted. Per query row and block the query is written exactly as an
integer multiple of a power of two, q_j = Q_j * 2^-e (``e`` puts max|Q_j| in (2^22 - 2^15, 2^23 - 2^16],
so the rounding of q to Q is under 2^-23 of the block's largest |q|, float32's own step there), and Q_j in three
signed bytes, Q = 65536 A + 256 B + C. The integer dot products sum_j k_j A_j (and B, C) are exact in
int32, and 16 keys' dot products come from one ``vpdpbusd`` per four dims when the 16 keys' blocks are
transposed so that lane t holds key t's bytes: no per-key horizontal sum is left. Per key and block
that is 24 / 16 ``vpdpbusd`` per query row, a 16 x 8 dword transpose (24 shuffles for 16 keys), an xor
(``vpdpbusd`` takes its first operand unsigned: the key bytes go in as k + 128, and the query side
subtracts 128 * sum A_j, a constant of the query), and per row two conversions and two FMAs for 16 keys:

    score_t += (d_t * 2^-e) * float(65536 * dotA_t + (256 * dotB_t + dotC_t))

where 65536 * float(dotA) is exact and float(256 dotB + dotC) is the one rounding of the block's integer
sum (|256 dotB + dotC| < 2^28). The result differs from the float kernels only by that rounding and the
query's (each under float32's step at the block's scale), so the oracle over the stored values holds with
the usual float32 tolerance, and a row's bits depend only on the row and the keys, never on how many rows
share the call (the batch invariance of :mod:`.cpu`). A block scale that is not finite scores NaN, as the
float kernels' 0 * inf does, and so does a query block holding NaN or inf.

Needs AVX512-VNNI (:data:`AVAILABLE`) and head_dim % 32 == 0; :mod:`.cpu_tiles` keeps the float path
otherwise.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..quant.kernels import host_cpu_has
from .cpu_simd import F32, I16, I32, I8P, VF, W, Rows, _splat, c_arrays, const, llvm_fn, prefetch_line

#: Whether this CPU has the 512-bit byte dot product the kernel is built on.
AVAILABLE = host_cpu_has("avx512f") and host_cpu_has("avx512bw") and host_cpu_has("avx512vnni")

KEYS = 16                      # keys per kernel call: one per lane
ROWS = 4                       # query rows per kernel call at most (3 * ROWS accumulators in registers)
BLOCK = 32                     # q8_0 values per block
BLOCK_BYTES = 34               # float16 scale + 32 int8
#: How far ahead of the 16 keys' bytes to prefetch (hint T0). Their stream runs at ~5 ns a key where
#: float16's needs ~7 for twice the bytes, and the float kernels' 8 KiB (cpu_simd.PREFETCH_BYTES, tuned on
#: float16) left it waiting: over 2M keys read from memory, one row block of 3, 6.8-7.0 ns a key at
#: 8 KiB, 5.2-5.6 at 1 KiB, 5.3-6.2 at 2 KiB, 6.1 at 512 B, 6.3-6.8 with none (docs/PERF.md, 2026-12-05).
PREFETCH_BYTES = 1024
LIMBS = 3                      # signed bytes per query value
LIMIT = (1 << 23) - (1 << 16)  # max |Q|: 65536 A + 256 B + C with A, B, C in [-128, 127] reaches 127 * 65793
VI = ir.VectorType(I32, W)     # <16 x i32>


def _dword_transpose(builder, zs):
    """8 vectors of 16 dwords, z_t = [key t's 8 dwords | key t + 8's], -> 8 vectors x_d whose lane t is
    dword d of key t (t < 16): the 8 x 8 transpose of each 256-bit half in three rounds of unpacks
    (dwords, qwords, 128-bit blocks), 24 two-source shuffles."""
    def unpack(x, y, width, high):           # per 128-bit block, as vpunpck{l,h}{dq,qdq}
        idx = []
        for c in range(4):
            base = 4 * c + (2 if high else 0)
            idx += ([base, 16 + base, base + 1, 17 + base] if width == 1 else
                    [base, base + 1, 16 + base, 17 + base])
        return builder.shuffle_vector(x, y, ir.Constant(VI, idx))

    def blocks(x, y, high):                  # per 256-bit half h: [x's block 2h (+1), y's block 2h (+1)]
        idx = []
        for h in range(2):
            src = 2 * h + (1 if high else 0)
            idx += [4 * src + i for i in range(4)] + [16 + 4 * src + i for i in range(4)]
        return builder.shuffle_vector(x, y, ir.Constant(VI, idx))

    t = []
    for a in range(0, 8, 2):                 # dword pairs of inputs a, a + 1
        t += [unpack(zs[a], zs[a + 1], 1, False), unpack(zs[a], zs[a + 1], 1, True)]
    u = []
    for a in (0, 4):                         # u[4i + d]: dword d of inputs 4i .. 4i + 3, per block
        u += [unpack(t[a], t[a + 2], 2, False), unpack(t[a], t[a + 2], 2, True),
              unpack(t[a + 1], t[a + 3], 2, False), unpack(t[a + 1], t[a + 3], 2, True)]
    return [blocks(u[d % 4], u[4 + d % 4], d >= 4) for d in range(8)]


def _make_qk8(R: int):
    """Intrinsic qk8(ql, qc, qe, r0, kt, j, sc): sc[r0 + g, j + t] = the score of query row r0 + g against
    key j + t (g < R, t < 16) from the row's limbs (:func:`query_limbs`).

    ql: [rows, blocks * 96] int8 (per block its 32 A bytes, then B, then C), qc: [rows, blocks * 3] int32
    (-128 * the sum of each limb's bytes), qe: [rows, blocks] float32 (2^-e), kt: [>= j + 16, blocks * 34]
    uint8 q8_0 rows, sc: [rows, >= j + 16] float32.
    """
    def codegen(context, builder, sig, args):
        def splat_i32(x):
            v = builder.insert_element(ir.Constant(VI, ir.Undefined), x, ir.Constant(I32, 0))
            return builder.shuffle_vector(v, ir.Constant(VI, ir.Undefined), ir.Constant(VI, [0] * W))

        la, ca, ea, ka, sa = (Rows(context, builder, sig.args[i], args[i]) for i in (0, 1, 2, 4, 6))
        r0, j = args[3], args[5]
        nb = ea.cols
        i8 = ir.IntType(8)
        v8 = ir.VectorType(I32, 8)
        vh = ir.VectorType(I16, W)
        dpbusd = llvm_fn(builder, "llvm.x86.avx512.vpdpbusd.512", VI, [VI, VI, VI])
        fma = llvm_fn(builder, "llvm.fma.v16f32", VF, [VF, VF, VF])
        gather = llvm_fn(builder, "llvm.x86.avx512.mask.gather.dpi.512", VI,
                         [VI, I8P, VI, ir.VectorType(ir.IntType(1), W), I32])
        rows = [builder.add(r0, const(g)) for g in range(R)]
        stride32 = builder.trunc(ka.row_stride, I32)
        stride_idx = builder.mul(splat_i32(stride32), ir.Constant(VI, list(range(W))))

        def at(base, off, ty):
            return builder.bitcast(builder.gep(base, [off], source_etype=i8), ty.as_pointer())

        # the 16 rows' bytes are contiguous: prefetch their lines PREFETCH_BYTES ahead, once per call
        key0 = builder.mul(j, ka.row_stride)
        span = builder.mul(ka.row_stride, const(KEYS))
        with cgutils.for_range(builder, builder.udiv(builder.add(span, const(63)), const(64))) as line:
            prefetch_line(builder, ka, j, builder.mul(line.index, const(64)), PREFETCH_BYTES)
        scores = [cgutils.alloca_once_value(builder, ir.Constant(VF, [0.0] * W)) for _ in range(R)]
        with cgutils.for_range(builder, nb) as blk:
            b = blk.index
            boff = builder.add(key0, builder.mul(b, const(BLOCK_BYTES)))
            row_off = [builder.add(boff, builder.mul(const(t), ka.row_stride)) for t in range(KEYS)]
            zs = []
            for t in range(8):
                lo = builder.load(at(ka.data, builder.add(row_off[t], const(2)), v8), align=1, typ=v8)
                hi = builder.load(at(ka.data, builder.add(row_off[t + 8], const(2)), v8), align=1, typ=v8)
                zs.append(builder.shuffle_vector(lo, hi, ir.Constant(VI, list(range(W)))))
            flip = ir.Constant(VI, [-0x7F7F7F80] * W)       # 0x80808080: k + 128 as unsigned bytes
            xs = [builder.xor(x, flip) for x in _dword_transpose(builder, zs)]
            # the 16 keys' block scales: one gather of the dword at each block's start (scale, 2 bytes)
            words = builder.call(gather, [ir.Constant(VI, [0] * W), builder.gep(ka.data, [boff], source_etype=i8),
                                          stride_idx, ir.Constant(ir.VectorType(ir.IntType(1), W), [1] * W),
                                          ir.Constant(I32, 1)])
            dk = builder.fpext(builder.bitcast(builder.trunc(words, vh), ir.VectorType(ir.HalfType(), W)), VF)
            dk = builder.fadd(dk, builder.fsub(dk, dk))     # an inf scale reads as NaN, as its 0 * inf does

            def correction(g, L):                            # each sum starts at -128 * sum(limb)
                off = builder.mul(builder.add(builder.mul(b, const(LIMBS)), const(L)), const(4))
                word = at(ca.data, builder.add(builder.mul(rows[g], ca.row_stride), off), I32)
                return splat_i32(builder.load(word, typ=I32))
            accs = [[correction(g, L) for L in range(LIMBS)] for g in range(R)]
            qrow = [builder.add(builder.mul(rows[g], la.row_stride), builder.mul(b, const(LIMBS * BLOCK)))
                    for g in range(R)]
            for d in range(8):
                for g in range(R):
                    for L in range(LIMBS):
                        qd = builder.load(at(la.data, builder.add(qrow[g], const(L * BLOCK + 4 * d)), I32),
                                          align=1, typ=I32)
                        accs[g][L] = builder.call(dpbusd, [accs[g][L], xs[d], splat_i32(qd)])
            for g in range(R):
                hi_f = builder.sitofp(accs[g][0], VF)
                lo = builder.add(builder.shl(accs[g][1], ir.Constant(VI, [8] * W)), accs[g][2])
                total = builder.call(fma, [hi_f, ir.Constant(VF, [65536.0] * W), builder.sitofp(lo, VF)])
                step = builder.load(at(ea.data, builder.add(builder.mul(rows[g], ea.row_stride),
                                                             builder.mul(b, const(4))), F32), typ=F32)
                wk = builder.fmul(dk, _splat(builder, step))  # d * 2^-e (exact unless it underflows)
                builder.store(builder.call(fma, [wk, total, builder.load(scores[g])]), scores[g])
        for g in range(R):
            out = at(sa.data, builder.add(builder.mul(rows[g], sa.row_stride), builder.mul(j, const(4))), VF)
            builder.store(builder.load(scores[g]), out, align=4)
        return context.get_dummy_value()

    @intrinsic
    def qk8(typingctx, ql, qc, qe, r0, kt, j, sc):
        if not (c_arrays(ql, qc, qe, kt, sc) and kt.dtype == types.uint8):
            return None
        return types.void(ql, qc, qe, r0, kt, j, sc), codegen
    return qk8


QK8 = {R: _make_qk8(R) for R in range(1, ROWS + 1)}
_QK8_1, _QK8_2, _QK8_3, _QK8_4 = QK8[1], QK8[2], QK8[3], QK8[4]


@njit(cache=True)
def query_limbs(qf, ql, qc, qe):
    """Each query row's blocks of 32 as integers over a power of two, in three signed bytes.

    Per row r and block b: e is the largest integer (at most 126) with max|q| * 2^e <= LIMIT, Q_j =
    rint(q_j * 2^e) (q_j * 2^e is exact; |Q_j - q_j 2^e| <= 1/2, under 2^-22 of max|q| * 2^e; a block
    whose max|q| is under 2^-103 is rounded at 2^-127, its scores then off by under 2^-100), and
    Q_j = 65536 A_j + 256 B_j + C_j with A, B, C in [-128, 127]. Written: ql[r, 96b + 32L + j] the limb L
    of Q_j, qc[r, 3b + L] = -128 * sum_j limb L of Q_j, qe[r, b] = 2^-e. A block whose largest |q| is not
    finite gets qe = NaN (its scores are NaN, as q . k is). qf: [rows, D] float32, D % 32 == 0.
    """
    rows, D = qf.shape
    for r in range(rows):
        for b in range(D // BLOCK):
            m = 0.0
            finite = True
            for i in range(BLOCK):
                x = abs(np.float64(qf[r, b * BLOCK + i]))
                finite = finite and math.isfinite(x)     # (max() would pass over a NaN)
                m = max(m, x)
            if not finite:
                ql[r, b * 96:(b + 1) * 96] = 0
                qc[r, 3 * b:3 * b + 3] = 0
                qe[r, b] = np.nan
                continue
            e = 126
            if m > 0.0:
                e = min(126, int(math.floor(math.log2(LIMIT / m))))
                while m * 2.0 ** e > LIMIT:
                    e -= 1
            scale = 2.0 ** e
            sa = sb = sc_ = 0
            for i in range(BLOCK):
                Q = np.int64(np.rint(np.float64(qf[r, b * BLOCK + i]) * scale))
                c = ((Q + 128) & 255) - 128
                Q1 = (Q - c) >> 8
                bb = ((Q1 + 128) & 255) - 128
                a = (Q1 - bb) >> 8
                ql[r, b * 96 + i] = a
                ql[r, b * 96 + 32 + i] = bb
                ql[r, b * 96 + 64 + i] = c
                sa += a
                sb += bb
                sc_ += c
            qc[r, 3 * b] = -128 * sa
            qc[r, 3 * b + 1] = -128 * sb
            qc[r, 3 * b + 2] = -128 * sc_
            qe[r, b] = np.float32(2.0 ** -e)


@njit(cache=True)
def _qk8_rows(ql, qc, qe, kt, n, sc):
    """sc[r, :n] for every row r by the 16-key kernel (n a multiple of 16): rows in fours, then the rest
    as one call (each row's bits are the same in any call)."""
    rows = ql.shape[0]
    r = 0
    while r < rows:
        R = min(ROWS, rows - r)
        for j in range(0, n, KEYS):
            if R == 4:
                _QK8_4(ql, qc, qe, r, kt, j, sc)
            elif R == 3:
                _QK8_3(ql, qc, qe, r, kt, j, sc)
            elif R == 2:
                _QK8_2(ql, qc, qe, r, kt, j, sc)
            else:
                _QK8_1(ql, qc, qe, r, kt, j, sc)
        r += R


@njit(cache=True)
def _tile_scores_q8(ql, qc, qe, kt, n, sc, kpad, stail):
    """sc[r, :n] = the scores of every row's limbs against q8_0 keys kt[:n]: whole blocks of 16 keys in
    place, the rest through the zero-padded kpad (as :func:`.cpu_tiles.tile_scores`).
    kpad: [16, row bytes] uint8 scratch, stail: [rows, 16] float32 scratch."""
    nb = n - n % KEYS
    tail = n - nb
    _qk8_rows(ql, qc, qe, kt, nb, sc)
    if tail:
        kpad[:tail] = kt[nb:n]
        kpad[tail:] = 0
        _qk8_rows(ql, qc, qe, kpad, KEYS, stail)
        for r in range(ql.shape[0]):
            sc[r, nb:n] = stail[r, :tail]


def limbs_for(qf, kind):
    """(ql, qc, qe) of :func:`query_limbs` for the query rows ``qf`` [rows, D] when the q8_0 integer path
    scores this call (``kind`` 3, head_dim % 32 == 0, :data:`AVAILABLE`), else empty arrays. Compiled
    code only (an overload)."""


@overload(limbs_for)
def _limbs_for_impl(qf, kind):
    def impl(qf, kind):
        rows, D = qf.shape
        m = rows if (AVAILABLE and kind == 3 and D % BLOCK == 0) else 0
        nb = D // BLOCK
        ql = np.empty((m, nb * LIMBS * BLOCK), np.int8)
        qc = np.empty((m, nb * LIMBS), np.int32)
        qe = np.empty((m, nb), np.float32)
        if m:
            query_limbs(qf, ql, qc, qe)
        return ql, qc, qe
    return impl


def tile_scores_q8(ql, qc, qe, kt, n, sc, kpad, stail):
    """sc[r, :n] = the scores of every row's limbs against q8_0 keys kt[:n]: whole blocks of 16 keys in
    place, the rest through the zero-padded kpad (as :func:`.cpu_tiles.tile_scores`). Callers take this
    path when :func:`limbs_for` gave rows; it compiles to nothing for other storage or without VNNI.
    kpad: [16, row bytes] uint8 scratch, stail: [rows, 16] float32 scratch."""


@overload(tile_scores_q8)
def _tile_scores_q8_impl(ql, qc, qe, kt, n, sc, kpad, stail):
    if AVAILABLE and kt.dtype == types.uint8:
        return lambda ql, qc, qe, kt, n, sc, kpad, stail: _tile_scores_q8(ql, qc, qe, kt, n, sc, kpad, stail)
    return lambda ql, qc, qe, kt, n, sc, kpad, stail: None
