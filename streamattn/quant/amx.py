"""Prompt matmuls on the AMX tile unit: the integer sums of :func:`streamattn.quant.kernels.make_qdot`
for 16 activation rows at a time, by ``tdpbsud``, with the same float epilogue, so the same bits.

Where the vector kernel spends 8 ``vpdpbusd`` per block and activation row on the exact integer sum S of
a 32-column block of 16 weight rows, one tile multiply computes S for 16 activation rows at once
(A: 16 rows of int8 activations, signed; B: the block's weight bytes, unsigned, in the four-byte
interleaved layout the packed weights already have; C: 16 x 16 int32 sums). What is left per block
and row is the float epilogue (:func:`~streamattn.quant.kernels.block_epilogue`: a conversion, a
multiply, one or two FMAs). S is an exact integer either way, and every output element then takes the
same float operations in the same order, so AMX and vector kernels give identical bits (batch
invariance holds across them; tests/test_quant_kernels.py).

A kernel call runs in phases over one weight group and 16 rows: the group's blocks are unpacked once
per group into a buffer of step vectors (:func:`tiled` kinds: nibbles at 32 columns a scale), and per
chunk of 16 blocks every block's tile multiply stores its C to a buffer, then the epilogue reads the
sums back, 8 rows at a time (their accumulators stay in registers). Interleaving the tile work with the
epilogue block by block measured slower (docs/PERF.md).

Linux hands out the tile state on request only (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``): without
it the first tile instruction is SIGILL. :data:`AVAILABLE` is whether this CPU has AMX-INT8 and the
request succeeded; the tile configuration is per thread, loaded by the driver before each weight group
and released after it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from streamattn.runtime import cpu_target
from streamattn.runtime.llvm_ir import addr, c_arrays, llvm_fn, Rows
from streamattn.quant.kernels import (WIDE_VNNI, I8, I32, I64, F32, _i64, _load_floats, _splat_int, _stable,
                                      block_epilogue, block_steps, q8_correction,
                                      store_outputs)

ROWS = 16                   # activation rows per tile multiply (the tile's 16 rows)
EPILOGUE_ROWS = 8           # rows per pass of the epilogue: 16 accumulators (32 for kinds with mins) in registers
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18     # linux/arch/x86 (x86_64)


def _request_tiles() -> bool:
    """Ask Linux for the AMX tile data state for this process (all its threads); False where refused."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                            ctypes.c_long(_XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


#: Whether the prompt matmuls can run on AMX here: 16-lane VNNI kernels (the same packed layout), AMX-TILE
#: and AMX-INT8 in what Numba compiles for (streamattn.runtime.cpu_target), and Linux's permission for the tile state.
AVAILABLE = WIDE_VNNI and cpu_target.has("amx-tile") and cpu_target.has("amx-int8") and _request_tiles()
#: Whether models use them by default (``KernelPlan().amx``): where available, unless ``STREAMATTN_AMX=0``.
DEFAULT = AVAILABLE and os.environ.get("STREAMATTN_AMX", "1") != "0"

_P = I8.as_pointer()
str(_P)                     # llvmlite caches a type's str() when first printed: print it now (kernels._stable)


def _tile_fns(builder):
    return (llvm_fn(builder, "llvm.x86.tileloadd64", ir.VoidType(), [I8, _P, I64]),
            llvm_fn(builder, "llvm.x86.tilestored64", ir.VoidType(), [I8, _P, I64]),
            llvm_fn(builder, "llvm.x86.tilezero", ir.VoidType(), [I8]),
            llvm_fn(builder, "llvm.x86.tdpbsud", ir.VoidType(), [I8, I8, I8]))


