"""LLVM-IR block dot products of :mod:`streamattn.models.qmatmul`: one weight row against R activation rows.

Numba has no vector types, and plain Numba loops over the same blocks did not vectorise (0.3-0.4 G
weights/s, see docs/PERF.md), so the dot products are emitted as IR here, like streamattn/backends/cpu_simd.

Each intrinsic takes one weight row ``r`` and R consecutive activation rows ``b .. b+R-1`` and writes
``out[b + j, r]``. A 32-block of the weight is loaded and unpacked once (nibble split, ``|w|`` for the
sign trick, its scale and min) and then dotted against the R activation blocks: for a prefill chunk the
unpacking and the weight's loads are shared by R rows instead of redone for each.

Bit-identity across R (batch invariance): every output element is computed by the same instructions in
the same order whatever R is — row j has its own accumulators (8 float lanes for even blocks, 8 for odd
blocks, and two scalar min-term sums), its block i goes into the same lanes with the same FMA, and the
final lane sum is the same fixed tree. R only changes which other rows' work is interleaved between
them, which no row's arithmetic can see. So R = 1 is the 1-row kernel, and a row's result does not
depend on how many rows were in the call or where it sat among them.
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from streamattn.backends.cpu_simd import _addr, _c_arrays, _fmuladd, _llvm_fn, _load16, _Rows

I1, I8, I16, I32, I64, F32 = (ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                              ir.FloatType())
V16I8, V32I8, V16I16, V8I32, V8F, V16F = (ir.VectorType(I8, 16), ir.VectorType(I8, 32), ir.VectorType(I16, 16),
                                          ir.VectorType(I32, 8), ir.VectorType(F32, 8), ir.VectorType(F32, 16))
V64I8, V32I16, V16I32 = ir.VectorType(I8, 64), ir.VectorType(I16, 32), ir.VectorType(I32, 16)
for _t in (I1, I8, I16, I32, I64, F32, V16I8, V32I8, V16I16, V8I32, V8F, V16F, V64I8, V32I16, V16I32):
    str(_t)                                       # cache each str() now: see _stable


def _host_cpu_has(feature: str) -> bool:
    """Whether LLVM reports ``feature`` (e.g. "avx2") for this CPU: what Numba compiles for."""
    import llvmlite.binding as llvm
    return "+" + feature in llvm.get_host_cpu_features().flatten().split(",")


#: Whether this CPU has the VNNI byte dot product (AVX-VNNI, or AVX512-VNNI with VL): then a block's four-byte
#: sums are one ``vpdpbusd`` instead of ``vpmaddubsw`` + ``vpmaddwd``, with the same integer results.
VNNI = _host_cpu_has("avxvnni") or (_host_cpu_has("avx512vnni") and _host_cpu_has("avx512vl"))


#: Whether the one-row kernel may take two blocks per 512-bit vector (AVX-512 BW): see make_qdot_rows.
WIDE = _host_cpu_has("avx512bw") and _host_cpu_has("avx512f")
WIDE_VNNI = WIDE and _host_cpu_has("avx512vnni")


def _isum2(builder, wu, wsign, x64, vnni: bool):
    """<16 x i32>: :func:`_isum` of two blocks at once (wu, x64: <64 x i8>; lanes 0-7 the first block's,
    8-15 the second's), the same integers. AVX-512 has no vpsignb: x takes w's sign by a select (where w
    is 0 the lane's product is 0 whatever x is)."""
    if wsign is not None:
        zero = ir.Constant(V64I8, [0] * 64)
        x64 = builder.select(builder.icmp_signed("<", wsign, zero), builder.sub(zero, x64), x64)
    if vnni:
        dp = _llvm_fn(builder, "llvm.x86.avx512.vpdpbusd.512", V16I32, [V16I32, V16I32, V16I32])
        return builder.call(dp, [ir.Constant(V16I32, [0] * 16), builder.bitcast(wu, V16I32),
                                 builder.bitcast(x64, V16I32)])
    p16 = builder.call(_llvm_fn(builder, "llvm.x86.avx512.pmaddubs.w.512", V32I16, [V64I8, V64I8]), [wu, x64])
    return builder.call(_llvm_fn(builder, "llvm.x86.avx512.pmaddw.d.512", V16I32, [V32I16, V32I16]),
                        [p16, ir.Constant(V32I16, [1] * 32)])


def _i64(n):
    return ir.Constant(I64, n)


def _unsigned_weights(builder, w32, signed: bool):
    """(|w|, w) for the sign trick: vpmaddubsw multiplies unsigned by signed bytes, so a signed weight
    block is taken as |w| and each activation block gets w's sign (:func:`_isum`). Done once per block,
    shared by the R activation rows."""
    if not signed:
        return w32, None
    ty = w32.type                                   # <32 x i8>, or <64 x i8> for a pair of blocks
    return builder.call(_llvm_fn(builder, f"llvm.abs.v{ty.count}i8", ty, [ty, I1]), [w32, ir.Constant(I1, 0)]), w32


def _isum(builder, wu, wsign, x32, vnni: bool):
    """<8 x i32>: lane i = sum of w[j] * x[j] over j in 4i..4i+3 (wu: <32 x i8> unsigned weights,
    ``wsign`` the signed weights whose signs x takes, or None).

    ``vnni``: one ``vpdpbusd`` (into zero). Otherwise ``vpmaddubsw`` (pairs into int16, saturating) then
    ``vpmaddwd`` by ones. The two agree exactly: a pair never saturates, since |w| <= 128 (Q8 -128 taken
    as unsigned 128; Q4 nibbles <= 15) and |x| <= 127, so a pair sum is at most 2 * 128 * 127 = 32512.
    About 10% faster on a Q4_1 matvec (docs/PERF.md)."""
    if wsign is not None:
        x32 = builder.call(_llvm_fn(builder, "llvm.x86.avx2.psign.b", V32I8, [V32I8, V32I8]), [x32, wsign])
    if vnni:
        dp = _llvm_fn(builder, "llvm.x86.avx512.vpdpbusd.256", V8I32, [V8I32, V8I32, V8I32])
        return builder.call(dp, [ir.Constant(V8I32, [0] * 8), builder.bitcast(wu, V8I32),
                                 builder.bitcast(x32, V8I32)])
    p16 = builder.call(_llvm_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [V32I8, V32I8]), [wu, x32])
    ones = ir.Constant(V16I16, [1] * 16)
    return builder.call(_llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16]), [p16, ones])


