"""Storage of the ring: allocation, the slot rule as arithmetic, and the bfloat16 bit conversions.

Pure functions over arrays, shared by the cache, the backends and the benchmarks; the rule they
compute is explained in streamattn/kv/cache.py and docs/DESIGN.md.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ..runtime import cpu_target, kernel_cache
from .spec import BLOCK_BYTES, QBLOCK, QUANTIZED, row_width

cpu_target.check()                 # float16 conversions need F16C (a clear error, not LLVM's abort)
kernel_cache.register(__name__)    # (its kernels call only its own code)

STORAGE_ALIGN = 64  # bytes: one cache line, one AVX-512 vector


def storage_zeros(xp, shape, dtype):
    """Zeroed K or V storage whose data starts on a STORAGE_ALIGN-byte boundary.

    numpy's large arrays start 16 bytes past a line, so every 64-byte vector load of a row touched two
    cache lines (measured: docs/PERF.md). CuPy's allocations are 256-byte aligned already.
    """
    if xp is not np:
        return xp.zeros(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + STORAGE_ALIGN, np.uint8)
    start = -raw.ctypes.data % STORAGE_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


@njit(cache=True)
def slot_of(pos, sinks, ring):
    """Slot of absolute position ``pos`` in a cache with ``sinks`` fixed and ``ring`` rotating slots: the
    rule, written once (:func:`ring_slots` maps it over arrays, :func:`write_rows` calls it per row).
    Causal caches are the case ``sinks=0, ring=capacity`` (then slot == position)."""
    return pos if pos < sinks else sinks + (pos - sinks) % ring


@njit(cache=True)
def _map_slots(positions, sinks, ring, out):
    for i in range(positions.size):
        out[i] = slot_of(positions[i], sinks, ring)


def ring_slots(positions, *, sinks: int, ring: int):
    """Slots of absolute ``positions`` (an int or an int array; int64 array out) by :func:`slot_of`.

    >>> ring_slots(np.arange(8), sinks=2, ring=3).tolist()
    [0, 1, 2, 3, 4, 2, 3, 4]
    >>> int(ring_slots(7, sinks=2, ring=3))
    4
    """
    positions = np.asarray(positions, np.int64)
    out = np.empty(positions.shape, np.int64)
    _map_slots(np.ascontiguousarray(positions).reshape(-1), sinks, ring, out.reshape(-1))
    return out


def slot_positions(length: int, *, slots: int, sinks: int):
    """Absolute position held by each slot after ``length`` tokens, or -1 for a slot never written.

    >>> slot_positions(7, slots=5, sinks=2).tolist()   # ring of 3 holds positions 4, 5, 6
    [0, 1, 5, 6, 4]
    """
    s = np.arange(slots)
    ring = slots - sinks
    pos = np.where(s < sinks, s, (length - 1) - ((length - 1 - s) % ring))
    return np.where((pos >= 0) & (pos < length) & ((s < sinks) | (pos >= sinks)), pos, -1)


def widen_bf16(bits, xp=np):
    """bfloat16 raw bits (uint16) -> float32: a 16-bit shift."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


# -- block quantization: GGUF's Q8_0 and Q4_0, one row of head_dim values at a time ------------------------
#
# A row of D values is ceil(D / 32) blocks; a block is its float16 scale d (2 bytes, little-endian) and then
#   q8_0: 32 int8 q, value = q * d, d = max|x| / 127, q = round-half-away(x / d)
#   q4_0: 16 bytes, byte j = q[j] | q[j + 16] << 4, value = (q - 8) * d, d = x_m / -8 where x_m is the
#         first value of largest magnitude, q = min(15, trunc(x / d + 8.5))
# as ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref (and gguf-py's quants.py) compute them in float32:
# the reciprocal 1/d is taken of the float32 d, before d is rounded to float16. Values past D (the last
# block of a head_dim that is no multiple of 32) are zeros. A block holding NaN or inf gets a NaN scale
# (bits 0x7E00) and zero quants, so every value read from it is NaN, never a silent number; a finite block
# whose scale overflows float16 (max|x| past 8.3e6 for q8_0) keeps its inf scale: both are refused by
# a check_finite cache (:func:`check_quantized_finite`).