@functools.cache
def make_config():
    """Intrinsic tiles(on) -> None: ``on`` True loads this thread's tile configuration (palette 1; tiles
    0-2 and 3-5: C [16 rows x 16 int32], A [16 rows x 32 bytes], B [8 rows x 64 bytes]); False releases
    the tile state."""
    shapes = {0: (ROWS, 64), 1: (ROWS, 32), 2: (8, 64)}
    cfg = [0] * 64
    cfg[0] = 1                                            # palette 1; bytes 16-47 colsb (u16), 48-63 rows
    for t in range(6):
        rows, colsb = shapes[t % 3]
        cfg[16 + 2 * t], cfg[17 + 2 * t], cfg[48 + t] = colsb & 255, colsb >> 8, rows

    @intrinsic
    def tiles(typingctx, on):
        def codegen(context, builder, sig, args):
            ty = ir.ArrayType(I8, 64)
            with builder.if_else(context.cast(builder, args[0], sig.args[0], types.boolean)) as (load, release):
                with load:
                    buf = cgutils.alloca_once(builder, ty)
                    builder.store(ir.Constant(ty, cfg), buf)
                    builder.call(llvm_fn(builder, "llvm.x86.ldtilecfg", ir.VoidType(), [_P]),
                                 [builder.bitcast(buf, _P)])
                with release:
                    builder.call(llvm_fn(builder, "llvm.x86.tilerelease", ir.VoidType(), []), [])
            return context.get_dummy_value()
        return types.void(on), codegen
    return _stable(tiles, "amx-config")


def tiled(kind: str, group: int) -> bool:
    """Whether weights of ``kind`` and ``group`` take the tile kernels: the nibble kinds at 32 columns a
    scale ("q4s" has 16). Not "q8": its bytes need no unpacking, so the vector kernel
    is cheaper; nor scales every 16 columns, which double the tile stores (measured: docs/perf/2026-12-04.md)."""
    return kind in ("q4", "q5", "nl") and group == 32


#: Bytes of one block's step vectors in the unpack buffer (8 steps of 16 lanes x four bytes).
STEP_BYTES = 512
#: Blocks per phase of a kernel call: the phase's sums (1 KiB a block) and steps stay in L1 (with all 48
#: blocks of a 1536-column row at once they did not, and the call was slower than the vector kernel).
CHUNK = 16


@functools.cache
def make_unpack(kind: str):
    """Intrinsic unpack(qs, g, wbuf) -> None: wbuf[b] = the step vectors of block b of weight group g
    (:func:`~streamattn.quant.kernels.block_steps`), for every block; wbuf: uint8 [blocks, STEP_BYTES]."""
    G = 16
    VB = ir.VectorType(I8, 4 * G)
    wbytes = (20 if kind == "q5" else 16) * G

    @intrinsic
    def unpack(typingctx, qs, g, wbuf):
        if not c_arrays(qs, wbuf):
            return None

        def codegen(context, builder, sig, args):
            qa, wa = Rows(context, builder, sig.args[0], args[0]), Rows(context, builder, sig.args[2], args[2])
            g0 = context.cast(builder, args[1], sig.args[1], types.int64)
            with cgutils.for_range(builder, builder.udiv(qa.cols, _i64(wbytes))) as loop:
                ws = block_steps(builder, kind, 32, qa, g0, builder.mul(loop.index, _i64(wbytes)), G)
                for s, v in enumerate(ws):
                    builder.store(v, addr(builder, wa, loop.index, _i64(64 * s), VB), align=1)
            return context.get_dummy_value()
        return types.void(qs, g, wbuf), codegen
    return _stable(unpack, f"amx-unpack:{kind}")


