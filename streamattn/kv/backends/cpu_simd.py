"""LLVM-IR building blocks of the CPU backend: 16-lane vector micro-kernels as Numba intrinsics.

Numba has no SIMD types, and what LLVM makes of plain loops left the GQA tile far from the hardware:
each score was its own horizontal sum, each weighted V row a load and store of the accumulator, and a
float max reduction did not vectorise at all. Here the code generators emit LLVM IR over <16 x float>
(one AVX-512 register; LLVM splits the vectors for AVX2 or NEON), and Numba inlines them into the kernel.

- ``QK[R]``: scores of R query rows against ``QK_KEYS[R]`` keys (as many as the host's registers
  hold). The R * keys dot products accumulate lane-wise over head_dim, one vector each, and are then
  summed together by a transpose-reduction: 15 shuffle pairs and adds for all 16, where 16 separate
  horizontal sums take ~4x the instructions.
- ``PV[R]``: R accumulator rows += p · V over a tile of keys; R × ``PV_GROUPS[R]`` vectors stay in
  registers for the whole tile (the loop over keys is inside), instead of a load and store of acc per key; fewer
  than 8 FMA chains get a second set for odd keys.
- ``row_max``: a vector max over a score row, four running vectors (llvm.maxnum; NaN operands are
  skipped, not propagated: a NaN score still makes its exp, and the output, NaN).
- The shared pieces (vector types, :class:`~streamattn.runtime.llvm_ir.Rows`, the widening loads of
  every storage kind, ``bf16_to_f32``, ``pow2``) are in streamattn.runtime.llvm_ir.

kind: 0 float32 storage, 1 float16 bits, 2 bfloat16 bits (uint16), 3 q8_0 and 4 q4_0 blocks (uint8 rows,
streamattn.kv.storage); 16-bit rows are widened as loaded, quantized ones read in place: a chunk of 16
values is one 16-byte load (q8_0) or half of one block's nibbles (q4_0), widened to <16 x float> in
registers and multiplied by the block's float16 scale (exact: an int8 times a float16 fits a float32).
Every vector kernel needs head_dim % 16 == 0; the backend keeps a plain-Numba path for other sizes.

Four-row kernels, and kernels of any row count over 16-bit or quantized storage, prefetch every line
they load PREFETCH_BYTES ahead (hint T0): from memory the hardware prefetcher alone left the GQA group
waiting on misses, q8_0 / q4_0 rows of 68 / 36 bytes most. Measured variants, kept and dropped, with
dates: docs/perf/ (the prefetch: 2026-11-30, 2026-12-04).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...runtime import cpu_target
from ...runtime.llvm_ir import (F32, I8P, I32, VF, W, Rows, addr, c_arrays, const, fmuladd, llvm_fn, load16,
                                 load32, splat)

PREFETCH_BYTES = 8192       # how far ahead of each load to prefetch, hint T0 (32 rows of float32 K at head_dim 64)
PREFETCH_MIN_ROWS = 4       # float32 kernels of fewer query rows do not prefetch (see the module docstring)


def _prefetches(R: int, kind: int) -> bool:
    """Whether the kernel of R query rows over ``kind`` storage issues software prefetches."""
    return R >= PREFETCH_MIN_ROWS or kind != 0


def prefetch_line(builder, ary, row, col):
    """Prefetch the line PREFETCH_BYTES past &ary[row, col] for reading, hint T0; never faults, even
    past the array's end. The rows are contiguous (C arrays), so that is the same column some rows on,
    however wide a row is, and ``col`` may run past the row's end into the rows after it. ``col`` is a
    multiple of 16: for 16-bit storage two chunks share a 64-byte line, so only chunks that start a line
    prefetch."""
    fn = llvm_fn(builder, "llvm.prefetch.p0", ir.VoidType(), [I8P, I32, I32, I32])
    starts_line = builder.icmp_unsigned("==", builder.urem(builder.mul(col, const(ary.itemsize)), const(64)),
                                        const(0))   # always true for float32 (LLVM folds the test away)
    with builder.if_then(starts_line):
        here = addr(builder, ary, row, col, ir.IntType(8))
        builder.call(fn, [builder.gep(here, [const(PREFETCH_BYTES)], source_etype=ir.IntType(8)),
                          ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def _transpose_sum(builder, vecs):
    """n <= 16 vectors of 16 lanes -> one vector whose lanes hold their n full sums (m lanes: n rounded up
    to a power of two, the missing vectors zeros), and lane_of[i]: the lane of vector i's sum.

    With fewer than 16 vectors each is first halved in place (lanes i and i + s/2 added) until it has m
    lanes. Then each round pairs vectors whose lanes form groups of s lanes per partial sum; per group,
    the two halves of each vector's partial are added, giving groups of s/2 lanes that hold twice as many
    sums: s = 16 -> 8 -> 4 -> 2 -> 1 (8 + 4 + 2 + 1 = 15 pair steps, each two shuffles and an add). Either
    way every sum is the same tree over its vector's lanes (i + s/2 onto i, s = 16, 8, 4, 2), so a dot
    product's bits do not depend on how many share the reduction.
    """
    m = 1
    while m < len(vecs):
        m *= 2
    vecs = vecs + [ir.Constant(vecs[0].type, [0.0] * W)] * (m - len(vecs))
    lanes = W
    while lanes > m:                                 # halve each vector in place
        h = lanes // 2
        vecs = [builder.fadd(builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, h), list(range(h)))),
                             builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, h), list(range(h, lanes)))))
                for v in vecs]
        lanes = h
    owners = [[i] for i in range(len(vecs))]        # per vector: whose partial sum each lane group is
    s = lanes
    while len(vecs) > 1:
        h = s // 2
        lo, hi = [], []
        for g in range(lanes // s):                  # lane indices of x are 0..lanes-1, of y lanes..
            lo += [g * s + i for i in range(h)] + [lanes + g * s + i for i in range(h)]
            hi += [g * s + h + i for i in range(h)] + [lanes + g * s + h + i for i in range(h)]
        lo, hi = (ir.Constant(ir.VectorType(I32, lanes), m) for m in (lo, hi))
        nxt, nown = [], []
        for a in range(0, len(vecs), 2):
            x, y = vecs[a], vecs[a + 1]
            nxt.append(builder.fadd(builder.shuffle_vector(x, y, lo), builder.shuffle_vector(x, y, hi)))
            nown.append([o for pair in zip(owners[a], owners[a + 1]) for o in pair])
        vecs, owners, s = nxt, nown, h
    order = owners[0]
    return vecs[0], [order.index(i) for i in range(len(order))]


def _by_storage(builder, storage_ty, kind, emit):
    """Emit the kernel body for the storage: float32 arrays once (kind 0); uint16 arrays twice, for
    float16 (kind == 1 at run time) and bfloat16 (otherwise), behind one branch; uint8 arrays twice, for
    q8_0 (kind == 3) and q4_0 (otherwise)."""
    if storage_ty.dtype == types.float32:
        emit(0)
        return
    first, second = (3, 4) if storage_ty.dtype == types.uint8 else (1, 2)
    with builder.if_else(builder.icmp_signed("==", kind, ir.Constant(kind.type, first))) as (a, b):
        with a:
            emit(first)
        with b:
            emit(second)


def _kernel(body, arrays, storage):
    """A Numba intrinsic f(a0, .., a4, kind) -> None whose code is ``body(context, builder, sig, args,
    kind)``, emitted per storage kind by :func:`_by_storage`. ``arrays``: argument indices that must be
    C arrays; ``storage``: the index of the K or V array."""
    @intrinsic
    def kernel(typingctx, a0, a1, a2, a3, a4, kind):
        args = (a0, a1, a2, a3, a4, kind)
        if not c_arrays(*(args[i] for i in arrays)):
            return None

        def codegen(context, builder, sig, values):
            _by_storage(builder, sig.args[storage], values[-1],
                        lambda kind: body(context, builder, sig, values, kind))
            return context.get_dummy_value()
        return types.void(*args), codegen
    return kernel


_AVX512 = cpu_target.has("avx512f")            # what Numba compiles for (NUMBA_CPU_FEATURES), not the host

#: Keys per call of ``QK[R]``: R * keys dot products of 16 lanes, summed by one transpose. With 32 vector
#: registers (AVX-512) 16 sums fit: 16 // R keys (three rows: 4, the transpose padded with zeros). AVX2
#: has 16 registers of 8 lanes, and a <16 x float> sum takes two: 16 sums spilled, so there R * keys stays
#: at 4 or under (measured on Zen 3: docs/perf/2026-12-03.md). The sums are the same bits either way
#: (:func:`_transpose_sum`).
QK_KEYS = {1: 16, 2: 8, 3: 4, 4: 4} if _AVX512 else {1: 4, 2: 4, 3: 1, 4: 1}

#: Vectors of 16 columns per pass of ``PV[R]`` over a tile's keys (then single vectors for the rest), by
#: storage: (float kinds, quantized kinds). Each pass holds R * groups * 2 accumulators in registers
#: (:func:`_make_pv`); AVX2's 16 registers hold 6 <16 x float> with room for V and p, so there float
#: storage takes one vector per pass from two rows up. Quantized rows keep two or four: a block of 32 is
#: read by one load (a single vector per pass reads each half block on its own and ran slower; measured:
#: docs/perf/2026-12-03.md). Per element the sums are the same either
#: way (every column's chain runs over the keys in one order), so the bits do not change.
PV_GROUPS = ({1: (4, 4), 2: (4, 4), 3: (2, 2), 4: (2, 2)} if _AVX512 else
             {1: (4, 2), 2: (1, 4), 3: (1, 2), 4: (1, 2)})


def _make_qk(R: int):
    """Intrinsic qk(qf, r0, kt, j, sc, kind): sc[r0 + g, j + t] = qf[r0 + g] . kt[j + t] for g < R,
    t < QK_KEYS[R].

    qf: [rows, D] float32, kt: [n, D] storage (float32, or uint16 bits of ``kind`` 1/2, or [n, row bytes]
    uint8 blocks of kind 3/4), sc: [rows, >= j + QK_KEYS[R]] float32, D % 16 == 0.
    """
    KB = QK_KEYS[R]                                 # keys per call

    def body(context, builder, sig, args, kind):
        qa, ka, sa = (Rows(context, builder, sig.args[i], args[i]) for i in (0, 2, 4))
        r0v, jv = args[1], args[3]
        D = qa.cols                                 # (a quantized kt's rows are bytes, not values)
        zero = ir.Constant(VF, [0.0] * W)
        accs = [cgutils.alloca_once(builder, VF) for _ in range(R * KB)]  # dot g*KB+t, lane-wise
        for a in accs:
            builder.store(zero, a)
        rows = [builder.add(r0v, const(g)) for g in range(R)]
        keys = [builder.add(jv, const(t)) for t in range(KB)]

        def chunks(chunk0, n, load):
            """Chunks chunk0 .. chunk0 + n - 1 of 16 columns: ``load(key row, col)`` gives their n vectors
            of a key; FMAs go in column order into each dot product's lanes, whatever n is."""
            col = builder.mul(chunk0, const(W))
            qs = [[load16(builder, qa, rows[g], builder.add(col, const(W * c)), 0) for g in range(R)]
                  for c in range(n)]
            for t in range(KB):
                if _prefetches(R, kind):
                    # the lines of the KB contiguous rows in memory order (chunk t of "row" jv, KB chunks
                    # per step), not in the order the loads take them (row t's chunk at col)
                    for c in range(n):
                        prefetch_line(builder, ka, jv, builder.mul(builder.add(builder.mul(
                            builder.add(chunk0, const(c)), const(KB)), const(t)), const(W)))
                kvs = load(keys[t], col)
                for c in range(n):
                    for g in range(R):
                        a = accs[g * KB + t]
                        builder.store(fmuladd(builder, qs[c][g], kvs[c], builder.load(a)), a)
        if kind < 3:
            with cgutils.for_range(builder, builder.udiv(D, const(W))) as loop:
                chunks(loop.index, 1, lambda key, col: [load16(builder, ka, key, col, kind)])
        else:                           # quantized: a block (two chunks) per load, then a half block
            with cgutils.for_range(builder, builder.udiv(D, const(2 * W))) as loop:
                chunks(builder.mul(loop.index, const(2)), 2, lambda key, col: load32(builder, ka, key, col, kind))
            with builder.if_then(builder.icmp_unsigned("!=", builder.urem(D, const(2 * W)), const(0))):
                chunks(builder.sub(builder.udiv(D, const(W)), const(1)), 1,
                       lambda key, col: [load16(builder, ka, key, col, kind)])
        total, lane_of = _transpose_sum(builder, [builder.load(a) for a in accs])
        for g in range(R):                      # this row's KB sums, in key order, as one store
            pick = ir.Constant(ir.VectorType(I32, KB), [lane_of[g * KB + t] for t in range(KB)])
            part = builder.shuffle_vector(total, ir.Constant(total.type, ir.Undefined), pick)
            builder.store(part, addr(builder, sa, rows[g], jv, ir.VectorType(F32, KB)), align=4)
    return _kernel(body, arrays=(0, 2, 4), storage=2)        # qk(qf, r0, kt, j, sc, kind)