@njit(cache=True)
def _roundf(x):
    """C's roundf (half away from zero) in float32, as gguf-py's np_roundf writes it."""
    a = abs(x)
    f = np.float32(math.floor(a))
    b = f + np.float32(math.floor(np.float32(2.0) * (a - f)))
    return -b if x < 0 else b


@intrinsic
def f32_to_f16(typingctx, x):
    """float32 -> float16 bits (uint16) by LLVM's fptrunc: round to nearest even, overflow to inf, as
    numpy's astype(float16) rounds."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@njit(cache=True)
def _block_scale(x, r, b, q4, blk):
    """Block b of row r of x [n, D] into blk float32 [32] (zero past D), and its scale before float16:
    (d, finite), d = signed max / -8 for q4_0 (``q4``), max |x| / 127 for q8_0 (the first of equal
    magnitudes, as gguf-py takes it); finite False where the block holds NaN or inf."""
    m = min(32, x.shape[1] - 32 * b)
    finite = True
    amax = np.float32(0.0)
    xm = np.float32(0.0)
    for i in range(32):
        v = x[r, 32 * b + i] if i < m else np.float32(0.0)
        blk[i] = v
        if not math.isfinite(v):
            finite = False
        elif abs(v) > amax:
            amax, xm = abs(v), v
    return (xm / np.float32(-8.0) if q4 else amax / np.float32(127.0)), finite


@intrinsic
def f16_to_f32(typingctx, bits):
    """float16 bits (uint16, or the low 16 bits of another integer) -> float32 by LLVM's fpext: exact, inf
    and NaN kept; vectorises to vcvtph2ps."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        b16 = args[0] if bits.bitwidth == 16 else builder.trunc(args[0], ir.IntType(16))
        return builder.fpext(builder.bitcast(b16, ir.HalfType()), ir.FloatType())
    return types.float32(bits), codegen


#: The scales a q4_0 block is tried at by ``quantize_rows(..., search=True)``: fractions of gguf's (signed max
#: / -8), 1.0 (gguf's own) among them, so the search never does worse than gguf's rule on a block.
SCALE_STEPS = np.linspace(0.70, 1.0, 16).astype(np.float32)


@njit(cache=True)
def _q4_code(v, inv):
    """The q4_0 code 0..15 (as float32) of float32 v under 1 / scale ``inv``, to nearest (value = scale *
    (code - 8)); float32 arithmetic, as :func:`quantize_rows`'s."""
    return min(np.float32(15.0), max(np.float32(0.0), np.floor(v * inv + np.float32(8.5))))


@njit(cache=True)
def _q4_error(blk, d, sq):
    """Squared error of the 32 values blk rounded to nearest q4_0 codes under scale d (a float16 value, as
    float32): float32, summed by a fixed pairwise tree (so the same in every caller; sq: scratch [32])."""
    inv = np.float32(1.0 / d)
    for i in range(32):
        e = blk[i] - d * (_q4_code(blk[i], inv) - np.float32(8.0))
        sq[i] = e * e
    for w in (16, 8, 4, 2, 1):
        for i in range(w):
            sq[i] += sq[i + w]
    return sq[0]


@njit(cache=True)
def _searched_scale(blk, d0, sq):
    """The float16 bits of the scale among :data:`SCALE_STEPS` times ``d0`` (gguf's, float32) with the least
    :func:`_q4_error` on the block blk [32]; -1 when every candidate rounds to zero. The errors are float32
    sums in a fixed order, so every caller that compiles this makes the same choice."""
    best, best_h = np.float32(np.inf), -1
    for s in SCALE_STEPS:
        h = np.int64(f32_to_f16(d0 * s))
        d = f16_to_f32(h)
        if d == 0 or h & 0x7C00 == 0x7C00:
            continue
        err = _q4_error(blk, d, sq)
        if err < best:
            best, best_h = err, h
    return best_h