def _splat(builder, x, n):
    """<n x float> of the scalar x."""
    ty = ir.VectorType(F32, n)
    v = builder.insert_element(ir.Constant(ty, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(ty, ir.Undefined), ir.Constant(ir.VectorType(I32, n), [0] * n))


def _splat8(builder, x):
    return _splat(builder, x, 8)


def _hsum(builder, v, n):
    """Sum of the n lanes of v by a fixed halving tree (the same order on every call)."""
    while n > 1:
        h = n // 2
        ty = ir.VectorType(I32, h)
        lo = builder.shuffle_vector(v, v, ir.Constant(ty, list(range(h))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ty, list(range(h, n))))
        v, n = builder.fadd(lo, hi), h
    return builder.extract_element(v, ir.Constant(I32, 0))


def _load(builder, rows, r, c, ty):
    return builder.load(_addr(builder, rows, r, c, ty), align=1, typ=ty)


def _load_floats(builder, rows, r, c, n: int = 1):
    """rows[r, c:c + n] as float (n = 1) or <n x float>: ``rows`` holds float32, or float16 bits (uint16,
    widened here: exactly, so both storages give the same floats)."""
    if rows.itemsize == 4:
        ty = F32 if n == 1 else ir.VectorType(F32, n)
        return builder.load(_addr(builder, rows, r, c, ty), align=4, typ=ty)
    half = ir.HalfType() if n == 1 else ir.VectorType(ir.HalfType(), n)
    bits = builder.load(_addr(builder, rows, r, c, I16 if n == 1 else ir.VectorType(I16, n)), align=2)
    return builder.fpext(builder.bitcast(bits, half), F32 if n == 1 else ir.VectorType(F32, n))


def _fma_scalar(builder, a, b, c):
    return builder.call(_llvm_fn(builder, "llvm.fmuladd.f32", F32, [F32, F32, F32]), [a, b, c])


def _store_out(builder, oa, row, col, value):
    builder.store(value, _addr(builder, oa, row, col, F32), align=4)


def _stable(intr, key: str):
    """Give an intrinsic a fixed identity. Numba pickles an intrinsic with a per-process uuid1; a cached
    function holding it as a closure variable (the drivers of streamattn.models.qmatmul) then gets a
    new cache key in every process: it was compiled anew at each start (0.3-1.3 s a weight kind) and
    its cache grew a file each time. ``key`` must name everything the code depends on."""
    try:
        intr._set_uuid(f"streamattn.models.qmatmul_kernels:{key}")
    except (AttributeError, AssertionError):      # numba internals moved: only the cache misses again
        pass
    for v in intr._defn.__closure__ or ():        # llvmlite types cache their str() once printed, which
        if isinstance(v.cell_contents, ir.Type):  # changes their pickle between key lookup and save:
            str(v.cell_contents)                  # print them all now (the module's constants: below)
    return intr


@functools.cache
def make_qdot_rows(kind: str, group: int = 32, R: int = 1, vnni: bool = False, WR: int = 1, wide: bool = False):
    """Intrinsic dot(qs, scale, minv, r, xq, xd, xs, b, out) -> None: ``out[b + j, r]`` = row r of a
    packed weight ("q4" or "q8" planes; ``minv`` is ignored for "q8") times quantized activation row
    b + j, for j < R.

    The R activation rows from b are stored interleaved by block (:func:`streamattn.models.qacts.
    group_activations`): block i of row b + j at flat element ``b * K + (i * R + j) * 32`` of xq, its
    ``xd`` and ``xs`` at ``b * K/32 + i * R + j``. So one pointer reaches all R rows at constant
    offsets, and their ``xs`` of a block are one vector. For R = 1 that is the plain row-major layout.

    Route (ggml's): per 32-block one integer dot product — ``vpmaddubsw`` (unsigned x signed bytes ->
    int16 pairs) and ``vpmaddwd`` (-> int32 quads) — turned to float and added lane-wise with one FMA by
    ``scale * xd``; a "q4" block's min term is one FMA, ``minv * xs`` (lane j of an R-lane vector: the
    same IEEE operation as a scalar FMA). Two chains per row (even and odd blocks), so FMA latency
    does not bound a 1-row loop. ``vnni``: see :func:`_isum` (the same results; only for CPUs with it).

    ``WR`` weight rows r .. r + WR - 1 in one call (``out[b + j, r + w]``): each activation block is
    loaded once for them and their chains interleave, which hides latency in the one-row (decode)
    kernel. Each output element still takes exactly the operations above, so WR changes no bit.

    ``wide`` (AVX-512): blocks go in 512-bit pairs (i even, i + 1) — one 64-byte weight and activation
    load, one integer dot product, one 16-lane FMA whose low half is chain 0 and high half chain 1 — and
    the ``scale * xd`` products of 16 blocks (8 for 16-column scales) are one vector multiply per
    activation row, each pair taking its lanes by a shuffle. For R > 1 the activations come laid out by
    :func:`streamattn.models.qacts.group_activations_wide` (pairs of blocks per row, xd row-major).
    Every lane sees the same operations in the same order as the narrow kernel (the same products, the same FMAs into the same chain), so the bits are
    the same; the q4 min terms stay scalar as above. Chunks of 16 blocks, the rest as above.
    """
    VR = ir.VectorType(F32, R)

    @intrinsic
    def qdot(typingctx, qs, scale, minv, r, xq, xd, xs, b, out):
        if not _c_arrays(qs, scale, minv, xq, xd, xs, out):
            return None
        if any(p.dtype not in (types.float32, types.uint16) for p in (scale, minv)):
            return None                          # _load_floats reads float32, or float16 bits as uint16

        def codegen(context, builder, sig, args):
            qa, sa, ma, xa, da, ua, oa = (_Rows(context, builder, sig.args[i], args[i]) for i in (0, 1, 2, 4, 5, 6, 8))
            r0 = context.cast(builder, args[3], sig.args[3], types.int64)
            b0 = context.cast(builder, args[7], sig.args[7], types.int64)
            wrows = [builder.add(r0, _i64(w)) for w in range(WR)]
            accs = [[[cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(2)]
                     for _ in range(R)] for _ in range(WR)]                        # [weight row][row][parity]
            accms = [[cgutils.alloca_once_value(builder, ir.Constant(VR, [0.0] * R)) for _ in range(2)]
                     for _ in range(WR)]                                            # [weight row][parity]

            def min_term(r, i, accm):
                """q4: weight row r's block i min term, ``minv * xs`` for the R rows, into accm."""
                minv = _splat(builder, _load_floats(builder, ma, r, i), R)
                builder.store(builder.call(_llvm_fn(builder, f"llvm.fmuladd.v{R}f32", VR, [VR, VR, VR]),
                                           [minv, _load(builder, ua, b0, builder.mul(i, _i64(R)), VR),
                                            builder.load(accm)]), accm)

            def nibbles(r, i, n):
                """q4: the 16 n bytes of weight row r from block i as <32 n x i8>, each block's low
                nibbles then its high ones (n = 1: block i; n = 2: blocks i and i + 1)."""
                vb = ir.VectorType(I8, 16 * n)
                raw = _load(builder, qa, r, builder.mul(i, _i64(16)), vb)
                lo = builder.and_(raw, ir.Constant(vb, [15] * (16 * n)))
                hi = builder.lshr(raw, ir.Constant(vb, [4] * (16 * n)))
                order = [x for blk in range(n) for x in (*range(16 * blk, 16 * blk + 16),
                                                          *range(16 * (n + blk), 16 * (n + blk) + 16))]
                return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 32 * n), order))

            def unpack(r, i, p, accm):
                """Weight row r's block i: (|w|, sign source, scale or scale pair); q4's min term into accm."""
                if kind == "q4":
                    w32 = nibbles(r, i, 1)
                    min_term(r, i, accm)
                else:
                    w32 = _load(builder, qa, r, builder.mul(i, _i64(32)), V32I8)
                wu, wsign = _unsigned_weights(builder, w32, signed=kind != "q4")
                if group == 32:
                    s = _load_floats(builder, sa, r, i)
                else:                                   # two scales per 32-block: lanes 0-3, 4-7
                    s0 = _load_floats(builder, sa, r, builder.mul(i, _i64(2)))
                    s1 = _load_floats(builder, sa, r, builder.add(builder.mul(i, _i64(2)), _i64(1)))
                    s = builder.shuffle_vector(_splat8(builder, s0), _splat8(builder, s1),
                                               ir.Constant(ir.VectorType(I32, 8), [0, 0, 0, 0, 8, 8, 8, 8]))
                return wu, wsign, s

            CH = 16 if group == 32 else 8            # blocks per vector of scale products

            def wide_chunks(nblk):
                """Blocks 0 .. CH * (nblk // CH) - 1 in pairs (see ``wide``); returns where they end."""
                nch = builder.udiv(nblk, _i64(CH))
                accw = [[cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16)) for _ in range(R)]
                        for _ in range(WR)]                                         # [weight row][row]
                with cgutils.for_range(builder, nch) as loop:
                    c0 = builder.mul(loop.index, _i64(CH))
                    xd16 = []
                    for j in range(R):                # row j's xd of the chunk (row-major: see group_activations)
                        v = builder.load(_addr(builder, da, builder.add(b0, _i64(j)), c0, V16F if group == 32 else V8F),
                                         align=4)
                        if group != 32:              # each block's xd twice: the products s0 * xd, s1 * xd
                            v = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 16), [k // 2 for k in range(16)]))
                        xd16.append(v)
                    s16 = [_load_floats(builder, sa, wrows[w], builder.mul(c0, _i64(32 // group)), 16)
                           for w in range(WR)]
                    svs = [[builder.fmul(s16[w], xd16[j]) for j in range(R)] for w in range(WR)]
                    for k in range(CH // 2):
                        i = builder.add(c0, _i64(2 * k))
                        i1 = builder.add(i, _i64(1))
                        pair0 = builder.mul(builder.udiv(i, _i64(2)), _i64(R))     # pair i/2 of row j: (i/2 R + j) 64 bytes
                        x64s = [_load(builder, xa, b0, builder.mul(builder.add(pair0, _i64(j)), _i64(64)), V64I8)
                                for j in range(R)]
                        if group == 32:
                            lanes = [2 * k] * 8 + [2 * k + 1] * 8
                        else:
                            lanes = [4 * k] * 4 + [4 * k + 1] * 4 + [4 * k + 2] * 4 + [4 * k + 3] * 4
                        for w in range(WR):
                            r = wrows[w]
                            if kind == "q4":
                                wu, wsign = nibbles(r, i, 2), None
                                min_term(r, i, accms[w][0])
                                min_term(r, i1, accms[w][1])
                            else:
                                wu, wsign = _unsigned_weights(
                                    builder, _load(builder, qa, r, builder.mul(i, _i64(32)), V64I8), signed=True)
                            for j in range(R):
                                isum = _isum2(builder, wu, wsign, x64s[j], vnni)
                                sv = builder.shuffle_vector(svs[w][j], svs[w][j], ir.Constant(ir.VectorType(I32, 16), lanes))
                                builder.store(builder.call(
                                    _llvm_fn(builder, "llvm.fmuladd.v16f32", V16F, [V16F, V16F, V16F]),
                                    [builder.sitofp(isum, V16F), sv, builder.load(accw[w][j])]), accw[w][j])
                for w in range(WR):                  # the halves are chains 0 and 1 of the narrow kernel
                    for j in range(R):
                        a16 = builder.load(accw[w][j])
                        for p in range(2):
                            builder.store(builder.shuffle_vector(a16, a16, ir.Constant(ir.VectorType(I32, 8), list(
                                range(8 * p, 8 * p + 8)))), accs[w][j][p])
                return builder.mul(nch, _i64(CH))

            def block(i, p):
                """Block i of each weight row into chain p of every activation row."""
                iR = builder.mul(i, _i64(R))
                ws = [unpack(wrows[w], i, p, accms[w][p]) for w in range(WR)]
                for j in range(R):
                    x32 = _load(builder, xa, b0, builder.mul(builder.add(iR, _i64(j)), _i64(32)), V32I8)
                    xd = (_load(builder, da, builder.add(b0, _i64(j)), i, F32) if wide    # row-major xd
                          else _load(builder, da, b0, builder.add(iR, _i64(j)), F32))
                    for w, (wu, wsign, s) in enumerate(ws):
                        isum = _isum(builder, wu, wsign, x32, vnni)
                        if group == 32:
                            sv = _splat8(builder, builder.fmul(s, xd))
                        else:                           # lane-wise the same products s0 * xd, s1 * xd
                            sv = builder.fmul(s, _splat8(builder, xd))
                        f = builder.sitofp(isum, V8F)
                        acc = accs[w][j][p]
                        builder.store(builder.call(_llvm_fn(builder, "llvm.fmuladd.v8f32", V8F, [V8F, V8F, V8F]),
                                                   [f, sv, builder.load(acc)]), acc)

            nblk = builder.udiv(xa.cols, _i64(32))
            start = _i64(0)
            if wide:
                start = wide_chunks(nblk)
            with cgutils.for_range(builder, builder.udiv(builder.sub(nblk, start), _i64(2))) as loop:
                i = builder.add(start, builder.mul(loop.index, _i64(2)))
                block(i, 0)
                block(builder.add(i, _i64(1)), 1)
            with builder.if_then(builder.icmp_unsigned("!=", builder.urem(builder.sub(nblk, start), _i64(2)),
                                                       _i64(0))):
                block(builder.sub(nblk, _i64(1)), 0)
            for w in range(WR):
                mins = builder.fadd(builder.load(accms[w][0]), builder.load(accms[w][1]))
                for j in range(R):
                    vec = builder.fadd(builder.load(accs[w][j][0]), builder.load(accs[w][j][1]))
                    res = builder.fadd(_hsum(builder, vec, 8), builder.extract_element(mins, ir.Constant(I32, j)))
                    _store_out(builder, oa, builder.add(b0, _i64(j)), wrows[w], res)
            return context.get_dummy_value()
        return types.void(qs, scale, minv, r, xq, xd, xs, b, out), codegen
    return _stable(qdot, f"qdot:{kind}:{group}:{R}:{int(vnni)}:{WR}:{int(wide)}")


@functools.cache
def make_fdot_rows(kind: int, R: int = 1):
    """Intrinsic dot(w, r, x, b, out) -> None: ``out[b + j, r]`` = row r of float storage (0 float32,
    1 float16 bits, 2 bfloat16 bits) times float32 row b + j, for j < R; 16 lanes per step, each
    16-column chunk of the weight loaded and widened once for the R rows."""
    @intrinsic
    def fdot(typingctx, w, r, x, b, out):
        if not _c_arrays(w, x, out):
            return None

        def codegen(context, builder, sig, args):
            wa, xa, oa = (_Rows(context, builder, sig.args[i], args[i]) for i in (0, 2, 4))
            r = context.cast(builder, args[1], sig.args[1], types.int64)
            b0 = context.cast(builder, args[3], sig.args[3], types.int64)
            rows = [builder.add(b0, _i64(j)) for j in range(R)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16)) for _ in range(R)]
            with cgutils.for_range(builder, builder.udiv(xa.cols, _i64(16))) as loop:
                col = builder.mul(loop.index, _i64(16))
                wv = _load16(builder, wa, r, col, kind)
                for j in range(R):
                    builder.store(_fmuladd(builder, wv, _load16(builder, xa, rows[j], col, 0),
                                           builder.load(accs[j])), accs[j])
            for j in range(R):
                _store_out(builder, oa, rows[j], r, _hsum(builder, builder.load(accs[j]), 16))
            return context.get_dummy_value()
        return types.void(w, r, x, b, out), codegen
    return _stable(fdot, f"fdot:{kind}:{R}")


@intrinsic
def _prefetch_rows(typingctx, a, r, n):
    """prefetch_rows(a, r, n) -> None: prefetch every 64-byte line of rows r .. r + n - 1 of the C array
    ``a`` for reading, into L2 (hint T1: the lines are read once, a few rows later). A prefetch never
    faults, so rows past the end are harmless."""
    if not _c_arrays(a):
        return None

    def codegen(context, builder, sig, args):
        ra = _Rows(context, builder, sig.args[0], args[0])
        r0 = context.cast(builder, args[1], sig.args[1], types.int64)
        n = context.cast(builder, args[2], sig.args[2], types.int64)
        start = builder.ptrtoint(_addr(builder, ra, r0, _i64(0), I8), I64)
        first = builder.and_(start, _i64(-64))                      # the line the rows start in
        end = builder.add(start, builder.mul(n, ra.row_stride))
        fn = _llvm_fn(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
        lines = builder.udiv(builder.add(builder.sub(end, first), _i64(63)), _i64(64))
        with cgutils.for_range(builder, lines) as loop:
            p = builder.inttoptr(builder.add(first, builder.mul(loop.index, _i64(64))), I8.as_pointer())
            builder.call(fn, [p, ir.Constant(I32, 0), ir.Constant(I32, 2), ir.Constant(I32, 1)])
        return context.get_dummy_value()
    return types.void(a, r, n), codegen


prefetch_rows = _stable(_prefetch_rows, "prefetch_rows:T1")