def _make_pv(R: int):
    """Intrinsic pv(acc, r0, p, vt, n, kind): acc[r0 + g] += sum_{j < n} p[r0 + g, j] * vt[j] for g < R.

    acc: [rows, D] float32, p: [rows, >= n] float32, vt: [>= n, D] storage (quantized: [>= n, row bytes]),
    D % 16 == 0. Columns go in
    groups of CG vectors (:data:`PV_GROUPS`; then single vectors for the rest), each group one pass
    over the n keys with its accumulators in registers. Even and odd keys go to two accumulator sets,
    added at the end: more FMA chains in flight, and one summation order
    for every R, so a row's sum does not depend on how many rows the call has (batch invariance):
    (acc + even keys in order) + (odd keys in order).
    """
    U = 2                                             # accumulator sets: keys j with j % U == u
    groups = PV_GROUPS[R]                             # vectors per column group (float, quantized storage)

    def body(context, builder, sig, args, kind):
        G4 = groups[kind >= 3]
        aa, pa, va = (Rows(context, builder, sig.args[i], args[i]) for i in (0, 2, 3))
        r0v, nv = args[1], args[4]
        D = aa.cols
        rows = [builder.add(r0v, const(g)) for g in range(R)]
        wide_end = builder.mul(builder.udiv(D, const(G4 * W)), const(G4 * W))
        for CG, start, count in ((G4, const(0), builder.udiv(D, const(G4 * W))),
                                 (1, wide_end, builder.udiv(builder.sub(D, wide_end), const(W)))):
            accs = [[cgutils.alloca_once(builder, VF) for _ in range(R * CG)] for _ in range(U)]

            def add_key(key, cols, acc_set):
                if _prefetches(R, kind):
                    for c in range(CG):
                        prefetch_line(builder, va, key, cols[c])
                if kind >= 3 and CG % 2 == 0:      # quantized: one load per block (cols[0] starts one)
                    xs = [x for c in range(0, CG, 2) for x in load32(builder, va, key, cols[c], kind)]
                else:
                    xs = [load16(builder, va, key, cols[c], kind) for c in range(CG)]
                for g in range(R):
                    w = splat(builder, builder.load(addr(builder, pa, rows[g], key, F32), typ=F32))
                    for c in range(CG):
                        a = acc_set[g * CG + c]
                        builder.store(fmuladd(builder, w, xs[c], builder.load(a)), a)

            with cgutils.for_range(builder, count) as group:
                c0 = builder.add(start, builder.mul(group.index, const(CG * W)))
                cols = [builder.add(c0, const(W * c)) for c in range(CG)]
                for g in range(R):
                    for c in range(CG):
                        builder.store(load16(builder, aa, rows[g], cols[c], 0), accs[0][g * CG + c])
                        for u in range(1, U):
                            builder.store(ir.Constant(VF, [0.0] * W), accs[u][g * CG + c])
                with cgutils.for_range(builder, builder.udiv(nv, const(U))) as step:
                    for u in range(U):
                        add_key(builder.add(builder.mul(step.index, const(U)), const(u)), cols, accs[u])
                if U == 2:                          # an odd last key
                    with builder.if_then(builder.trunc(nv, ir.IntType(1))):
                        add_key(builder.sub(nv, const(1)), cols, accs[0])
                for g in range(R):
                    for c in range(CG):
                        total = builder.load(accs[0][g * CG + c])
                        for u in range(1, U):
                            total = builder.fadd(total, builder.load(accs[u][g * CG + c]))
                        builder.store(total, addr(builder, aa, rows[g], cols[c], VF), align=4)
    return _kernel(body, arrays=(0, 2, 3), storage=3)        # pv(acc, r0, p, vt, n, kind)