@njit(cache=True)
def quantize_rows(x, out, q4, search=False):
    """Quantize float32 rows x [n, D] into out uint8 [n, row bytes] (q8_0, or q4_0 when ``q4``).
    Returns the number of blocks whose scale is not finite (NaN or inf input, or an overflow).
    ``search`` (q4_0 only): each block's scale chosen among :data:`SCALE_STEPS` times gguf's as the one
    (in float16, as stored) whose codes, rounded to nearest, leave the least squared error over the
    block's 32 values (:func:`_searched_scale`), instead of gguf's signed max / -8. gguf's scale puts the
    block's largest value exactly on a code and gives the other 31 the steps left over; a smaller scale
    can clip that value and still lose less in all. Same layout, read by the same kernels; blocks of NaN
    or inf (the marker), overflows and zero scales are gguf's either way."""
    n, D = x.shape
    nb = out.shape[1] // (18 if q4 else 34)
    blk = np.zeros(32, np.float32)
    sq = np.empty(32, np.float32)
    bad = 0
    for r in range(n):
        for b in range(nb):
            o = b * (18 if q4 else 34)
            d, finite = _block_scale(x, r, b, q4, blk)
            if not finite:
                out[r, o] = 0x00                 # scale 0x7E00: float16 quiet NaN
                out[r, o + 1] = 0x7E
                for i in range(2, 18 if q4 else 34):
                    out[r, o + i] = 0x88 if q4 else 0
                bad += 1
                continue
            inv = np.float32(0.0) if d == 0 else np.float32(1.0) / d
            h = np.int64(f32_to_f16(d))
            if h & 0x7C00 == 0x7C00:
                bad += 1
            elif q4 and search and d != 0:
                hs = _searched_scale(blk, d, sq)
                if hs >= 0:
                    h, inv = hs, np.float32(1.0 / f16_to_f32(hs))
            out[r, o] = h & 0xFF
            out[r, o + 1] = h >> 8
            if q4:
                for j in range(16):
                    out[r, o + 2 + j] = np.uint8(_q4_code(blk[j], inv)) | (np.uint8(_q4_code(blk[j + 16], inv)) << 4)
            else:
                for i in range(32):
                    out[r, o + 2 + i] = np.uint8(np.int64(_roundf(blk[i] * inv)) & 0xFF)
    return bad


@njit(cache=True)
def quantize_rows_fed(x, out, q4, U):
    """:func:`quantize_rows`, then each row's codes chosen again in order, element 0 first, each one's
    rounding error pushed onto the elements not yet rounded through U (float64 [D, D], the upper Cholesky
    factor of the inverse of a positive definite H: GPTQ's update), which makes the row's error e small in
    eᵀ H e instead of in each element. The block scales are :func:`quantize_rows`'s, so the bytes are
    q8_0 / q4_0 blocks as ever; an identity U gives :func:`quantize_rows`'s bytes. Rows holding a block
    whose scale is not finite keep :func:`quantize_rows`'s bytes (its NaN marker, or an overflow). Returns
    its ``bad`` count."""
    bad = quantize_rows(x, out, q4)
    n, D = x.shape
    bb = 18 if q4 else 34
    nb = out.shape[1] // bb
    blk = np.empty(32, np.float32)
    inv = np.empty(nb, np.float32)
    dq = np.empty(nb, np.float64)
    w = np.empty(D, np.float64)
    for r in range(n):
        finite = True
        for b in range(nb):
            h = np.int64(out[r, b * bb]) | (np.int64(out[r, b * bb + 1]) << 8)
            finite = finite and h & 0x7C00 != 0x7C00            # NaN marker or overflow: left as it is
            d = _block_scale(x, r, b, q4, blk)[0]                # the scale quantize_rows rounded with
            inv[b] = np.float32(0.0) if d == 0 else np.float32(1.0) / d
            dq[b] = f16_to_f32(h)                                # the scale the kernels read
        if not finite:
            continue
        for i in range(D):
            w[i] = x[r, i]
        for i in range(D):
            b, j = i // 32, i % 32
            if q4:
                c = min(15, max(0, int(math.floor(np.float32(w[i]) * inv[b] + np.float32(8.5)))))
                o = b * bb + 2 + j % 16
                out[r, o] = (out[r, o] & 0xF0) | c if j < 16 else (out[r, o] & 0x0F) | (c << 4)
                e = (w[i] - dq[b] * (c - 8)) / U[i, i]
            else:
                c = min(127, max(-127, np.int64(_roundf(np.float32(w[i]) * inv[b]))))
                out[r, b * bb + 2 + j] = np.uint8(c & 0xFF)
                e = (w[i] - dq[b] * c) / U[i, i]
            for k in range(i + 1, D):
                w[k] -= e * U[i, k]
    return bad


