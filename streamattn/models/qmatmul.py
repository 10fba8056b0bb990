"""``x @ W.T`` on packed GGUF weights (:mod:`streamattn.models.quant`): LLVM-IR block dot products in Numba.

Route (ggml's): each activation row is quantized once per matmul to int8 per 32 columns (scale ``xd``
and ``xs = xd * sum(q)``, llama.cpp's Q8_1), then every 32-block of a weight row is one integer dot
product — ``vpmaddubsw`` (unsigned x signed bytes -> int16 pairs) and ``vpmaddwd`` (-> int32 quads) —
turned to float and added lane-wise with one FMA by ``scale * xd``. A "q4" block's min term is one
multiply per block, ``minv * xs``. Signed int8 weights ("q8") go through ggml's sign trick:
``|w|`` times ``x`` carrying w's sign. Float kinds (F32/F16/BF16) take float32 activations as they are
and a 16-lane FMA per chunk.

Numba has no vector types, and plain Numba loops over the same blocks did not vectorise (0.3-0.4 G
weights/s, see docs/PERF.md), so the per-row dot is emitted as IR here, like streamattn/backends/cpu_simd.

Batch invariance: an output element ``out[b, r]`` is always the same function of row ``r`` and
activation row ``b`` alone — the blocks in column order into 8 float lanes, then a fixed tree of lane
sums. Threads split rows, never a reduction, so a sequence's logits are bit-identical alone or in any
batch, with any thread count. Weight rows are the outer loop: a row is read from memory once and stays
in L1 for every activation row of the call (prefill chunks and decode batches).

The integer instructions are x86 AVX2 (also present on every AVX-512 CPU); :data:`HAVE_KERNELS` says
whether this CPU has them, and ``load_gguf(path, weights="f32")`` is the path for others.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from streamattn.backends.cpu_simd import _addr, _c_arrays, _fmuladd, _llvm_fn, _load16, _Rows
from streamattn.models.quant import QWeight

I1, I8, I16, I32, I64, F32 = (ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                              ir.FloatType())
V16I8, V32I8, V16I16, V8I32, V8F, V16F = (ir.VectorType(I8, 16), ir.VectorType(I8, 32), ir.VectorType(I16, 16),
                                          ir.VectorType(I32, 8), ir.VectorType(F32, 8), ir.VectorType(F32, 16))


def _host_has_avx2() -> bool:
    import llvmlite.binding as llvm
    return "+avx2" in llvm.get_host_cpu_features().flatten().split(",")


HAVE_KERNELS = _host_has_avx2()


def _i64(n):
    return ir.Constant(I64, n)


def _isum(builder, w32, x32, signed: bool):
    """<8 x i32>: lane i = sum of w[j] * x[j] over j in 4i..4i+3 (w, x: <32 x i8>; w unsigned unless
    ``signed``)."""
    if signed:                                  # |w| * (x with w's sign): same products, w now unsigned
        x32 = builder.call(_llvm_fn(builder, "llvm.x86.avx2.psign.b", V32I8, [V32I8, V32I8]), [x32, w32])
        w32 = builder.call(_llvm_fn(builder, "llvm.abs.v32i8", V32I8, [V32I8, I1]), [w32, ir.Constant(I1, 0)])
    p16 = builder.call(_llvm_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [V32I8, V32I8]), [w32, x32])
    ones = ir.Constant(V16I16, [1] * 16)
    return builder.call(_llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16]), [p16, ones])


def _splat8(builder, x):
    v = builder.insert_element(ir.Constant(V8F, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(V8F, ir.Undefined), ir.Constant(ir.VectorType(I32, 8), [0] * 8))


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


def _fma_scalar(builder, a, b, c):
    return builder.call(_llvm_fn(builder, "llvm.fmuladd.f32", F32, [F32, F32, F32]), [a, b, c])


def _make_qdot(kind: str, group: int = 32):
    """Intrinsic dot(qs, scale, minv, r, xq, xd, xs, b) -> float32: row r of a packed weight ("q4" or
    "q8" planes; ``minv`` is ignored for "q8") times quantized activation row b."""
    @intrinsic
    def qdot(typingctx, qs, scale, minv, r, xq, xd, xs, b):
        if not _c_arrays(qs, scale, minv, xq, xd, xs):
            return None

        def codegen(context, builder, sig, args):
            qa, sa, ma, xa, da, ua = (_Rows(context, builder, sig.args[i], args[i]) for i in (0, 1, 2, 4, 5, 6))
            r = context.cast(builder, args[3], sig.args[3], types.int64)
            b = context.cast(builder, args[7], sig.args[7], types.int64)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(2)]
            accms = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(2)]

            def block(i, acc, accm):
                x32 = _load(builder, xa, b, builder.mul(i, _i64(32)), V32I8)
                xd = _load(builder, da, b, i, F32)
                if kind == "q4":
                    raw = _load(builder, qa, r, builder.mul(i, _i64(16)), V16I8)
                    lo = builder.and_(raw, ir.Constant(V16I8, [15] * 16))
                    hi = builder.lshr(raw, ir.Constant(V16I8, [4] * 16))
                    w32 = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 32), list(range(32))))
                    isum = _isum(builder, w32, x32, signed=False)
                    mterm = _fma_scalar(builder, _load(builder, ma, r, i, F32), _load(builder, ua, b, i, F32),
                                        builder.load(accm))
                    builder.store(mterm, accm)
                else:
                    w32 = _load(builder, qa, r, builder.mul(i, _i64(32)), V32I8)
                    isum = _isum(builder, w32, x32, signed=True)
                if group == 32:
                    sv = _splat8(builder, builder.fmul(_load(builder, sa, r, i, F32), xd))
                else:                                   # two scales per 32-block: lanes 0-3, 4-7
                    s0 = builder.fmul(_load(builder, sa, r, builder.mul(i, _i64(2)), F32), xd)
                    s1 = builder.fmul(_load(builder, sa, r, builder.add(builder.mul(i, _i64(2)), _i64(1)), F32),
                                      xd)
                    sv = builder.shuffle_vector(_splat8(builder, s0), _splat8(builder, s1),
                                                ir.Constant(ir.VectorType(I32, 8), [0, 0, 0, 0, 8, 8, 8, 8]))
                f = builder.sitofp(isum, V8F)
                builder.store(builder.call(_llvm_fn(builder, "llvm.fmuladd.v8f32", V8F, [V8F, V8F, V8F]),
                                           [f, sv, builder.load(acc)]), acc)

            nblk = builder.udiv(xa.cols, _i64(32))
            # two independent chains (even and odd blocks), so FMA latency does not bound the loop
            with cgutils.for_range(builder, builder.udiv(nblk, _i64(2))) as loop:
                i = builder.mul(loop.index, _i64(2))
                block(i, accs[0], accms[0])
                block(builder.add(i, _i64(1)), accs[1], accms[1])
            with builder.if_then(builder.icmp_unsigned("!=", builder.urem(nblk, _i64(2)), _i64(0))):
                block(builder.sub(nblk, _i64(1)), accs[0], accms[0])
            vec = builder.fadd(builder.load(accs[0]), builder.load(accs[1]))
            return builder.fadd(_hsum(builder, vec, 8), builder.fadd(builder.load(accms[0]), builder.load(accms[1])))
        return types.float32(qs, scale, minv, r, xq, xd, xs, b), codegen
    return qdot


def _make_fdot(kind: int):
    """Intrinsic dot(w, r, x, b) -> float32: row r of float storage (0 float32, 1 float16 bits,
    2 bfloat16 bits) times float32 row b, 16 lanes per step."""
    @intrinsic
    def fdot(typingctx, w, r, x, b):
        if not _c_arrays(w, x):
            return None

        def codegen(context, builder, sig, args):
            wa, xa = _Rows(context, builder, sig.args[0], args[0]), _Rows(context, builder, sig.args[2], args[2])
            r = context.cast(builder, args[1], sig.args[1], types.int64)
            b = context.cast(builder, args[3], sig.args[3], types.int64)
            acc = cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16))
            with cgutils.for_range(builder, builder.udiv(xa.cols, _i64(16))) as loop:
                col = builder.mul(loop.index, _i64(16))
                builder.store(_fmuladd(builder, _load16(builder, wa, r, col, kind), _load16(builder, xa, b, col, 0),
                                       builder.load(acc)), acc)
            return _hsum(builder, builder.load(acc), 16)
        return types.float32(w, r, x, b), codegen
    return fdot


_q4dot, _q8dot32, _q8dot16 = _make_qdot("q4"), _make_qdot("q8", 32), _make_qdot("q8", 16)
_fdot = {"f32": _make_fdot(0), "f16": _make_fdot(1), "bf16": _make_fdot(2)}


@njit(cache=True)
def quantize_rows(x, xq, xd, xs):
    """Quantize x: float32 [B, K] per 32 columns: xq int8 [B, K], xd = amax / 127, xs = xd * sum(xq)
    (float32 [B, K/32])."""
    for b in range(x.shape[0]):
        for i in range(x.shape[1] // 32):
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(x[b, i * 32 + j]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            s = 0
            for j in range(32):
                q = np.int32(np.rint(x[b, i * 32 + j] * inv))
                xq[b, i * 32 + j] = q
                s += q
            xd[b, i] = d
            xs[b, i] = d * np.float32(s)


@njit(cache=True, fastmath=False)
def _quantize_block(y, b, i, xq, xd, xs):
    """Quantize y[0:32] (float32 scratch) into block i of row b."""
    amax = np.float32(0.0)
    for j in range(32):
        amax = max(amax, abs(y[j]))
    d = amax / np.float32(127.0)
    inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
    s = 0
    for j in range(32):
        q = np.int32(np.rint(y[j] * inv))
        xq[b, i * 32 + j] = q
        s += q
    xd[b, i] = d
    xs[b, i] = d * np.float32(s)


@njit(cache=True)
def norm_quantize_rows(x, w, eps, xq, xd, xs):
    """Fused RMSNorm and quantization: rows of ``x / sqrt(mean(x²) + eps) * w`` (x: float32 [B, K],
    w: [K]) into xq, xd, xs as :func:`quantize_rows`."""
    K = x.shape[1]
    y = np.empty(32, np.float32)
    for b in range(x.shape[0]):
        ss = np.float32(0.0)
        for j in range(K):
            ss += x[b, j] * x[b, j]
        inv = np.float32(1.0) / np.sqrt(ss * np.float32(1.0 / K) + np.float32(eps))
        for i in range(K // 32):
            for j in range(32):
                y[j] = x[b, i * 32 + j] * inv * w[i * 32 + j]
            _quantize_block(y, b, i, xq, xd, xs)


@njit(cache=True)
def glu_quantize_rows(gu, gelu, xq, xd, xs):
    """Fused gated activation and quantization: rows of ``act(g) * u`` where gu = [g | u] float32
    [B, 2F]; act is gelu-tanh when ``gelu`` else silu."""
    F = gu.shape[1] // 2
    y = np.empty(32, np.float32)
    c = np.float32(np.sqrt(2.0 / np.pi))
    for b in range(gu.shape[0]):
        for i in range(F // 32):
            for j in range(32):
                g = gu[b, i * 32 + j]
                if gelu:
                    a = np.float32(0.5) * g * (np.float32(1.0) + np.tanh(c * (g + np.float32(0.044715) * g * g * g)))
                else:
                    a = g / (np.float32(1.0) + np.exp(-g))
                y[j] = a * gu[b, F + i * 32 + j]
            _quantize_block(y, b, i, xq, xd, xs)


def _drivers(dot, n_args):
    """Serial and row-parallel njit loops out[b, r] = dot(weights..., r, acts..., b)."""
    if n_args == 3:
        def body(qs, scale, minv, xq, xd, xs, out):
            for r in range(qs.shape[0]):
                for b in range(xq.shape[0]):
                    out[b, r] = dot(qs, scale, minv, r, xq, xd, xs, b)

        def pbody(qs, scale, minv, xq, xd, xs, out):
            for r in prange(qs.shape[0]):
                for b in range(xq.shape[0]):
                    out[b, r] = dot(qs, scale, minv, r, xq, xd, xs, b)
    else:
        def body(w, x, out):
            for r in range(w.shape[0]):
                for b in range(x.shape[0]):
                    out[b, r] = dot(w, r, x, b)

        def pbody(w, x, out):
            for r in prange(w.shape[0]):
                for b in range(x.shape[0]):
                    out[b, r] = dot(w, r, x, b)
    return njit(cache=True)(body), njit(parallel=True, cache=True)(pbody)


_QDRIVERS = {("q4", 32): _drivers(_q4dot, 3), ("q8", 32): _drivers(_q8dot32, 3), ("q8", 16): _drivers(_q8dot16, 3)}
_FDRIVERS = {k: _drivers(f, 2) for k, f in _fdot.items()}
_EMPTY = np.zeros((1, 1), np.float32)


def quantize_activations(x):
    """x: float32 [M, K] -> (xq int8 [M, K], xd, xs float32 [M, K/32]) for :func:`qmatmul`."""
    M, K = x.shape
    xq, xd, xs = np.empty((M, K), np.int8), np.empty((M, K // 32), np.float32), np.empty((M, K // 32), np.float32)
    quantize_rows(x, xq, xd, xs)
    return xq, xd, xs


def _acts_like(M, K):
    return np.empty((M, K), np.int8), np.empty((M, K // 32), np.float32), np.empty((M, K // 32), np.float32)


def norm_qmatmul(x, norm_w, eps: float, w: QWeight):
    """``rms_norm(x) @ W.T`` for a "q4"/"q8" weight, the norm fused into the activations' quantization.
    x: float32 [..., K], norm_w: [K] -> [..., N]."""
    x2 = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), np.float32)
    acts = _acts_like(*x2.shape)
    norm_quantize_rows(x2, np.ascontiguousarray(norm_w, np.float32), eps, *acts)
    return qmatmul(x2, w, acts=acts).reshape(*x.shape[:-1], w.shape[0])


def glu_qmatmul(gu, gelu: bool, w: QWeight):
    """``(act(g) * u) @ W.T`` for gu = [g | u]: float32 [..., 2F] and a "q4"/"q8" weight [N, F]."""
    g2 = np.ascontiguousarray(gu.reshape(-1, gu.shape[-1]), np.float32)
    acts = _acts_like(g2.shape[0], g2.shape[1] // 2)
    glu_quantize_rows(g2, gelu, *acts)
    return qmatmul(np.empty((g2.shape[0], g2.shape[1] // 2), np.float32), w, acts=acts).reshape(
        *gu.shape[:-1], w.shape[0])


def qmatmul(x, w: QWeight, *, acts=None, parallel: bool | None = None):
    """``x @ W.T`` for a packed weight.

    Parameters
    ----------
    x : float32 [..., K]
    w : QWeight [N, K]
    acts : tuple, optional
        x already quantized by :func:`quantize_activations` (shared by matmuls of the same input).
    parallel : bool, optional
        Split rows over Numba's threads (default: when more than one is set). The result is the same.

    Returns
    -------
    float32 [..., N]
    """
    if not HAVE_KERNELS:
        raise RuntimeError("the packed-weight kernels need an x86 CPU with AVX2; load the model with "
                           "weights='f32' (CLI: --weights f32)")
    N, K = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {w.shape} expects {K}")
    lead = x.shape[:-1]
    x2 = np.ascontiguousarray(x.reshape(-1, K), np.float32)
    out = np.empty((x2.shape[0], N), np.float32)
    par = numba.get_num_threads() > 1 if parallel is None else parallel
    if w.kind in _FDRIVERS:
        _FDRIVERS[w.kind][par](w.qs, x2, out)
    else:
        xq, xd, xs = quantize_activations(x2) if acts is None else acts
        minv = w.minv if w.minv is not None else _EMPTY
        _QDRIVERS[(w.kind, w.group)][par](w.qs, w.scale, minv, xq, xd, xs, out)
    return out.reshape(*lead, N)