QK = {R: _make_qk(R) for R in (1, 2, 3, 4)}
PV = {R: _make_pv(R) for R in (1, 2, 3, 4)}


@intrinsic
def row_max(typingctx, x, n, init):
    """max(init, x[0], ..., x[n - 1]) of a contiguous 1-D float32 array, 16 lanes at a time, then a tail."""
    if not (c_arrays(x) and x.ndim == 1 and x.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        xa = context.make_array(sig.args[0])(context, builder, value=args[0])
        nv, init = args[1], args[2]
        vmax = llvm_fn(builder, "llvm.maxnum.v16f32", VF, [VF, VF])
        smax = llvm_fn(builder, "llvm.maxnum.f32", F32, [F32, F32])
        vred = llvm_fn(builder, "llvm.vector.reduce.fmax.v16f32", F32, [VF])
        stride = cgutils.unpack_tuple(builder, xa.strides)[0]
        base = builder.bitcast(xa.data, I8P)

        def at(i, ty):
            return builder.bitcast(builder.gep(base, [builder.mul(i, stride)], source_etype=ir.IntType(8)),
                                   ty.as_pointer())
        # four vectors of running maxima, 64 floats per step: one chain of maxnum was latency-bound
        accs = [cgutils.alloca_once_value(builder, splat(builder, init)) for _ in range(4)]
        quads = builder.udiv(nv, const(4 * W))          # steps of four vectors
        with cgutils.for_range(builder, quads) as loop:
            for a, acc in enumerate(accs):
                i = builder.add(builder.mul(loop.index, const(4 * W)), const(a * W))
                v = builder.load(at(i, VF), align=4, typ=VF)
                builder.store(builder.call(vmax, [builder.load(acc), v]), acc)
        blocks = builder.udiv(nv, const(W))              # whole vectors; the last blocks % 4 one at a time
        done = builder.mul(quads, const(4))
        with cgutils.for_range(builder, builder.sub(blocks, done)) as loop:
            v = builder.load(at(builder.mul(builder.add(done, loop.index), const(W)), VF), align=4, typ=VF)
            builder.store(builder.call(vmax, [builder.load(accs[0]), v]), accs[0])
        acc = accs[0]
        m01 = builder.call(vmax, [builder.load(accs[0]), builder.load(accs[1])])
        m23 = builder.call(vmax, [builder.load(accs[2]), builder.load(accs[3])])
        builder.store(builder.call(vmax, [m01, m23]), acc)
        best = cgutils.alloca_once_value(builder, builder.call(vred, [builder.load(acc)]))
        tail = builder.mul(blocks, const(W))
        with cgutils.for_range(builder, builder.sub(nv, tail)) as loop:
            v = builder.load(at(builder.add(tail, loop.index), F32), typ=F32)
            builder.store(builder.call(smax, [builder.load(best), v]), best)
        return builder.load(best)
    return types.float32(x, n, init), codegen