@njit(cache=True)
def _quantize_heads_fed(x, out, q4, U):
    """:func:`quantize_rows_fed` over x [B, Hk, T, D] into out [B, Hk, T, row bytes], head h through U[h]."""
    bad = 0
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            bad += quantize_rows_fed(x[b, h], out[b, h], q4, U[h])
    return bad


def rounding_factor(h, damping: float = 0.01):
    """U for :func:`quantize_rows_fed` from H (float [D, D], symmetric positive semidefinite): the upper
    Cholesky factor of (H + damping * mean(diag H) * I)^-1, float64 (GPTQ's damping: H may be singular)."""
    h = np.asarray(h, np.float64)
    h = h + damping * max(float(np.mean(np.diag(h))), 1e-30) * np.eye(len(h))
    return np.ascontiguousarray(np.linalg.cholesky(np.linalg.inv(h)).T)


def quantize_fed(x, dtype: str, U):
    """:func:`quantize` of x [B, Hk, T, D] with each kv head's rows rounded through U[h] (float64
    [Hk, D, D], :func:`quantize_rows_fed`). Returns (blocks, bad)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty(x.shape[:3] + (row_width(dtype, x.shape[3]),), np.uint8)
    return out, int(_quantize_heads_fed(x, out, dtype == "q4_0", U))


def quantize(x, dtype: str, search: bool = False):
    """float rows ``x`` [..., D] -> uint8 [..., row bytes] of ``dtype`` "q8_0" or "q4_0" blocks (numpy).

    Returns (blocks, bad): bad counts the blocks whose float16 scale is NaN or inf (NaN or inf input, or
    a scale past 65504). Byte-compatible with gguf.quants.quantize of the rows zero-padded to a multiple of 32;
    ``search``: q4_0 block scales searched for the least error (:func:`quantize_rows`) instead.

    >>> q, bad = quantize(np.linspace(-1, 1, 64, dtype=np.float32), "q8_0")
    >>> q.shape, bad
    ((68,), 0)
    """
    x = np.asarray(x)
    D = x.shape[-1]
    flat = np.ascontiguousarray(x.reshape(-1, D), np.float32)
    out = np.empty((flat.shape[0], row_width(dtype, D)), np.uint8)
    bad = quantize_rows(flat, out, dtype == "q4_0", search)
    return out.reshape(x.shape[:-1] + (out.shape[1],)), int(bad)


def dequantize(a, dtype: str, head_dim: int, xp=np):
    """uint8 rows [..., row bytes] of q8_0 / q4_0 blocks -> float32 [..., head_dim]: the values a kernel reads."""
    nb = a.shape[-1] // BLOCK_BYTES[dtype]
    blocks = a.reshape(a.shape[:-1] + (nb, BLOCK_BYTES[dtype]))
    d = xp.ascontiguousarray(blocks[..., :2]).view(xp.float16).astype(xp.float32)       # [..., nb, 1]
    if dtype == "q8_0":
        q = xp.ascontiguousarray(blocks[..., 2:]).view(xp.int8).astype(xp.float32)      # [..., nb, 32]
    else:
        qs = blocks[..., 2:]
        q = xp.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(xp.float32) - 8.0    # [..., nb, 32]
    return (d * q).reshape(a.shape[:-1] + (nb * QBLOCK,))[..., :head_dim]


def widen(a, dtype: str, head_dim: int, xp=np):
    """Storage rows of ``dtype`` -> float32 [..., head_dim]: what every kernel computes with."""
    if dtype in QUANTIZED:
        return dequantize(a, dtype, head_dim, xp)
    return widen_bf16(a, xp) if dtype == "bfloat16" else a.astype(xp.float32)


def quantized_bad_rows(a, dtype: str, xp=np):
    """bool [...] over rows [..., row bytes]: rows holding a block whose scale is NaN or inf."""
    nb = a.shape[-1] // BLOCK_BYTES[dtype]
    blocks = a.reshape(a.shape[:-1] + (nb, BLOCK_BYTES[dtype]))
    scale = blocks[..., 0].astype(xp.uint16) | (blocks[..., 1].astype(xp.uint16) << 8)
    return ((scale & 0x7C00) == 0x7C00).any(axis=-1)


#: Damping of the queries' second moment when q4_0 keys are rounded for them (:func:`recode_for_queries`): the
#: diagonal gets this times its mean (chosen by perplexity: docs/perf/2026-12-04.md, 19:45-20:15 UTC).
QUERY_DAMPING = 3.0


@njit(cache=True)
def _spd_inverse(A, out):
    """out = A^-1 for a small symmetric positive definite A (Gauss-Jordan without pivoting, float64; A is
    overwritten): a G x G system per key row, where a LAPACK call cost more than the row's own arithmetic."""
    n = A.shape[0]
    out[:, :] = 0.0
    for i in range(n):
        out[i, i] = 1.0
    for i in range(n):
        p = 1.0 / A[i, i]
        for j in range(n):
            A[i, j] *= p
            out[i, j] *= p
        for k in range(n):
            if k != i:
                f = A[k, i]
                for j in range(n):
                    A[k, j] -= f * A[i, j]
                    out[k, j] -= f * out[i, j]