@functools.cache
def make_qdot_tiles(kind: str):
    """Intrinsic dot(wbuf, scale, minv, g, xq, xd, xs, xc, m, out, cbuf) -> None: what
    ``make_qdot(kind, 32, 16)`` computes (``out[m + j, 16 g + n]``, j < 16, n < 16; arguments as its),
    the integer sums by tile multiplies, for a :func:`tiled` kind. wbuf: group g's step vectors
    (:func:`make_unpack`), read in place of the packed weight; cbuf: uint8 [CHUNK, 1024] scratch for the
    sums. The thread's tiles must be configured (:func:`make_config`)."""
    G, R = 16, ROWS
    VG, VGI = ir.VectorType(F32, G), ir.VectorType(I32, G)
    mins, biased = kind in ("q4", "q5"), kind == "nl"

    @intrinsic
    def dot(typingctx, wbuf, scale, minv, g, xq, xd, xs, xc, m, out, cbuf):
        if not c_arrays(wbuf, scale, minv, xq, xd, xs, xc, out, cbuf):
            return None
        if any(p.dtype not in (types.float32, types.uint16) for p in (scale, minv)):
            return None

        def codegen(context, builder, sig, args):
            wa, sa, ma, xa, da, ua, ca, oa, cb = (Rows(context, builder, sig.args[i], args[i])
                                                  for i in (0, 1, 2, 4, 5, 6, 7, 9, 10))
            g0 = context.cast(builder, args[3], sig.args[3], types.int64)
            m0 = context.cast(builder, args[8], sig.args[8], types.int64)
            rows = [builder.add(m0, _i64(j)) for j in range(R)]
            tload, tstore, tzero, tdp = _tile_fns(builder)
            nblk = builder.udiv(xa.cols, _i64(32))
            zero = ir.Constant(VG, [0.0] * G)
            accs = [cgutils.alloca_once_value(builder, zero) for _ in range(R)]
            accms = [cgutils.alloca_once_value(builder, zero) for _ in range(R)] if mins else []

            def multiply(b, b0, tset: int):
                """The sums of block b into cbuf[b - b0], on tiles 3 tset .. 3 tset + 2 (C, A, B)."""
                C, A, B = (ir.Constant(I8, 3 * tset + t) for t in range(3))
                builder.call(tload, [B, addr(builder, wa, b, _i64(0), I8), _i64(64)])
                builder.call(tload, [A, addr(builder, xa, rows[0], builder.mul(b, _i64(32)), I8), xa.row_stride])
                builder.call(tzero, [C])
                builder.call(tdp, [C, A, B])
                builder.call(tstore, [C, addr(builder, cb, builder.sub(b, b0), _i64(0), I8), _i64(64)])

            nchunks = builder.udiv(builder.add(nblk, _i64(CHUNK - 1)), _i64(CHUNK))
            with cgutils.for_range(builder, nchunks) as chunk:
                b0 = builder.mul(chunk.index, _i64(CHUNK))
                n = builder.sub(builder.select(builder.icmp_unsigned("<", builder.add(b0, _i64(CHUNK)), nblk),
                                               builder.add(b0, _i64(CHUNK)), nblk), b0)
                with cgutils.for_range(builder, builder.udiv(n, _i64(2))) as pair:     # two tile sets in turn
                    b = builder.add(b0, builder.mul(pair.index, _i64(2)))
                    multiply(b, b0, 0)
                    multiply(builder.add(b, _i64(1)), b0, 1)
                with builder.if_then(builder.trunc(n, ir.IntType(1))):
                    multiply(builder.sub(builder.add(b0, n), _i64(1)), b0, 0)
                for j0 in range(0, R, EPILOGUE_ROWS):        # then the epilogue, 8 rows at a time
                    with cgutils.for_range(builder, n) as loop:
                        b = builder.add(b0, loop.index)
                        sv = _load_floats(builder, sa, g0, builder.mul(b, _i64(G)), G)
                        mv = _load_floats(builder, ma, g0, builder.mul(b, _i64(G)), G) if mins else None
                        for j in range(j0, j0 + EPILOGUE_ROWS):
                            iacc = builder.load(addr(builder, cb, loop.index, _i64(64 * j), VGI), align=1)
                            if biased:                 # S of the biased bytes minus 128 sum(x)
                                iacc = builder.add(iacc, _splat_int(builder, q8_correction(builder, ca, rows[j], b,
                                                                                           32), G))
                            block_epilogue(builder, iacc, sv, mv, da, ua, rows[j], b, 32, accs[j],
                                           accms[j] if mins else None, ca)
            for j in range(R):
                store_outputs(builder, oa, rows[j], g0, accs[j], accms[j] if mins else None)
            return context.get_dummy_value()
        return types.void(wbuf, scale, minv, g, xq, xd, xs, xc, m, out, cbuf), codegen
    return _stable(dot, f"amx-qdot:{kind}")
