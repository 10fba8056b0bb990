"""LLVM-IR building blocks shared by the compiled kernels (the attention kernels of
streamattn.kv.backends.cpu_simd, the packed-weight kernels of streamattn.quant, the bandwidth probe).

Numba has no SIMD types; the kernels emit LLVM IR over <16 x float> (one AVX-512 register; LLVM splits
the vectors for AVX2 or NEON), and Numba inlines it. Here: the vector and scalar types, intrinsic
declarations, a :class:`Rows` view of a C-contiguous 2-D array inside a code generator, loads of 16 or
32 values that widen float16 / bfloat16 bits or read q8_0 / q4_0 blocks in place (kind 0 float32,
1 float16, 2 bfloat16, 3 q8_0, 4 q4_0), and scalar bit conversions Numba lacks.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

W = 16                      # lanes per vector
F32, I16, I32, I64 = ir.FloatType(), ir.IntType(16), ir.IntType(32), ir.IntType(64)
VF = ir.VectorType(F32, W)  # <16 x float>
I8P = ir.IntType(8).as_pointer()


def const(n: int):
    return ir.Constant(I64, n)


def llvm_fn(builder, name: str, ret, args):
    """The module's declaration of an LLVM intrinsic (declared once per module)."""
    mod = builder.module
    return mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ret, args), name)


def fmuladd(builder, a, b, c):
    """a * b + c, fused where the target has FMA."""
    return builder.call(llvm_fn(builder, "llvm.fmuladd.v16f32", VF, [VF, VF, VF]), [a, b, c])