@njit(cache=True)
def recode_for_queries(x, qs, out, damping=QUERY_DAMPING):
    """Re-round q4_0 rows ``out`` [n, row bytes] of float32 rows ``x`` [n, D] for the queries that come with
    them, ``qs`` [G, n, D] (row r's own token's G query heads, in the frame the keys are stored in): each
    block keeps its stored scale, and the codes, one element after the other, are rounded to nearest with
    the error of those before pushed onto those not yet rounded so that the queries' scores move least —
    GPTQ's order and update (Frantar et al., 2022) for the objective e^T H e, H = sum_g q_g q_g^T plus
    ``damping`` times its mean diagonal. With G << D, H^-1 over the elements not yet rounded is applied
    through the G x G matrix M = lambda I + Q_R Q_R^T (Woodbury), downdated by Sherman-Morrison as each
    element is rounded: O(D^2 G) a row instead of O(D^3). A function of the row and its own queries
    alone (no state): every chunking, batch, fork, rewind and draft stores the same bytes. Rows with a
    non-finite or zero scale, or queries of zero norm or not finite, keep their codes."""
    n, D = x.shape
    G = qs.shape[0]
    nb = (D + 31) // 32                            # a last block padded with zeros counts (head_dim 16, 80)
    M = np.empty((G, G))
    Minv = np.empty((G, G))
    u = np.empty(G)
    w = np.empty(D)
    Q = np.empty((G, D))
    d = np.empty(nb)
    for r in range(n):
        ok = True
        for b in range(nb):
            d[b] = f16_to_f32(np.uint16(np.int64(out[r, 18 * b]) | (np.int64(out[r, 18 * b + 1]) << 8)))
            if not np.isfinite(d[b]):
                ok = False
        tr = 0.0
        for g in range(G):
            for i in range(D):
                Q[g, i] = qs[g, r, i]
                tr += Q[g, i] * Q[g, i]
        lam = damping * tr / D
        if not ok or not (lam > 0.0) or not np.isfinite(lam):
            continue
        for a in range(G):                         # M = lam I + Q Q^T over every element, inverted once
            for c in range(G):
                acc = lam if a == c else 0.0
                for i in range(D):
                    acc += Q[a, i] * Q[c, i]
                M[a, c] = acc
        _spd_inverse(M, Minv)                      # (M is rebuilt for every row)
        for i in range(D):
            w[i] = x[r, i]
        for i in range(D):
            db = d[i // 32]
            if db == 0.0:
                code = 8
            else:
                code = min(15, max(0, np.int64(np.round(w[i] / db)) + 8))
            b, j = i // 32, i % 32
            o = 18 * b + 2 + j % 16
            if j < 16:
                out[r, o] = (out[r, o] & 0xF0) | code
            else:
                out[r, o] = (out[r, o] & 0x0F) | (code << 4)
            e = w[i] - (code - 8) * db
            s = 1.0                                # 1 - q_i^T M^-1 q_i, q_i = Q[:, i]
            for a in range(G):
                acc = 0.0
                for c in range(G):
                    acc += Minv[a, c] * Q[c, i]
                u[a] = acc
                s -= Q[a, i] * acc
            rest = w[i + 1:]                       # w[j] += e (q_j . u) / s over the elements left
            for a in range(G):
                fu = e * u[a] / s
                qa = Q[a, i + 1:]
                for t in range(rest.shape[0]):     # (indices from 0: the loop vectorises)
                    rest[t] += fu * qa[t]
            for a in range(G):                     # element i leaves: M -= q_i q_i^T (Sherman-Morrison)
                for c in range(G):
                    Minv[a, c] += u[a] * u[c] / s


def to_storage(x, dtype: str, xp, rounding=None, search: bool = False):
    """Cast a float array [..., head_dim] to the spec's storage (bf16: round-to-nearest-even raw bits;
    q8_0 / q4_0: uint8 rows of blocks, :func:`quantize`; on a device through the host). ``rounding``:
    None, or float64 [kv_heads, D, D] factors for a quantized x [B, kv_heads, T, D] (:func:`quantize_fed`);
    ``search``: q4_0 block scales searched (:func:`quantize_rows`; not with ``rounding``)."""
    if dtype in QUANTIZED:
        if rounding is not None:
            from ..runtime.arrays import to_host
            q = quantize_fed(to_host(x, copy=False), dtype, rounding)[0]
            return q if xp is np else xp.asarray(q)
        if xp is np:
            return quantize(x, dtype, search)[0]
        from ..runtime.arrays import to_host
        return xp.asarray(quantize(to_host(x, copy=False), dtype, search)[0])
    if dtype == "bfloat16":
        if x.dtype.name == "bfloat16":  # ml_dtypes input: already bf16
            return x.view(xp.uint16)
        # Round to nearest even by adding 0x7FFF plus the kept half's low bit. A NaN would carry into the
        # exponent or wrap past the sign (0x7FFFFFFF, the NaN of every CUDA float op, gives 0x8000: -0.0,
        # which the finite check passes), so a NaN keeps its top half with the quiet bit set instead.
        # kernels/append.cu and models.compiled.stored_16 apply the same rule.
        bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
        rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(xp.uint16)
        quiet = ((bits >> 16) | 0x40).astype(xp.uint16)
        return xp.where((bits & 0x7FFFFFFF) > 0x7F800000, quiet, rounded)
    return x.astype(dtype, copy=False)


def check_stored_finite(ks, vs, counts, dtype: str, xp, dtype_v: str | None = None) -> None:
    """Refuse a chunk whose real rows (``counts[b]`` per sequence) are NaN or inf *as stored*: run after
    the cast, so a float32 1e5 that overflows a float16 cache is refused too. ks, vs: [batch, kv_heads, T, d]
    (quantized: [.., row bytes], checked by their scales). ``dtype_v``: V's dtype when it differs from K's.
    One pass over the whole chunk first: when it is all finite (the usual case), no per-sequence look."""
    def finite(x, dt):
        if dt in QUANTIZED:
            return ~quantized_bad_rows(x, dt, xp)
        return xp.isfinite(widen_bf16(x, xp) if dt == "bfloat16" else x)
    for name, x, dt in (("k", ks, dtype), ("v", vs, dtype_v or dtype)):
        if bool(finite(x, dt).all()):
            continue
        for b in range(x.shape[0]):
            rows = x[b, :, :int(counts[b])]
            if rows.size and not bool(finite(rows, dt).all()):
                raise non_finite_error(name, b, dt)


def non_finite_error(name: str, b: int, dtype: str) -> ValueError:
    """The refusal of a chunk whose ``name`` ("k" or "v") rows of sequence ``b`` are NaN or inf as stored."""
    return ValueError(f"{name} holds NaN or inf for sequence {b}; the cache is unchanged (checked as stored in "
                      f"{dtype}: float16 overflows past 65504, a q8_0 block's scale past max|x| = 8.3e6; pass "
                      "check_finite=False in the spec to skip this check)")


#: Exponent bits of each storage, as unsigned integers: a value is NaN or inf iff all of them are set.
EXPONENT_BITS = {"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}


def bits(x):
    """The storage bits of x as unsigned integers of its width (float32 -> uint32; 16-bit -> uint16;
    quantized uint8 rows as they are)."""
    return x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize])


