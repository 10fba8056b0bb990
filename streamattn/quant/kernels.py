"""LLVM-IR block dot products of :mod:`streamattn.quant.matmul`: a group of weight rows against R
activation rows.

Numba has no vector types, and plain Numba loops over the same blocks did not vectorise (0.3-0.4 G
weights/s, see docs/PERF.md), so the dot products are emitted as IR here, like streamattn/kv/backends/cpu_simd.py (with streamattn/runtime/llvm_ir.py).

A packed weight is stored in groups of :data:`LANES` rows interleaved by four bytes
(:mod:`streamattn.quant.weights`), so each vector lane is one weight row: a block's integer products
are ``group / 4`` byte dot products against four activation bytes broadcast to every lane, its exact
sum scaled by one FMA, and the group's outputs leave as one vector store — no horizontal sums
(:func:`make_qdot` gives the contract). Each block of the group is loaded and unpacked once for R
activation rows (prefill chunks, decode batches).
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from streamattn.runtime import cpu_target
from streamattn.runtime.llvm_ir import addr, c_arrays, fmuladd, llvm_fn, load16, Rows
from streamattn.quant.levels import IQ4_VALUES, Q6K_WORDS

I1, I8, I16, I32, I64, F32 = (ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                              ir.FloatType())
V16I8, V32I8, V16I16, V8I32, V8F, V16F = (ir.VectorType(I8, 16), ir.VectorType(I8, 32), ir.VectorType(I16, 16),
                                          ir.VectorType(I32, 8), ir.VectorType(F32, 8), ir.VectorType(F32, 16))
V64I8, V32I16, V16I32 = ir.VectorType(I8, 64), ir.VectorType(I16, 32), ir.VectorType(I32, 16)
for _t in (I1, I8, I16, I32, I64, F32, V16I8, V32I8, V16I16, V8I32, V8F, V16F, V64I8, V32I16, V16I32):
    str(_t)                                       # cache each str() now: see _stable


#: Whether this CPU has the VNNI byte dot product (AVX-VNNI, or AVX512-VNNI with VL): then a block's four-byte
#: sums are one ``vpdpbusd`` instead of ``vpmaddubsw`` + ``vpmaddwd``, with the same integer results.
VNNI = cpu_target.has("avxvnni") or (cpu_target.has("avx512vnni") and cpu_target.has("avx512vl"))


#: Whether this CPU has AVX-512 F and BW (16-lane kernels: :data:`LANES`).
WIDE = cpu_target.has("avx512bw") and cpu_target.has("avx512f")
WIDE_VNNI = WIDE and cpu_target.has("avx512vnni")


def _i64(n):
    return ir.Constant(I64, n)


def _splat(builder, x, n):
    """<n x float> of the scalar x."""
    ty = ir.VectorType(F32, n)
    v = builder.insert_element(ir.Constant(ty, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(ty, ir.Undefined), ir.Constant(ir.VectorType(I32, n), [0] * n))


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
    return builder.load(addr(builder, rows, r, c, ty), align=1, typ=ty)


def _load_floats(builder, rows, r, c, n: int = 1):
    """rows[r, c:c + n] as float (n = 1) or <n x float>: ``rows`` holds float32, or float16 bits (uint16,
    widened here: exactly, so both storages give the same floats)."""
    if rows.itemsize == 4:
        ty = F32 if n == 1 else ir.VectorType(F32, n)
        return builder.load(addr(builder, rows, r, c, ty), align=4, typ=ty)
    half = ir.HalfType() if n == 1 else ir.VectorType(ir.HalfType(), n)
    bits = builder.load(addr(builder, rows, r, c, I16 if n == 1 else ir.VectorType(I16, n)), align=2)
    return builder.fpext(builder.bitcast(bits, half), F32 if n == 1 else ir.VectorType(F32, n))


def _store_out(builder, oa, row, col, value):
    builder.store(value, addr(builder, oa, row, col, F32), align=4)


def _stable(intr, key: str):
    """Give an intrinsic a fixed identity. Numba pickles an intrinsic with a per-process uuid1; a cached
    function holding it as a closure variable (the drivers of streamattn.quant.matmul) then gets a
    new cache key in every process: it was compiled anew at each start and
    its cache grew a file each time. ``key`` must name everything the code depends on."""
    try:
        intr._set_uuid(f"streamattn.quant.kernels:{key}")
    except (AttributeError, AssertionError):      # numba internals moved: only the cache misses again
        pass
    for v in intr._defn.__closure__ or ():        # llvmlite types cache their str() once printed, which
        if isinstance(v.cell_contents, ir.Type):  # changes their pickle between key lookup and save:
            str(v.cell_contents)                  # print them all now (the module's constants: below)
    return intr


#: Weight rows per interleaved group of a packed weight (:mod:`streamattn.quant.weights`), which is the
#: number of float lanes of the kernels' vectors: 16 with AVX-512 (F and BW), else 8 (AVX2).
LANES = 16 if WIDE else 8
#: Whether this CPU has the byte dot product ``vpdpbusd`` at :data:`LANES` lanes (AVX512-VNNI for 16;
#: AVX-VNNI, or AVX512-VNNI with VL, for 8); otherwise ``vpmaddubsw`` + ``vpmaddwd``, the same integers.
LANES_VNNI = WIDE_VNNI if LANES == 16 else VNNI


def _maddubs(builder, w, x, lanes: int):
    """``vpmaddubsw``: <2 lanes x i16> of adjacent byte products w (unsigned) times x (signed), saturating."""
    vb, vh = ir.VectorType(I8, 4 * lanes), ir.VectorType(I16, 2 * lanes)
    name = "llvm.x86.avx512.pmaddubs.w.512" if lanes == 16 else "llvm.x86.avx2.pmadd.ub.sw"
    return builder.call(llvm_fn(builder, name, vh, [vb, vb]), [builder.bitcast(w, vb), builder.bitcast(x, vb)])


def _pairs_to_i32(builder, p16, lanes: int):
    """``vpmaddwd`` by ones: <lanes x i32> of the sums of adjacent int16 pairs of p16."""
    vi, vh = ir.VectorType(I32, lanes), ir.VectorType(I16, 2 * lanes)
    name = "llvm.x86.avx512.pmaddw.d.512" if lanes == 16 else "llvm.x86.avx2.pmadd.wd"
    return builder.call(llvm_fn(builder, name, vi, [vh, vh]), [p16, ir.Constant(vh, [1] * (2 * lanes))])


#: Byte dot products whose ``vpmaddubsw`` pairs may be summed in int16 before one ``vpmaddwd``, per kind
#: (without VNNI): a pair is at most 2 * 15 * 127 = 3810 for nibbles (0..15) against activations in
#: -127..127, so 8 of them stay under 32767 (30480); 5-bit steps (0..31) make pairs up to 7874, 4 of them
#: 31496; 6-bit ones ("q6k", 0..63) 16002, 2 of them 32004. The biased kinds ("q8", "nl") reach
#: 2 * 128 * 127 in one pair: none.
I16_RUN = {"q4": 8, "q4s": 8, "q5": 4, "q6k": 2}


def _int_dots(builder, acc, pairs, lanes: int, vnni: bool, run: int = 1):
    """acc + the byte dot products of ``pairs`` [(w, x)] (lane i: sum of w[4i + p] * x[4i + p], p < 4; w
    unsigned bytes, x signed, <4 lanes x i8> each; acc <lanes x i32>), exact integers. ``vnni``: one
    ``vpdpbusd`` a pair. Else ``vpmaddubsw`` (saturating pairs into int16; callers keep w <= 128) and
    ``vpmaddwd`` by ones: each run of ``run`` ``vpmaddubsw`` results is added in int16 before one widening,
    so a pair costs ~1.1 instructions where it cost 3 (the caller guarantees no int16 sum of a run passes
    32767: :data:`I16_RUN`)."""
    if vnni:
        vi = ir.VectorType(I32, lanes)
        dp = llvm_fn(builder, f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", vi, [vi, vi, vi])
        for w, x in pairs:
            acc = builder.call(dp, [acc, builder.bitcast(w, vi), builder.bitcast(x, vi)])
        return acc
    for i in range(0, len(pairs), run):
        p16 = None
        for w, x in pairs[i:i + run]:
            p = _maddubs(builder, w, x, lanes)
            p16 = p if p16 is None else builder.add(p16, p)
        acc = builder.add(acc, _pairs_to_i32(builder, p16, lanes))
    return acc


def _apply_sign(builder, x, w, lanes: int):
    """x with w's signs (x where w > 0, -x where w < 0; where w == 0 either, as |w| = 0 multiplies it):
    ``vpsignb`` with 8 lanes (AVX2; AVX-512 has no 64-byte one), else a compare and a select."""
    vb = ir.VectorType(I8, 4 * lanes)
    if lanes == 8:
        return builder.call(llvm_fn(builder, "llvm.x86.avx2.psign.b", vb, [vb, vb]), [x, w])
    return builder.select(builder.icmp_signed("<", w, ir.Constant(vb, [0] * (4 * lanes))),
                          builder.sub(ir.Constant(vb, [0] * (4 * lanes)), x), x)


def _prefetch(builder, ptr):
    """Prefetch the line at ptr for reading (``prefetcht1``: into L2; a page walk if its translation
    is not cached)."""
    fn = llvm_fn(builder, "llvm.prefetch.p0", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    builder.call(fn, [builder.bitcast(ptr, I8.as_pointer()), ir.Constant(I32, 0), ir.Constant(I32, 2),
                      ir.Constant(I32, 1)])


def _qdot_operands(context, builder, sig, args, R: int, arrays=(0, 1, 2, 4, 5, 6, 7, 9)):
    """What every ``qdot`` code generator opens with: a :class:`Rows` of each array argument at ``arrays``
    (of qs, scale, minv, g, xq, xd, xs, xc, m, out), the weight row group g (int64) and the R activation
    rows m .. m + R - 1 (int64)."""
    views = [Rows(context, builder, sig.args[i], args[i]) for i in arrays]
    g0 = context.cast(builder, args[3], sig.args[3], types.int64)
    m0 = context.cast(builder, args[8], sig.args[8], types.int64)
    return views, g0, [builder.add(m0, _i64(j)) for j in range(R)]


def _zero_accumulators(builder, ty, n: int) -> list:
    """n stack slots holding a zero vector of type ``ty``."""
    return [cgutils.alloca_once_value(builder, ir.Constant(ty, [0.0] * ty.count)) for _ in range(n)]


@functools.cache
def make_qdot(kind: str, group: int = 32, R: int = 1, lanes: int = LANES, vnni: bool = LANES_VNNI,
              prefetch: int = 0, touch: int = 0):
    """Intrinsic dot(qs, scale, minv, g, xq, xd, xs, xc, m, out) -> None: ``out[m + j, lanes g + n]`` for
    n < lanes and j < R: weight rows lanes g .. lanes g + lanes - 1 (interleaved group g of a packed
    weight of an integer kind: :mod:`streamattn.quant.weights`) times quantized activation rows
    m .. m + R - 1 (:mod:`streamattn.quant.activations`, row-major).

    One vector lane per weight row. Per block of ``group`` columns (32; 16 for Q6_K, Q2_K, Q3_K) and
    activation row: the exact integer sum S of the block's products, made of ``group / 4`` byte dot products of a
    weight vector (lane n: four consecutive bytes of row n) with four bytes of the activation row
    broadcast to every lane; then ``acc = fma(float(S), scale * xd, acc)`` and, for the kinds with mins
    ("q4", "q5"), ``accm = fma(minv, xs, accm)``; the result is ``acc + accm``, written as one vector.
    "q8" weights are stored as unsigned bytes ``w + 128`` (``vpdpbusd`` multiplies unsigned by signed
    bytes), so S starts from ``xc`` (-128 times the activations' sum over the block); "nl" nibbles are
    looked up (``vpshufb``) as the same biased bytes; "q4" nibbles are unsigned as they are (at group
    16, a 32-column block's low nibbles make one group, its high nibbles the next; "q4s" has those two
    groups' scales and mins as bytes in the block, :func:`q4s_scales`), and "q5" ones with their fifth
    bits OR-ed in (:func:`q5_steps`). Without ``vnni`` the biased bytes are turned back to signed, and
    x takes w's sign (``|w|`` times ``sign(w) x``, as ``vpmaddubsw`` needs); nibble kinds add runs of
    ``vpmaddubsw`` results in int16 before widening them (:data:`I16_RUN`).

    Bit-identity (batch and thread invariance): every output element takes exactly these operations
    in block order whatever R, the lane width or the integer route is (S is an exact integer however
    it is summed), so an activation row gets the same bits alone or in any group, and a weight row
    the same in any group of rows. ``prefetch``: bytes ahead of the weight and scale reads to
    prefetch (the one-row decode kernel reads from memory; 0: none). ``touch`` ("q4k" and "q6k"
    only; 0: none): bytes ahead of each block's weights to prefetch one line of, so that the page
    there is translated and its first line on the way before the reads reach it (the hardware
    prefetcher follows the reads within a 4 KiB page but does not cross into the next one). It must
    stay a prefetch (``llvm.prefetch``), never a load: that address may lie past the buffer's end,
    where a load would fault.
    """
    if kind == "q6k":
        return _make_qdot_q6k(group, R, lanes, vnni, prefetch, touch)
    if kind == "q4k":
        return _make_qdot_q4k(group, R, lanes, vnni, prefetch, touch)
    if touch:
        raise ValueError(f"touch is for the 'q4k' and 'q6k' kinds (got kind {kind!r}, touch={touch})")
    G = lanes
    VG, VGI, VB = ir.VectorType(F32, G), ir.VectorType(I32, G), ir.VectorType(I8, 4 * G)
    nibbles, mins, biased = kind in ("q4", "nl", "q5", "q4s"), kind in ("q4", "q5", "q4s"), kind in ("q8", "nl")
    bcols = 32 if nibbles else group                       # columns of one loaded block
    sub = bcols // group                                   # scale groups per block (nibbles at 16: 2)
    steps = bcols // 4
    wbytes = (20 if kind in ("q5", "q4s") else 16 if nibbles else group) * G    # bytes of a block of G rows
    ahead_blocks = -(-prefetch // wbytes)
    run16 = 1 if vnni else I16_RUN.get(kind, 1)

    @intrinsic
    def qdot(typingctx, qs, scale, minv, g, xq, xd, xs, xc, m, out):
        if not c_arrays(qs, scale, minv, xq, xd, xs, xc, out):
            return None
        if any(p.dtype not in (types.float32, types.uint16) for p in (scale, minv)):
            return None                          # _load_floats reads float32, or float16 bits as uint16

        def codegen(context, builder, sig, args):
            (qa, sa, ma, xa, da, ua, ca, oa), g0, rows = _qdot_operands(context, builder, sig, args, R)
            accs = _zero_accumulators(builder, VG, R)
            accms = _zero_accumulators(builder, VG, R) if mins else []
            nblk = builder.udiv(xa.cols, _i64(bcols))
            with cgutils.for_range(builder, nblk) as loop:
                b = loop.index
                wcol = builder.mul(b, _i64(wbytes))
                if prefetch:
                    for t in range(0, wbytes, 64):
                        _prefetch(builder, addr(builder, qa, g0, builder.add(wcol, _i64(prefetch + t)), I8))
                    ahead = builder.mul(builder.add(b, _i64(ahead_blocks)), _i64(G * sub))
                    planes = () if kind == "q4s" else (sa, ma) if mins else (sa,)    # q4s: 4 B / 256 columns
                    for p in planes:
                        _prefetch(builder, addr(builder, p, g0, ahead, I8))
                signs = None
                ws = block_steps(builder, kind, group, qa, g0, wcol, G)
                if biased and not vnni:                # back to signed w; |w| <= 128 for vpmaddubsw
                    signs = [builder.xor(v, ir.Constant(VB, [-128] * (4 * G))) for v in ws]
                    ws = [builder.call(llvm_fn(builder, f"llvm.abs.v{4 * G}i8", VB, [VB, I1]),
                                       [v, ir.Constant(I1, 0)]) for v in signs]
                if kind == "q4s":
                    sub_scales = q4s_scales(builder, sa, ma, g0, b, _load(builder, qa, g0, builder.add(
                        wcol, _i64(16 * G)), VB))
                for h in range(sub):
                    c = b if sub == 1 else builder.add(builder.mul(b, _i64(sub)), _i64(h))    # scale group
                    if kind == "q4s":
                        sv, mv = sub_scales[h]
                    else:
                        cG = builder.mul(c, _i64(G))
                        sv = _load_floats(builder, sa, g0, cG, G)
                        mv = _load_floats(builder, ma, g0, cG, G) if mins else None
                    for j in range(R):
                        r = rows[j]
                        if biased and vnni:            # S of the biased bytes minus 128 sum(x)
                            iacc = _splat_int(builder, q8_correction(builder, ca, r, c, group), G)
                        else:
                            iacc = ir.Constant(VGI, [0] * G)
                        pairs = []
                        for s in range(h * steps // sub, (h + 1) * steps // sub):
                            xv = builder.bitcast(_splat_int(builder, _load(builder, xa, r, builder.add(
                                builder.mul(b, _i64(bcols)), _i64(4 * s)), I32), G), VB)
                            if signs is not None:
                                xv = _apply_sign(builder, xv, signs[s], G)
                            pairs.append((ws[s], xv))
                        iacc = _int_dots(builder, iacc, pairs, G, vnni, run16)
                        block_epilogue(builder, iacc, sv, mv, da, ua, r, c, group, accs[j],
                                       accms[j] if accms else None, ca)
            for j in range(R):
                store_outputs(builder, oa, rows[j], g0, accs[j], accms[j] if accms else None)
            return context.get_dummy_value()
        return types.void(qs, scale, minv, g, xq, xd, xs, xc, m, out), codegen
    return _stable(qdot, f"qdot:{kind}:{group}:{R}:{G}:{int(vnni)}:{prefetch}:{run16}:psign")


def _make_qdot_q6k(group: int, R: int, lanes: int, vnni: bool, prefetch: int, touch: int):
    """:func:`make_qdot` for the "q6k" kind (Q6_K held in its file's bytes, :mod:`streamattn.quant.weights`).

    The loop takes 128 columns (half a super-block) at a time: per row of the group 26 four-byte vectors,
    16 of the file's low nibbles (``ql``), 8 of its high bit pairs (``qh``), 2 of its int8 sub-block
    scales (in the order :data:`~streamattn.quant.levels.Q6K_WORDS`), and the super-block's float16 ``d``
    from the scale plane. Column 32 q + l of the half (quarter
    q, l < 32) is the nibble of ``ql`` byte l + 32 (q % 2) (low for q < 2, high after) with bits 2q, 2q + 1
    of ``qh`` byte l above it: a step vector (four columns) is one AND or shift of a ``ql`` vector and one
    shift and mask of a ``qh`` vector, OR-ed. The 6-bit values are unsigned (the value + 32), so S starts
    from ``xc / 4`` (-32 times the activations' sum over the 16 columns) and ``vpmaddubsw`` needs no sign
    moved (pairs stay under 16002: :data:`I16_RUN`). Each 16-column group then ends as the "q8" kind's
    at group 16 does: scale ``d * float(sc)`` (the product gguf's dequantizer forms), one FMA by
    ``scale * xd``, groups in column order — the bits of Q6_K held as bytes with its scales multiplied out
    (:func:`streamattn.quant.weights.widen_k`)."""
    if group != 16:
        raise ValueError(f"the q6k kernel takes group 16, Q6_K's sub-blocks (got {group})")
    G = lanes
    VGI, VB = ir.VectorType(I32, G), ir.VectorType(I8, 4 * G)
    words = 26
    wbytes = words * 4 * G                                 # bytes of a 128-column unit of G rows
    ahead_units = -(-prefetch // wbytes)
    run16 = 1 if vnni else I16_RUN["q6k"]

    @intrinsic
    def qdot(typingctx, qs, scale, minv, g, xq, xd, xs, xc, m, out):
        if not c_arrays(qs, scale, minv, xq, xd, xs, xc, out):
            return None
        if scale.dtype not in (types.float32, types.uint16):
            return None

        def codegen(context, builder, sig, args):
            (qa, sa, xa, da, ua, ca, oa), g0, rows = _qdot_operands(context, builder, sig, args, R,
                                                                     arrays=(0, 1, 4, 5, 6, 7, 9))
            accs = _zero_accumulators(builder, ir.VectorType(F32, G), R)
            with cgutils.for_range(builder, builder.udiv(xa.cols, _i64(128))) as loop:
                u = loop.index
                wcol = builder.mul(u, _i64(wbytes))
                if prefetch:
                    for t in range(0, wbytes, 64):
                        _prefetch(builder, addr(builder, qa, g0, builder.add(wcol, _i64(prefetch + t)), I8))
                    ahead = builder.mul(builder.udiv(builder.add(u, _i64(ahead_units)), _i64(2)), _i64(G))
                    _prefetch(builder, addr(builder, sa, g0, ahead, I8))
                if touch:                                  # past the row's end: the next group's bytes
                    _prefetch(builder, addr(builder, qa, g0, builder.add(wcol, _i64(touch)), I8))
                d = _load_floats(builder, sa, g0, builder.mul(builder.udiv(u, _i64(2)), _i64(G)), G)

                def word(at):                              # lane n: row n's four bytes from file byte ``at``
                    v = Q6K_WORDS.index(at)
                    return _load(builder, qa, g0, builder.add(wcol, _i64(4 * G * v)), VB)

                def byte(v):
                    return ir.Constant(VB, [v] * (4 * G))
                for s in range(8):                         # 16-column group s: quarter s // 2, its half s % 2
                    q, half = divmod(s, 2)
                    steps = []
                    for i in range(4 * half, 4 * half + 4):
                        lo = word(32 * (q % 2) + 4 * i)
                        nib = builder.and_(lo, byte(15)) if q < 2 else builder.lshr(lo, byte(4))
                        hb = word(128 + 4 * i)
                        hb = (builder.shl(hb, byte(4 - 2 * q)) if q < 2 else hb if q == 2
                              else builder.lshr(hb, byte(2)))
                        steps.append(builder.or_(nib, builder.and_(hb, byte(0x30))))
                    sw = builder.bitcast(word(192 + 4 * (s // 4)), VGI)  # lane n: row n's scales 4(s//4)..
                    sc = builder.ashr(builder.shl(sw, ir.Constant(VGI, [24 - 8 * (s % 4)] * G)),
                                      ir.Constant(VGI, [24] * G))
                    sv = builder.fmul(d, builder.sitofp(sc, ir.VectorType(F32, G)))
                    c = builder.add(builder.mul(u, _i64(8)), _i64(s))               # the 16-column group
                    for j in range(R):
                        r = rows[j]
                        corr = builder.ashr(_load(builder, ca, r, c, I32), ir.Constant(I32, 2))    # -32 sum(x)
                        pairs = []
                        for t, step in enumerate(steps):
                            col = builder.add(builder.mul(u, _i64(128)), _i64(32 * q + 16 * half + 4 * t))
                            xv = builder.bitcast(_splat_int(builder, _load(builder, xa, r, col, I32), G), VB)
                            pairs.append((step, xv))
                        iacc = _int_dots(builder, _splat_int(builder, corr, G), pairs, G, vnni, run16)
                        block_epilogue(builder, iacc, sv, None, da, ua, r, c, 16, accs[j], None, ca)
            for j in range(R):
                store_outputs(builder, oa, rows[j], g0, accs[j], None)
            return context.get_dummy_value()
        return types.void(qs, scale, minv, g, xq, xd, xs, xc, m, out), codegen
    return _stable(qdot, f"qdot:q6k:{group}:{R}:{G}:{int(vnni)}:{prefetch}:{run16}:{touch}")


def _make_qdot_q4k(group: int, R: int, lanes: int, vnni: bool, prefetch: int, touch: int):
    """:func:`make_qdot` for the "q4k" kind (Q4_K held in its file's bytes, :mod:`streamattn.quant.weights`).

    The loop takes a super-block (256 columns) at a time: per row of the group 35 four-byte vectors, the
    file's 12 bytes of 6-bit sub-block scales and mins (3), then its 128 nibble bytes (32), and the
    super-block's float16 ``d`` and ``-dmin`` from the scale and min planes. The scales and mins are
    unpacked once per super-block on 32-bit lanes (ggml's ``get_scale_min_k4``, four bytes at a time);
    then 4 chunks of 64 columns, each 8 nibble vectors whose low nibbles are sub-block 2c (columns 4t ..
    4t + 3 of it in step t) and high nibbles sub-block 2c + 1. Each 32-column sub-block ends as the "q4"
    kind's does: scale ``d * float(sc)``, min ``-dmin * float(m)`` (the products gguf's dequantizer forms),
    the same FMAs in column order — the bits of Q4_K with its scales multiplied out into planes
    (:func:`streamattn.quant.weights.widen_k`)."""
    if group != 32:
        raise ValueError(f"the q4k kernel takes group 32, Q4_K's sub-blocks (got {group})")
    G = lanes
    VG, VGI, VB = ir.VectorType(F32, G), ir.VectorType(I32, G), ir.VectorType(I8, 4 * G)
    wbytes = 35 * 4 * G                                    # bytes of a super-block of G rows
    ahead_blocks = -(-prefetch // wbytes)
    run16 = 1 if vnni else I16_RUN["q4"]

    @intrinsic
    def qdot(typingctx, qs, scale, minv, g, xq, xd, xs, xc, m, out):
        if not c_arrays(qs, scale, minv, xq, xd, xs, xc, out):
            return None
        if any(p.dtype not in (types.float32, types.uint16) for p in (scale, minv)):
            return None

        def codegen(context, builder, sig, args):
            (qa, sa, ma, xa, da, ua, ca, oa), g0, rows = _qdot_operands(context, builder, sig, args, R)
            accs, accms = _zero_accumulators(builder, VG, R), _zero_accumulators(builder, VG, R)

            def ints(v):
                return ir.Constant(VGI, [v] * G)
            with cgutils.for_range(builder, builder.udiv(xa.cols, _i64(256))) as loop:
                k = loop.index
                wcol = builder.mul(k, _i64(wbytes))
                if prefetch:
                    for t in range(0, wbytes, 64):
                        _prefetch(builder, addr(builder, qa, g0, builder.add(wcol, _i64(prefetch + t)), I8))
                    ahead = builder.mul(builder.add(k, _i64(ahead_blocks)), _i64(G))
                    for p in (sa, ma):
                        _prefetch(builder, addr(builder, p, g0, ahead, I8))
                if touch:                                  # past the row's end: the next group's bytes
                    _prefetch(builder, addr(builder, qa, g0, builder.add(wcol, _i64(touch)), I8))
                kG = builder.mul(k, _i64(G))
                d, dmin = _load_floats(builder, sa, g0, kG, G), _load_floats(builder, ma, g0, kG, G)
                w0, w1, w2 = (builder.bitcast(_load(builder, qa, g0, builder.add(wcol, _i64(4 * G * v)), VB), VGI)
                              for v in range(3))
                low6, nib = ints(0x3F3F3F3F), ints(0x0F0F0F0F)
                top = ints(0x30303030)                       # bits 6-7 of each byte, moved to 4-5
                # lane n: the bytes of row n's sub-blocks 0-3 and 4-7, scales then mins
                sc03, mn03 = builder.and_(w0, low6), builder.and_(w1, low6)
                sc47 = builder.or_(builder.and_(w2, nib), builder.and_(builder.lshr(w0, ints(2)), top))
                mn47 = builder.or_(builder.and_(builder.lshr(w2, ints(4)), nib),
                                   builder.and_(builder.lshr(w1, ints(2)), top))
                with cgutils.for_range(builder, _i64(4)) as inner:
                    c = inner.index                                              # the 64-column chunk
                    first = builder.icmp_unsigned("<", c, _i64(2))
                    shift = builder.trunc(builder.mul(builder.and_(c, _i64(1)), _i64(16)), I32)
                    scw = builder.lshr(builder.select(first, sc03, sc47), _splat_int(builder, shift, G))
                    mnw = builder.lshr(builder.select(first, mn03, mn47), _splat_int(builder, shift, G))
                    ccol = builder.add(wcol, builder.mul(builder.add(builder.mul(c, _i64(8)), _i64(3)),
                                                         _i64(4 * G)))
                    raw = [_load(builder, qa, g0, builder.add(ccol, _i64(4 * G * t)), VB) for t in range(8)]
                    for h in range(2):                                           # sub-block 2c + h
                        steps = [builder.and_(v, ir.Constant(VB, [15] * (4 * G))) if h == 0
                                 else builder.lshr(v, ir.Constant(VB, [4] * (4 * G))) for v in raw]
                        sub = builder.and_(builder.lshr(scw, ints(8 * h)), ints(0xFF))
                        mub = builder.and_(builder.lshr(mnw, ints(8 * h)), ints(0xFF))
                        sv = builder.fmul(d, builder.sitofp(sub, VG))
                        mv = builder.fmul(dmin, builder.sitofp(mub, VG))
                        b = builder.add(builder.mul(k, _i64(8)), builder.add(builder.mul(c, _i64(2)), _i64(h)))
                        for j in range(R):
                            r = rows[j]
                            pairs = []
                            for t, step in enumerate(steps):
                                col = builder.add(builder.mul(b, _i64(32)), _i64(4 * t))
                                xv = builder.bitcast(_splat_int(builder, _load(builder, xa, r, col, I32), G), VB)
                                pairs.append((step, xv))
                            iacc = _int_dots(builder, ir.Constant(VGI, [0] * G), pairs, G, vnni, run16)
                            block_epilogue(builder, iacc, sv, mv, da, ua, r, b, 32, accs[j], accms[j], ca)
            for j in range(R):
                store_outputs(builder, oa, rows[j], g0, accs[j], accms[j])
            return context.get_dummy_value()
        return types.void(qs, scale, minv, g, xq, xd, xs, xc, m, out), codegen
    return _stable(qdot, f"qdot:q4k:{group}:{R}:{G}:{int(vnni)}:{prefetch}:{run16}:{touch}")


def block_steps(builder, kind: str, group: int, qa, g, wcol, G):
    """The step vectors (<4G x i8>, lane n: four consecutive weights of row n, as the unsigned bytes
    ``vpdpbusd`` takes) of the block at byte ``wcol`` of group row g of a packed weight of ``kind``:
    unpacked nibbles (:func:`q4_steps`, looked up for "nl", fifth bits for "q5") or the stored bytes."""
    VB = ir.VectorType(I8, 4 * G)
    if kind in ("q4", "nl", "q5", "q4s"):
        ws = q4_steps(builder, qa, g, wcol, G)
        if kind == "nl":
            return nl_values(builder, ws, G)
        if kind == "q5":
            return q5_steps(builder, ws, _load(builder, qa, g, builder.add(wcol, _i64(16 * G)), VB))
        return ws
    return [_load(builder, qa, g, builder.add(wcol, _i64(4 * G * s)), VB) for s in range(group // 4)]


def q4_steps(builder, qa, g, wcol, G):
    """The 8 step vectors (<4G x i8>, lane n: four weights of row n) of a "q4" block at byte ``wcol``
    of group row g: the low nibbles of its 4 loads (elements 0-15), then the high ones (16-31)."""
    VB = ir.VectorType(I8, 4 * G)
    raw = [_load(builder, qa, g, builder.add(wcol, _i64(4 * G * t)), VB) for t in range(4)]
    return ([builder.and_(v, ir.Constant(VB, [15] * (4 * G))) for v in raw]
            + [builder.lshr(v, ir.Constant(VB, [4] * (4 * G))) for v in raw])


def q4s_scales(builder, sa, ma, g, b, ints):
    """The "q4s" kind's two (scale, min) pairs of block b, each <G x float>: the super-block's float
    ``scale`` and ``minv`` (one per 256 columns, 8 blocks) times the block's int8 sub-block scales and
    mins (``ints``, lane n: row n's bytes scale 0, scale 1, min 0, min 1). The float32 products gguf's
    dequantizer computes, so the same floats as "q4" planes at group 16 holding them."""
    G = ints.type.count // 4
    VI = ir.VectorType(I32, G)
    words = builder.bitcast(ints, VI)
    at = builder.mul(builder.udiv(b, _i64(8)), _i64(G))
    d, dm = _load_floats(builder, sa, g, at, G), _load_floats(builder, ma, g, at, G)

    def byte(j):                                   # byte j of each lane, sign-extended, as float
        v = builder.ashr(builder.shl(words, ir.Constant(VI, [24 - 8 * j] * G)), ir.Constant(VI, [24] * G))
        return builder.sitofp(v, ir.VectorType(F32, G))
    return [(builder.fmul(d, byte(h)), builder.fmul(dm, byte(2 + h))) for h in range(2)]


def q5_steps(builder, ws, bits):
    """The "q5" kind's step vectors: the nibble steps ws (:func:`q4_steps`) with their fifth bits from
    ``bits`` (<4G x i8>, lane n: row n's four bit bytes; byte p, bit t: element 4t + p), moved to bit 4."""
    VB = bits.type
    sixteen = ir.Constant(VB, [16] * VB.count)
    out = []
    for t, v in enumerate(ws):
        if t < 4:
            h = builder.shl(bits, ir.Constant(VB, [4 - t] * VB.count))
        elif t > 4:
            h = builder.lshr(bits, ir.Constant(VB, [t - 4] * VB.count))
        else:
            h = bits
        out.append(builder.or_(v, builder.and_(h, sixteen)))
    return out


def nl_values(builder, ws, G):
    """The "nl" kind's step vectors: nibble indices (:func:`q4_steps`) looked up in IQ4's 16 levels
    (:data:`streamattn.quant.levels.IQ4_VALUES`), as bytes ``value + 128`` like the "q8" kind's;
    ``vpshufb`` looks up within each 16-byte lane, so the table is repeated in every lane."""
    VB = ir.VectorType(I8, 4 * G)
    biased = [((v + 128) & 255) - 256 * (((v + 128) & 255) > 127) for v in IQ4_VALUES]   # as signed i8
    table = ir.Constant(VB, biased * (4 * G // 16))
    name = "llvm.x86.avx512.pshuf.b.512" if G == 16 else "llvm.x86.avx2.pshuf.b"
    fn = llvm_fn(builder, name, VB, [VB, VB])
    return [builder.call(fn, [table, v]) for v in ws]


def q8_correction(builder, ca, r, b, group):
    """i32: -128 times activation row r's sum over block b (``xc`` holds it per 16 columns)."""
    if group == 16:
        return _load(builder, ca, r, b, I32)
    b2 = builder.mul(b, _i64(2))
    return builder.add(_load(builder, ca, r, b2, I32), _load(builder, ca, r, builder.add(b2, _i64(1)), I32))


def block_epilogue(builder, iacc, sv, mv, da, ua, r, b, group, acc, accm, ca=None):
    """One block of activation row r into its accumulators (see :func:`make_qdot`): ``acc = fma(float(S),
    scale * xd, acc)`` (iacc: the exact sums S, <G x i32>; sv: the G rows' scales), and for the kinds with
    mins (mv: theirs) ``accm = fma(minv, xs, accm)``, xs the activations' sum over the block (at 16
    columns: ``float(xc) * (xd * -1/128)`` from ``ca``, the same product rounded once). Every kernel ends
    a block with exactly this."""
    G = iacc.type.count
    VG = ir.VectorType(F32, G)
    fma = llvm_fn(builder, f"llvm.fmuladd.v{G}f32", VG, [VG, VG, VG])
    xdb = b if group == 32 else builder.udiv(b, _i64(32 // group))
    sp = builder.fmul(sv, _splat(builder, _load(builder, da, r, xdb, F32), G))
    builder.store(builder.call(fma, [builder.sitofp(iacc, VG), sp, builder.load(acc)]), acc)
    if mv is not None:
        if group == 32:
            xs = _load(builder, ua, r, b, F32)
        else:                                      # -128 sum(xq) per 16 columns, exact in float32
            xs = builder.fmul(builder.sitofp(_load(builder, ca, r, b, I32), F32),
                              builder.fmul(_load(builder, da, r, xdb, F32), ir.Constant(F32, -1.0 / 128)))
        builder.store(builder.call(fma, [mv, _splat(builder, xs, G), builder.load(accm)]), accm)


def store_outputs(builder, oa, r, g, acc, accm):
    """out[r, G g : G g + G] = acc (+ accm for "q4")."""
    res = builder.load(acc)
    if accm is not None:
        res = builder.fadd(res, builder.load(accm))
    builder.store(res, addr(builder, oa, r, builder.mul(g, _i64(res.type.count)), res.type), align=4)


def _splat_int(builder, x, n):
    """<n x i32> of the scalar i32 x."""
    ty = ir.VectorType(I32, n)
    v = builder.insert_element(ir.Constant(ty, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(ty, ir.Undefined), ir.Constant(ty, [0] * n))


@functools.cache
def make_fdot_rows(kind: int, R: int = 1):
    """Intrinsic dot(w, r, x, b, out) -> None: ``out[b + j, r]`` = row r of float storage (0 float32,
    1 float16 bits, 2 bfloat16 bits) times float32 row b + j, for j < R; 16 lanes per step, each
    16-column chunk of the weight loaded and widened once for the R rows."""
    @intrinsic
    def fdot(typingctx, w, r, x, b, out):
        if not c_arrays(w, x, out):
            return None

        def codegen(context, builder, sig, args):
            wa, xa, oa = (Rows(context, builder, sig.args[i], args[i]) for i in (0, 2, 4))
            r = context.cast(builder, args[1], sig.args[1], types.int64)
            b0 = context.cast(builder, args[3], sig.args[3], types.int64)
            rows = [builder.add(b0, _i64(j)) for j in range(R)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16)) for _ in range(R)]
            with cgutils.for_range(builder, builder.udiv(xa.cols, _i64(16))) as loop:
                col = builder.mul(loop.index, _i64(16))
                wv = load16(builder, wa, r, col, kind)
                for j in range(R):
                    builder.store(fmuladd(builder, wv, load16(builder, xa, rows[j], col, 0),
                                           builder.load(accs[j])), accs[j])
            for j in range(R):
                _store_out(builder, oa, rows[j], r, _hsum(builder, builder.load(accs[j]), 16))
            return context.get_dummy_value()
        return types.void(w, r, x, b, out), codegen
    return _stable(fdot, f"fdot:{kind}:{R}")