def splat(builder, x):
    """<16 x float> of the scalar x."""
    v = builder.insert_element(ir.Constant(VF, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(VF, ir.Undefined), ir.Constant(ir.VectorType(I32, W), [0] * W))


class Rows:
    """A 2-D C-contiguous Numba array inside a code generator: its data pointer, row stride and item size.

    The column offset is col * a constant item size, so LLVM folds a row's chunks into displacements of
    one pointer (a runtime inner stride cost a register per chunk and spilled them).
    """

    def __init__(self, context, builder, ty, value):
        ary = context.make_array(ty)(context, builder, value=value)
        self.data = builder.bitcast(ary.data, I8P)
        self.row_stride = cgutils.unpack_tuple(builder, ary.strides)[0]
        self.itemsize = ty.dtype.bitwidth // 8
        self.cols = cgutils.unpack_tuple(builder, ary.shape)[1]


def addr(builder, ary, row, col, elem):
    """&ary[row, col] of a :class:`Rows` as an ``elem``*."""
    off = builder.add(builder.mul(row, ary.row_stride), builder.mul(col, const(ary.itemsize)))
    return builder.bitcast(builder.gep(ary.data, [off], source_etype=ir.IntType(8)), elem.as_pointer())


def load_quantized(builder, ary, row, col, kind: int):
    """Values col .. col + 16 (col a multiple of 16) of a row of q8_0 (kind 3) or q4_0 (kind 4) blocks."""
    nbytes = 34 if kind == 3 else 18
    block = builder.udiv(col, const(32))
    half = builder.urem(builder.udiv(col, const(16)), const(2))               # 0 or 1 within the block
    base = builder.add(builder.mul(row, ary.row_stride), builder.mul(block, const(nbytes)))
    at = lambda off, ty: builder.bitcast(builder.gep(ary.data, [off], source_etype=ir.IntType(8)),  # noqa: E731
                                         ty.as_pointer())
    d = builder.fpext(builder.bitcast(builder.load(at(base, I16), align=1, typ=I16), ir.HalfType()), F32)
    v8 = ir.VectorType(ir.IntType(8), W)
    vi = ir.VectorType(I32, W)
    if kind == 3:
        q = builder.load(at(builder.add(base, builder.add(const(2), builder.mul(half, const(16)))), v8),
                         align=1, typ=v8)
        x = builder.sitofp(q, VF)
    else:
        q = builder.zext(builder.load(at(builder.add(base, const(2)), v8), align=1, typ=v8), vi)
        shift = builder.trunc(builder.mul(half, const(4)), I32)
        nib = builder.and_(builder.lshr(q, splat_int(builder, shift)), ir.Constant(vi, [15] * W))
        x = builder.sitofp(builder.sub(nib, ir.Constant(vi, [8] * W)), VF)
    return builder.fmul(x, splat(builder, d))


def load32(builder, ary, row, col, kind: int):
    """ary[row, col:col + 32] (col a multiple of 32) as two <16 x float>, the same values as two
    :func:`load16` calls; a quantized block is read once (one scale, one 32- or 16-byte load)."""
    if kind < 3:
        return load16(builder, ary, row, col, kind), load16(builder, ary, row, builder.add(col, const(16)), kind)
    nbytes = 34 if kind == 3 else 18
    base = builder.add(builder.mul(row, ary.row_stride), builder.mul(builder.udiv(col, const(32)), const(nbytes)))
    at = lambda off, ty: builder.bitcast(builder.gep(ary.data, [off], source_etype=ir.IntType(8)),  # noqa: E731
                                         ty.as_pointer())
    d = splat(builder, builder.fpext(builder.bitcast(builder.load(at(base, I16), align=1, typ=I16),
                                                      ir.HalfType()), F32))
    vi = ir.VectorType(I32, W)
    if kind == 3:
        v8 = ir.VectorType(ir.IntType(8), 2 * W)
        q = builder.load(at(builder.add(base, const(2)), v8), align=1, typ=v8)
        halves = [builder.shuffle_vector(q, q, ir.Constant(ir.VectorType(I32, W), list(range(h * W, h * W + W))))
                  for h in (0, 1)]
        xs = [builder.sitofp(x, VF) for x in halves]
    else:
        v8 = ir.VectorType(ir.IntType(8), W)
        q = builder.zext(builder.load(at(builder.add(base, const(2)), v8), align=1, typ=v8), vi)
        nibs = [builder.and_(q, ir.Constant(vi, [15] * W)), builder.lshr(q, ir.Constant(vi, [4] * W))]
        xs = [builder.sitofp(builder.sub(x, ir.Constant(vi, [8] * W)), VF) for x in nibs]
    return builder.fmul(xs[0], d), builder.fmul(xs[1], d)


def splat_int(builder, x):
    """<16 x i32> of the scalar i32 x."""
    vi = ir.VectorType(I32, W)
    v = builder.insert_element(ir.Constant(vi, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vi, ir.Undefined), ir.Constant(vi, [0] * W))


def load16(builder, ary, row, col, kind: int):
    """ary[row, col:col + 16] as <16 x float>, widening float16 (kind 1) or bfloat16 (kind 2) bits, or
    reading q8_0 (3) / q4_0 (4) blocks in place."""
    if kind >= 3:
        return load_quantized(builder, ary, row, col, kind)
    if kind == 0:
        return builder.load(addr(builder, ary, row, col, VF), align=4, typ=VF)
    vi = ir.VectorType(I16, W)
    bits = builder.load(addr(builder, ary, row, col, vi), align=2, typ=vi)
    if kind == 1:                                   # fpext: vcvtph2ps on x86
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), W)), VF)
    wide = builder.zext(bits, ir.VectorType(I32, W))  # bfloat16: the top half of a float32
    return builder.bitcast(builder.shl(wide, ir.Constant(ir.VectorType(I32, W), [16] * W)), VF)


def c_arrays(*tys) -> bool:
    """Typing guard: the kernels load runs of consecutive elements, so every array must be C-contiguous."""
    return all(isinstance(t, types.Array) and t.layout == "C" for t in tys)


@intrinsic
def bf16_to_f32(typingctx, bits):
    """bfloat16 bits (uint16) -> float32: the top half of a float32's bits."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], I32), ir.Constant(I32, 16))
        return builder.bitcast(wide, F32)
    return types.float32(types.uint16), codegen


@intrinsic
def pow2(typingctx, k):
    """2.0 ** k as float32 for an int32 k in [-127, 127]: k + 127 written into the exponent bits
    (k = -127 gives the bits of +0.0)."""
    if k != types.int32:
        return None

    def codegen(context, builder, signature, args):
        e = builder.shl(builder.add(args[0], ir.Constant(I32, 127)), ir.Constant(I32, 23))
        return builder.bitcast(e, F32)
    return types.float32(types.int32), codegen