@njit(cache=True)
def _first_not_finite(x, counts, expbits):
    """The first sequence b whose real rows of x [B, H, T, D] (bits) hold a NaN or inf, or -1."""
    B, H, T, D = x.shape
    for b in range(B):
        for h in range(H):
            for t in range(counts[b]):
                for d in range(D):
                    if x[b, h, t, d] & expbits == expbits:
                        return b
    return -1


@njit(cache=True)
def first_not_finite(x, counts, kind, expbits):
    """The first sequence b whose real rows (the first counts[b]) of x [B, H, T, width] hold a value that is
    NaN or inf as stored, or -1: for float storage (``kind`` 0-2, as the CPU backend numbers them) bits
    with all ``expbits`` set; for q8_0 / q4_0 rows (kind 3 / 4) a block whose float16 scale is NaN or inf,
    as :func:`quantized_bad_rows` finds them."""
    if kind < 3:
        return _first_not_finite(x, counts, expbits)
    B, H, T, W = x.shape
    nbytes = 34 if kind == 3 else 18
    for b in range(B):
        for h in range(H):
            for t in range(counts[b]):
                for o in range(0, W, nbytes):
                    if x[b, h, t, o + 1] & 0x7C == 0x7C:         # the scale's high byte: exponent all ones
                        return b
    return -1


@njit(cache=True)
def write_rows(kst, vst, ks, vs, lengths, counts, last_counts, held_from, sinks, ring, window, check, expbits):
    """One chunk into a CPU ring, as bits: ``kst, vst`` [B, H, slots, D] and ``ks, vs`` [B, H, T, D] unsigned
    views of the storage and of the chunk cast to it (:func:`bits`); row t < counts[b] of sequence b goes
    to the slot of position lengths[b] + t (:func:`slot_of`); then the counters move (held_from only
    for a window cache). With ``check``, first looks for a NaN or inf (all ``expbits`` set) among the
    real rows, k before v, and returns ``2 b + (0 for k, 1 for v)`` of the first without writing anything;
    else returns -1. One compiled call where the Python path took ~15 array operations per layer."""
    B, H = ks.shape[:2]
    if check:
        bad = _first_not_finite(ks, counts, expbits)
        if bad >= 0:
            return 2 * bad
        bad = _first_not_finite(vs, counts, expbits)
        if bad >= 0:
            return 2 * bad + 1
    for b in range(B):
        L = lengths[b]
        for t in range(counts[b]):
            s = slot_of(L + t, sinks, ring)
            for h in range(H):
                kst[b, h, s, :] = ks[b, h, t, :]
                vst[b, h, s, :] = vs[b, h, t, :]
        if window:
            held_from[b] = max(held_from[b], L + counts[b] - ring)
        lengths[b] = L + counts[b]
        last_counts[b] = counts[b]
    return -1
