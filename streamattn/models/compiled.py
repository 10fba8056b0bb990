"""The decoder layer compiled for the CPU: :func:`streamattn.models.layer.decoder_layer` under Numba.

The layer is one Python function over seven ops (:mod:`streamattn.models.layer`). Here each op gets a
Numba implementation (``numba.extending.overload``) over the kernels its array version calls on the CPU
— the packed-matmul drivers with their fused quantizers, the heads/RoPE kernel, the cache's write and
the attention kernel — with the same arguments in the same order, so a compiled layer and the array
layer give the same bits (tests/test_compiled_layer.py). ``Transformer.forward`` then makes one
compiled call per layer instead of ~40 Python calls (benchmarks/python_overhead.py; docs/PERF.md).

The compiled ``at`` is ``(cfg, kv, step)``: the model's numbers (:class:`Cfg`), the layer's cache as
arrays (:class:`Kv`), and the step's RoPE rows and thread choice (:class:`Step`). A weight matrix is
``(qs, scale, minv, rows, tag)``: the packed planes, the real row count, and a tag whose Numba type
names the drivers (:func:`_tag`), so one compiled layer serves every model with the same block kinds.

The attend op stages the step's K and V as the cache stores them, each by its own storage (float32 as it
is, float16/bfloat16 patterns: :func:`stored_16`; q8_0/q4_0 blocks: :func:`stored_quantized`, the same
quantizer as the cache's), writes them and runs the CPU attention over the ring (quantized rows read in
place). A ``rotate_k`` cache gets its keys and the queries rotated first (:func:`streamattn.kv.rotation.rotate_rows`).
That op is the one part that differs between storages, so it is compiled apart (:data:`ATTENDS`, one copy
per pair of K and V storage classes) and called through its address; the layer sees the cache's storage
as bytes, and so is compiled once for every storage (docs/DESIGN.md §15).

A ragged step (``counts``: some rows padding, as when a prompt chunk shares the step with decoding
sequences) runs compiled too: the cache writes and attends each sequence's counts[b] tokens, and the
matmuls take only the real rows (:func:`_matmul`), so a step costs its real rows, not B*T.

A chunk the cache refuses (past max_len or max_chunk, not answerable after a rewind, not finite as
stored) the compiled layer leaves undone, with the residual and the cache as they were (:func:`run_layer`;
a causal ring it grows first), and the forward runs that layer as array code, which raises its error.
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
import zlib
from collections import namedtuple

import numpy as np
from llvmlite import ir
from numba import njit, prange, typeof, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from streamattn.runtime import kernel_cache
from streamattn.runtime.threads import kernel_thread_count     # (cacheable: see there)
from streamattn.kv import storage
from streamattn.kv.backends import cpu
from streamattn.runtime.kernel_cache import variant
from streamattn.models import heads_kernel, layer
from streamattn.models.heads_kernel import heads_rope_alloc, heads_rope_rows_parallel, rms_row
from streamattn.models.layer import LayerWeights
from streamattn.quant import matmul as qmatmul
from streamattn.quant.matmul import GELU, NORM, PLAIN, SILU
from streamattn.kv import rotation
from streamattn.kv.rotation import rotate_rows
from streamattn.kv.spec import QUANTIZED
from streamattn.kv.storage import (EXPONENT_BITS, bits, first_not_finite, quantize_rows, quantize_rows_fed, recode_for_queries, write_rows)

# The layer is compiled here, with this module's ops inlined into it: its cache files go with this module's.
kernel_cache.register(__name__, depends_on=[cpu, heads_kernel, layer, qmatmul, rotation, storage],
                      compiles=[layer.decoder_layer])


#: The model's numbers: heads, eps (the drivers take it as a float, the heads kernel as float32), RoPE
#: pairing, attention scale, activation, attention soft cap (None, typed ``none``: a layer compiled without
#: the cap's code; else float32).
Cfg = namedtuple("Cfg", "H Hk eps eps32 neox scale gelu softcap")
#: A layer's cache: its storage as bytes (kst, vst: uint8 [B, Hk, slots, row bytes], whatever the storage, so
#: that one compiled layer serves every storage: the attend op views them as its own types), the counters,
#: the geometry (window 0: causal; max_len 0: none), the finite check, K's and V's storage (``kind``,
#: ``kind_v``: cpu.KIND, 0 float32, 1 float16, 2 bfloat16, 3 q8_0, 4 q4_0) and the exponent bits of each (0 for
#: a quantized one), and ``mixed``: K and V differ or are quantized, so the finite check runs per array
#: (storage.first_not_finite), not in write_rows;
#: ``rotate``: keys stored as ``k @ H`` and queries scored as ``q @ H`` (streamattn.kv.rotation); ``vround``: the
#: factors a q4_0 V is rounded with (float64 [Hk, D, D], ``Transformer.value_rounding``), else [0, 0, 0];
#: ``ksearch``: a q4_0 K's block scales searched and its codes rounded for the step's queries
#: (``Transformer.key_search``); ``attend``, ``code``: the address of the compiled :data:`ATTENDS` copy for
#: these storages, and ``9 * _types_code(argument types it was compiled for) + _storage_pair(kind, kind_v)``
#: (0, 0: none bound, :meth:`CompiledLayers.bound`).
Kv = namedtuple("Kv", "kst vst lengths last_counts held_from sinks ring window max_chunk max_len "
                      "check expbits kind kind_v expbits_v mixed rotate vround ksearch attend code")
#: One step: RoPE cos, sin rows [B*T, hd] of the layer's base, the batch, whether to stay on one thread
#: (True / False, or None: one thread, decided when the layer is typed, so that its parallel kernels are
#: never compiled: :func:`streamattn.runtime.threads.serial_kernels`), int64 [1] set to 1 by a layer whose chunk
#: the cache refused (:func:`run_layer`), the real tokens of each sequence (counts: int64 [B], each in
#: 0..T), and which rows of x [B*T] they are (real: int64 [n], ascending; all B*T of them when every row
#: is real). The matmuls see only the real rows.
Step = namedtuple("Step", "cos sin B serial status counts real")
Weights = namedtuple("Weights", [f.name for f in dataclasses.fields(LayerWeights)])

_KINDS, _GROUPS, _LANES, _ROWS = ("q4", "q8", "q5", "nl", "q4s", "q6k", "q4k"), (32, 16), (16, 8), (1, 2, 4, 8)  # new last
_EMPTY1 = np.zeros(1, np.float32)
_EMPTY2 = np.zeros((1, 1), np.float32)
_NO_ROUNDING = np.zeros((0, 0, 0), np.float64)


def _tag(kind: str, group: int, lanes: int, R: int, vnni: bool, amx: bool) -> tuple:
    """A tuple of ``code + 1`` Nones, code numbering (kind, group, lanes, R, vnni, amx; amx the lowest
    bit): its Numba type (``UniTuple(none, code + 1)``) is what the matmul ops read the drivers from, at
    compile time, and it is the same in every process (a compiled layer's cache key)."""
    code = (((_KINDS.index(kind) * 2 + _GROUPS.index(group)) * 2 + _LANES.index(lanes)) * 4
            + _ROWS.index(R)) * 2 + int(vnni)
    return (None,) * (code * 2 + int(amx) + 1)


def _untag(tag_type) -> tuple:
    code = tag_type.count - 1
    amx, code = bool(code % 2), code // 2
    vnni, code = bool(code % 2), code // 2
    R, code = _ROWS[code % 4], code // 4
    lanes, code = _LANES[code % 2], code // 2
    return _KINDS[code // 2], _GROUPS[code % 2], R, lanes, vnni, amx


def _drive(w_type):
    """The compiled ``drive(mode, x, nw, eps, w, one_thread) -> [M, N]`` of a weight tuple of Numba type
    ``w_type`` on every row of x: its drivers (serial where ``one_thread``) with ``Matmuls``'s placeholder
    arrays. A matrix held as row groups of different kinds (a tuple of weight tuples) quantizes once and
    runs each group's drivers on the activations, as ``Matmuls.pieces`` does (the same bits)."""
    if isinstance(w_type.types[0], types.BaseTuple):
        return _drive_pieces(w_type)
    serial, parallel = qmatmul.qdrivers(*_untag(w_type.types[4]))

    @njit
    def drive(mode, x, nw, eps, w, one_thread):
        e = x[:0]                    # placeholders of the types Matmuls passes (the driver makes its own)
        if one_thread is None or one_thread:          # (None: pruned when typed, see Step)
            out = serial(mode=mode, x=x, nw=nw, eps=eps, xq=e.view(np.int8), xd=e, xs=e, xc=e.view(np.int32),
                         qs=w[0], scale=w[1], minv=w[2], out=e)
        else:
            out = parallel(mode=mode, x=x, nw=nw, eps=eps, xq=e.view(np.int8), xd=e, xs=e, xc=e.view(np.int32),
                           qs=w[0], scale=w[1], minv=w[2], out=e)
        return out if out.shape[1] == w[3] else np.ascontiguousarray(out[:, :w[3]])
    return drive


def _piece(piece_type):
    """``run(x, xq, xd, xs, xc, qs, scale, minv, rows, g0, g1, out)``: one row group's serial drivers over its
    interleaved groups g0 .. g1 - 1 (planes ``qs``, ``scale``, ``minv`` of its weight tuple, ``rows`` real
    rows) on given activations, into the columns of ``out`` [M, rows] that they make (lanes g0 on; the
    padding rows of its last interleaved group cut). A group's columns are the bits of a call over every
    group: each output element is one kernel call on its own group and row
    (:func:`streamattn.quant.kernels.make_qdot`)."""
    kind, group, R, lanes, vnni, amx = _untag(piece_type.types[4])
    serial = qmatmul.qdrivers(kind, group, R, lanes, vnni, amx)[0]
    given = np.int64(qmatmul.GIVEN)

    @njit
    def run(x, xq, xd, xs, xc, qs, scale, minv, rows, g0, g1, out):
        if g1 <= g0:
            return
        part = np.empty((xq.shape[0], (g1 - g0) * lanes), np.float32)         # [M, its groups' rows]
        serial(mode=given, x=x, nw=_EMPTY1, eps=0.0, xq=xq, xd=xd, xs=xs, xc=xc, qs=qs[g0:g1],
               scale=scale[g0:g1], minv=minv[g0:g1] if minv.shape[0] == qs.shape[0] else minv, out=part)
        n = max(min(g1 * lanes, rows) - g0 * lanes, 0)                         # its real rows
        out[:, g0 * lanes:g0 * lanes + n] = part[:, :n]
    return run


@njit(cache=True)
def group_bytes(qs, scale, minv) -> int:
    """Bytes one interleaved group of a packed weight reads: its row of each plane (``minv`` where it has
    one, i.e. as many rows as ``qs``)."""
    return qs.strides[0] + scale.strides[0] + (minv.strides[0] if minv.shape[0] == qs.shape[0] else 0)


@njit(cache=True)
def share(start, per, n, lo, hi) -> tuple:
    """(g0, g1): the groups g0 .. g1 - 1 of a row group of ``n`` interleaved groups of ``per`` bytes, its
    first at byte ``start`` of the matmul, whose first byte lies in [lo, hi). Bytes [0, total) cut at
    ascending points give each group to exactly one part."""
    per = max(per, 1)                                        # (every group reads bytes: a guard)
    return (min(max(-((start - lo) // per), 0), n), min(max(-((start - hi) // per), 0), n))


def _drive_pieces(w_type):
    """:func:`_drive` for a tuple of two or three row groups: the activations made once; on one thread each
    group's serial drivers in turn; on more, one parallel region in which thread t of T runs every group's
    interleaved groups whose first byte lies in [total t / T, total (t + 1) / T) of the groups' bytes
    (one region where each group had its own: docs/PERF.md). The bits are the same either way."""
    n = len(w_type.types)
    if n not in (2, 3):
        raise TypeError(f"the compiled layer takes a matrix in 2 or 3 row groups (got {n})")
    acts_serial, acts_parallel = qmatmul.activations_for
    runs = [_piece(t) for t in w_type.types] + [None] * (3 - n)
    r0, r1, r2 = runs
    three = n == 3

    # (a parallel region takes arrays and numbers, not the weight tuples: hence the planes one by one)
    @njit(parallel=True)
    def split(x, xq, xd, xs, xc, out, qs0, sc0, mn0, n0, qs1, sc1, mn1, n1, qs2, sc2, mn2, n2):
        p0, p1, p2 = group_bytes(qs0, sc0, mn0), group_bytes(qs1, sc1, mn1), group_bytes(qs2, sc2, mn2)
        G0, G1, G2 = qs0.shape[0], qs1.shape[0], qs2.shape[0] if three else 0
        a, b = n0, n0 + n1
        c = b + n2 if three else b
        s1 = G0 * p0
        s2 = s1 + G1 * p1
        total = s2 + G2 * p2
        T = kernel_thread_count()
        for t in prange(T):                                  # T parts: one a thread (a static schedule)
            lo, hi = total * t // T, total * (t + 1) // T
            g0, g1 = share(0, p0, G0, lo, hi)
            r0(x, xq, xd, xs, xc, qs0, sc0, mn0, n0, g0, g1, out[:, :a])
            g0, g1 = share(s1, p1, G1, lo, hi)
            r1(x, xq, xd, xs, xc, qs1, sc1, mn1, n1, g0, g1, out[:, a:b])
            if three:
                g0, g1 = share(s2, p2, G2, lo, hi)
                r2(x, xq, xd, xs, xc, qs2, sc2, mn2, n2, g0, g1, out[:, b:c])

    @njit
    def drive(mode, x, nw, eps, w, one_thread):
        w0, w1 = w[0], w[1]
        w2 = w[2] if three else w[1]
        a, b = w0[3], w0[3] + w1[3]
        c = b + w2[3] if three else b
        if one_thread is None or one_thread:                 # (None: pruned when typed, see Step)
            xq, xd, xs, xc = acts_serial(mode, x, nw, eps)
            out = np.empty((x.shape[0], c), np.float32)
            r0(x, xq, xd, xs, xc, w0[0], w0[1], w0[2], w0[3], 0, w0[0].shape[0], out[:, :a])
            r1(x, xq, xd, xs, xc, w1[0], w1[1], w1[2], w1[3], 0, w1[0].shape[0], out[:, a:b])
            if three:
                r2(x, xq, xd, xs, xc, w2[0], w2[1], w2[2], w2[3], 0, w2[0].shape[0], out[:, b:c])
        else:
            xq, xd, xs, xc = acts_parallel(mode, x, nw, eps)
            out = np.empty((x.shape[0], c), np.float32)
            split(x=x, xq=xq, xd=xd, xs=xs, xc=xc, out=out, qs0=w0[0], sc0=w0[1], mn0=w0[2], n0=w0[3],
                  qs1=w1[0], sc1=w1[1], mn1=w1[2], n1=w1[3], qs2=w2[0], sc2=w2[1], mn2=w2[2], n2=w2[3])
        return out
    return drive


def _matmul(w_type):
    """The compiled ``x @ W.T`` (any driver mode) of a weight tuple of Numba type ``w_type`` (:func:`_drive`).
    On a ragged step only the step's real rows go through the drivers (gathered, then scattered back; the
    other rows of the result are 0 and never read): a row's result depends on that row alone (batch
    invariance, :mod:`streamattn.quant.matmul`), so the real rows get the bits they get with every row
    computed."""
    drive = _drive(w_type)

    @njit
    def run(mode, x, nw, eps, w, step):
        real = step.real
        if real.shape[0] == x.shape[0]:
            return drive(mode, x, nw, eps, w, step.serial)
        xr = np.empty((real.shape[0], x.shape[1]), np.float32)          # [n, K]: the real rows
        for i in range(real.shape[0]):
            xr[i] = x[real[i]]
        o = drive(mode, xr, nw, eps, w, step.serial)                     # [n, N]
        out = np.zeros((x.shape[0], o.shape[1]), np.float32)            # [B*T, N]
        for i in range(real.shape[0]):
            out[real[i]] = o[i]
        return out
    return run


@overload(layer.norm_linear)
def _norm_linear(x, norm_w, w, at):
    run = _matmul(w)

    def impl(x, norm_w, w, at):
        return run(np.int64(NORM), x, norm_w, at[0].eps, w, at[2])
    return impl


@overload(layer.linear)
def _linear(x, w, at):
    run = _matmul(w)

    def impl(x, w, at):
        return run(np.int64(PLAIN), x, _EMPTY1, 0.0, w, at[2])
    return impl


@overload(layer.glu_linear)
def _glu_linear(gu, w, at):
    run = _matmul(w)

    def impl(gu, w, at):
        return run(np.int64(GELU if at[0].gelu else SILU), gu, _EMPTY1, 0.0, w, at[2])
    return impl


@overload(layer.heads_rope)
def _heads_rope(h, qk_norm, at):
    def impl(h, qk_norm, at):
        cfg, step = at[0], at[2]
        return _heads(h, step.cos, step.sin, cfg.neox, qk_norm, cfg.eps32, step.B, cfg.H, cfg.Hk, step.serial)
    return impl


@njit(cache=True)
def _heads(h, cos, sin, neox, qk_norm, eps, B, H, Hk, serial):
    """The heads/RoPE kernel of a step: one thread where ``serial`` (None: decided when typed, see Step) or
    the step is under 32 rows."""
    if serial is None or serial or h.shape[0] < 32:
        return heads_rope_alloc(h, cos, sin, neox, qk_norm, eps, B, H, Hk)
    return heads_rope_rows_parallel(h, cos, sin, neox, qk_norm, eps, B, H, Hk)


@overload(layer.bias)
def _bias(x, b, at):
    def impl(x, b, at):
        return x if b.shape[0] == 0 else x + b     # rows [M, n] + [n]: numpy's float32 adds, the same bits
    return impl


@overload(layer.residual)
def _residual(x, y, norm_w, at):
    def impl(x, y, norm_w, at):
        if norm_w.shape[0] == 0:
            x += y
        else:
            x += rms_norm(y, norm_w, at[0].eps32)
    return impl


@njit(cache=True)
def rms_norm(x, w, eps):
    """The array ops' ``rms_norm`` of rows x [M, n], row by row in the same float32 steps."""
    out = np.empty_like(x)
    sq = np.empty(x.shape[1], np.float32)
    for m in range(x.shape[0]):
        rms_row(x[m], w, eps, sq, out[m])
    return out


@intrinsic
def _half_bits(typingctx, x):
    """float32 -> the float16 bits of its round-to-nearest-even (LLVM fptrunc: vcvtps2ph), as uint16."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


def _staging_kernels(items):
    """:func:`stored_16` and :func:`heads_to_rows` with their outer loop ``items`` (``range``, or ``prange``
    for a prompt chunk on several threads; every element is computed alone: the same bits)."""

    def stored_16(x, kind):
        """float32 x -> the 16-bit patterns ``storage.to_storage`` stores (``kind`` as cpu.KIND): float16
        rounded to nearest even (1; numpy's vector cast is the same instruction, so the same bits, except
        that a NaN's payload may differ where numpy casts a remainder in scalar code: a NaN either way),
        or bfloat16 rounded to nearest even (2, as to_storage's integer steps)."""
        flat = x.ravel()
        out = np.empty(flat.size, np.uint16)
        u = flat.view(np.uint32)
        n = flat.size
        for p in items((n + 1023) // 1024):
            for i in range(1024 * p, min(n, 1024 * p + 1024)):
                if kind == 2:
                    b = np.int64(u[i])
                    if (b & 0x7FFFFFFF) > 0x7F800000:      # NaN: quiet, sign kept (to_storage's rule)
                        out[i] = (b >> 16) | 0x40
                    else:
                        out[i] = ((b + ((b >> 16) & 1) + 0x7FFF) & 0xFFFFFFFF) >> 16
                else:
                    out[i] = _half_bits(flat[i])
        return out.reshape(x.shape)

    def heads_to_rows(out, lse):
        """Attention out [B, H, T, D] -> rows [B*T, H*D] (the heads side by side per token), NaN on a row
        whose lse is not finite (the NaN rule of dispatch._poison_non_finite)."""
        B, H, T, D = out.shape
        rows = np.empty((B * T, H * D), np.float32)
        for bh in items(B * H):
            b, h = bh // H, bh % H
            for t in range(T):
                bad = not np.isfinite(lse[b, h, t])
                for d in range(D):
                    rows[b * T + t, h * D + d] = np.nan if bad else out[b, h, t, d]
        return rows
    return stored_16, heads_to_rows


stored_16, heads_to_rows = (njit(cache=True)(variant(f, "serial")) for f in _staging_kernels(range))
stored_16_parallel, heads_to_rows_parallel = (njit(parallel=True, cache=True)(variant(f, "parallel"))
                                              for f in _staging_kernels(prange))


#: Rows per work item of :func:`stored_quantized_parallel` (a prompt chunk's rows of a kv head in pieces).
STAGE_ROWS = 16


def _quantized_kernel(items):
    """:func:`stored_quantized` with its work items (sequence, kv head, piece of STAGE_ROWS rows) in
    ``items``: ``range`` or ``prange``. Every row is quantized (and recoded) by the same row-wise
    functions, so pieces and threads give the same bytes."""

    def stored_quantized(x, width, q4, counts, rounding, search, queries=None):
        """float32 x [B, H, T, D] -> the q8_0 (or q4_0 when ``q4``) rows ``storage.to_storage`` stores, uint8
        [B, H, T, width]: :func:`streamattn.kv.storage.quantize_rows` over each sequence's counts[b] real rows
        (:func:`streamattn.kv.storage.quantize_rows_fed` with rounding[h] when ``rounding`` has rows; the q4_0
        scales searched when ``search``, and with ``queries`` [B, Hq, T, D] the codes then rounded for each
        row's own query group, :func:`streamattn.kv.storage.recode_for_queries`), the same function on the same
        float32 values, so the same bytes (the padding rows are left unset: nothing reads or writes them)."""
        B, H, T, D = x.shape
        out = np.empty((B, H, T, width), np.uint8)
        pieces = (T + STAGE_ROWS - 1) // STAGE_ROWS
        for item in items(B * H * pieces):
            b, h, p = item // (H * pieces), (item // pieces) % H, item % pieces
            lo, hi = p * STAGE_ROWS, min(counts[b], (p + 1) * STAGE_ROWS)
            if lo >= hi:
                continue
            if rounding.shape[0]:
                quantize_rows_fed(x[b, h, lo:hi], out[b, h, lo:hi], q4, rounding[h])
            else:
                quantize_rows(x[b, h, lo:hi], out[b, h, lo:hi], q4, search)
                if queries is not None and search and q4:
                    G = queries.shape[1] // H
                    recode_for_queries(x[b, h, lo:hi], queries[b, h * G:(h + 1) * G, lo:hi], out[b, h, lo:hi])
        return out
    return stored_quantized


stored_quantized = njit(cache=True)(variant(_quantized_kernel(range), "serial"))
stored_quantized_parallel = njit(parallel=True, cache=True)(variant(_quantized_kernel(prange), "parallel"))


# K or V of a step as stored, by the storage's bits (x: float32 [B, Hk, T, D]; kind: cpu.KIND; width: the
# storage row's elements; serial: Step.serial, and a step of under 32 rows stays on one thread too;
# rounding: Kv.vround or an empty one; search: Kv.ksearch for K, False for V; queries: the step's queries
# in the keys' frame, for K's q4_0 codes): float32 as it is, 16-bit patterns, or quantized rows.
@njit(cache=True)
def _stage_32(x, kind, width, counts, serial, rounding, search, queries):
    return x.view(np.uint32)


@njit(cache=True)
def _stage_16(x, kind, width, counts, serial, rounding, search, queries):
    if serial is None or serial or x.shape[0] * x.shape[2] < 32:
        return stored_16(x, kind)
    return stored_16_parallel(x, kind)


@njit(cache=True)
def _stage_quantized(x, kind, width, counts, serial, rounding, search, queries):
    if serial is None or serial or x.shape[0] * x.shape[2] < 32:
        return stored_quantized(x, width, kind == 4, counts, rounding, search, queries)
    return stored_quantized_parallel(x, width, kind == 4, counts, rounding, search, queries)


@njit(cache=True)
def _rows(out, lse, serial):
    """heads_to_rows of out [B, H, T, D], on one thread where ``serial`` or the step is under 32 rows."""
    if serial is None or serial or out.shape[0] * out.shape[2] < 32:
        return heads_to_rows(out, lse)
    return heads_to_rows_parallel(out, lse)


@njit(cache=True)
def _refuses(kv, counts):
    """Whether the array layer would grow the cache or refuse a chunk of counts[b] tokens for sequence b
    (int64 [B], each in 0..T) before writing (max_chunk, max_len), or refuse it after (a window ring that
    could not answer its queries)."""
    for b in range(kv.lengths.shape[0]):
        T = counts[b]
        if kv.window > 0 and T > kv.max_chunk:
            return True
        L = kv.lengths[b] + T
        if kv.window == 0 and (L > kv.kst.shape[2] or (kv.max_len > 0 and L > kv.max_len)):
            return True
        if kv.window > 0:                        # cache.answerable() after the write
            held = max(kv.held_from[b], L - kv.ring)
            if held > kv.sinks and T > min(max(L - held - kv.window + 1, 0), L):
                return True
    return False


def _stage(x, st, kind, counts, serial, rounding, search, queries):
    """K or V of a step as stored in ``st`` (the storage, viewed as its bits), by their element type:
    :func:`_stage_32`, :func:`_stage_16` or :func:`_stage_quantized`, chosen when typed."""


@overload(_stage)
def _stage_by_bits(x, st, kind, counts, serial, rounding, search, queries):
    fn = {types.uint32: _stage_32, types.uint16: _stage_16, types.uint8: _stage_quantized}[st.dtype]

    def impl(x, st, kind, counts, serial, rounding, search, queries):
        return fn(x, kind, st.shape[3], counts, serial, rounding, search, queries)
    return impl


#: Each storage's element as written (bits) and as the attention reads it, by cpu.KIND; and the name of
#: its class: float32, 16-bit patterns, quantized rows.
_READS = {0: ("32", np.uint32, np.float32), 1: ("16", np.uint16, np.uint16), 2: ("16", np.uint16, np.uint16),
          3: ("q", np.uint8, np.uint8), 4: ("q", np.uint8, np.uint8)}


def _attend_kernel(k_class: str, v_class: str):
    """:func:`attend_stored` for K stored as ``k_class`` and V as ``v_class`` (names of :data:`_READS`).
    It holds only dtypes: Numba keys a closure's cache files on its variables' pickled bytes, and a
    dispatcher pickles differently in every process, so one held here would never be loaded."""
    (_, k_bits, k_read), (_, v_bits, v_read) = (next(r for r in _READS.values() if r[0] == c)
                                                for c in (k_class, v_class))

    def attend_stored(q, k, v, kv, scale, softcap, counts, status, serial):
        """The attend op of the compiled layer: stage the step's K and V (float32 [B, Hk, T, D]) as the cache
        stores them, write them (refused whole if not finite: status[0] = 1, NaN rows), attend q (float32
        [B, H, T, D]) over the ring; the heads' outputs as rows [B*T, H*D]. ``kv``: a :class:`Kv`, its
        storage as bytes, viewed here as this copy's types; ``scale``, ``softcap``: :class:`Cfg`'s;
        ``counts``, ``status``, ``serial``: :class:`Step`'s."""
        B, Hk, T, D = k.shape
        kst, vst = kv.kst.view(k_bits), kv.vst.view(v_bits)     # [B, Hk, slots, D or row bytes] as written
        if kv.rotate:                                 # streamattn.kv.rotation: keys stored, queries scored as x @ H
            k, q = rotate_rows(np.ascontiguousarray(k)), rotate_rows(np.ascontiguousarray(q))
        ks = _stage(k, kst, kv.kind, counts, serial, _NO_ROUNDING, kv.ksearch, q)
        vs = _stage(v, vst, kv.kind_v, counts, serial, kv.vround, False, q)
        refused = kv.check and kv.mixed and (first_not_finite(ks, counts, kv.kind, kv.expbits) >= 0
                                             or first_not_finite(vs, counts, kv.kind_v, kv.expbits_v) >= 0)
        if refused or write_rows(kst, vst, ks, vs, kv.lengths, counts, kv.last_counts, kv.held_from, kv.sinks,
                                 kv.ring, kv.window > 0, kv.check and not kv.mixed, kv.expbits) >= 0:
            status[0] = 1                             # not finite as stored: nothing written (see run_layer)
            return np.full((B * T, q.shape[1] * D), np.nan, np.float32)
        qs = q * np.float32(scale)
        out, lse = cpu.attend_all(qs, qs, kv.kst.view(k_read), kv.vst.view(v_read), kv.lengths, counts, kv.window,
                                  kv.sinks, kv.kind, kv.kind_v, softcap, serial)
        return _rows(out, lse, serial)
    return attend_stored


#: attend_stored for each pair of K and V storage classes, each copy under its own name.
ATTENDS = {(kc, vc): njit(cache=True)(variant(_attend_kernel(kc, vc), f"k{kc}_v{vc}"))
           for kc in ("32", "16", "q") for vc in ("32", "16", "q")}
#: The types of q, k, v in the attend op (heads_rope's arrays), and of its result.
_HEADS = types.Array(types.float32, 4, "C")
_OUT_ROWS = types.Array(types.float32, 2, "C")


def _attend_types(kv_type, scale_type, softcap_type, counts_type, status_type, serial_type) -> tuple:
    return (_HEADS, _HEADS, _HEADS, kv_type, scale_type, softcap_type, counts_type, status_type, serial_type)


def _types_code(argtypes) -> int:
    """A number for a tuple of Numba types, the same in every process (their names' CRC-32)."""
    return zlib.crc32("|".join(map(str, argtypes)).encode())


@njit(cache=True)
def _storage_pair(kind, kind_v):
    """0..8 for the pair of K's and V's storage classes (cpu.KIND: float32; float16 or bfloat16; quantized)."""
    return (0 if kind == 0 else 1 if kind <= 2 else 2) * 3 + (0 if kind_v == 0 else 1 if kind_v <= 2 else 2)


@intrinsic
def _attend_code(typingctx, kv, scale, softcap, counts, status, serial):
    """The :func:`_types_code` of the attend op's argument types, as a constant."""
    code = _types_code(_attend_types(kv, scale, softcap, counts, status, serial))

    def codegen(context, builder, signature, args):
        return context.get_constant(types.int64, code)
    return types.int64(kv, scale, softcap, counts, status, serial), codegen


@intrinsic
def _call_attend(typingctx, address, q, k, v, kv, scale, softcap, counts, status, serial):
    """Call the compiled function at ``address`` (Numba's own calling convention) on the other arguments:
    the :data:`ATTENDS` copy that :meth:`CompiledLayers.bound` compiled for these argument types (checked
    first: :func:`run_layer`). A call through an address, rather than to a function Numba links in, keeps
    the cache's storage out of the layer's compiled code (docs/DESIGN.md §15)."""
    argtypes = (q, k, v, kv, scale, softcap, counts, status, serial)
    if (q, k, v) != (_HEADS,) * 3:
        raise TypeError(f"the attend op takes q, k, v as {_HEADS} (got {q}, {k}, {v})")

    def codegen(context, builder, signature, args):
        fnty = context.call_conv.get_function_type(_OUT_ROWS, argtypes)
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        status_, res = context.call_conv.call_function(builder, fn, _OUT_ROWS, argtypes, args[1:])
        with cgutils.if_unlikely(builder, status_.is_error):
            context.call_conv.return_status_propagate(builder, status_)
        return res
    return _OUT_ROWS(address, *argtypes), codegen


@overload(layer.attend)
def _attend(q, k, v, at):
    def impl(q, k, v, at):
        cfg, kv, step = at
        return _call_attend(kv.attend, q, k, v, kv, cfg.scale, cfg.softcap, step.counts, step.status, step.serial)
    return impl


#: The compiled layer (one specialization per block kinds: the model's sizes and the cache's storage and
#: geometry are values in ``at``), inlined into :func:`run_layer` as Numba IR: compiled on its own, its whole module
#: was optimized once for it and again inside run_layer's (measured: docs/perf/2026-12-05.md).
compiled_layer = njit(cache=True, inline="always")(layer.decoder_layer)


@njit(cache=True, nogil=True)
def run_layer(x, w, at):
    """:data:`compiled_layer` where it finishes as the array layer would, else nothing: False, with x and
    the cache as they were. The cache's checks that come before a write run first (:func:`_refuses`); a
    chunk refused as not finite (found inside, after the projections) leaves its mark in ``status`` and
    x is put back. (No exception leaves the layer: Numba does not free the arrays a raising function
    holds, ~2 MB a layer in a prefill chunk.) A Kv whose attend copy was compiled for other types than
    this call's does nothing either, with status 2 (:meth:`CompiledLayers.run` binds it again)."""
    cfg, kv, step = at
    if kv.code != _attend_code(kv, cfg.scale, cfg.softcap, step.counts, step.status, step.serial) * 9 \
            + _storage_pair(kv.kind, kv.kind_v):
        step.status[0] = 2
        return False
    step.status[0] = 0
    if _refuses(kv, step.counts):
        return False
    saved = x.copy() if kv.check else x[:0]
    compiled_layer(x, w, at)
    if step.status[0] != 0:
        x[:] = saved
        return False
    return True


def _matrix(w, plan: qmatmul.KernelPlan):
    """A packed integer weight as the compiled ops' tuple, its drivers chosen by ``plan`` (row groups of
    different kinds: a tuple of two or three such tuples), or None for anything else (float weights, a CPU
    or plan the kernels do not run on)."""
    if isinstance(w, tuple):
        parts = tuple(_matrix(p, plan) for p in w)
        return parts if len(parts) in (2, 3) and None not in parts and not any(map(_grouped, parts)) else None
    if not (qmatmul.HAVE_KERNELS and isinstance(w, qmatmul.QWeight) and w.kind in _KINDS and w.lanes in _LANES
            and w.lanes <= plan.lanes and w.group in _GROUPS):
        return None
    return (w.qs, w.scale, _EMPTY2 if w.minv is None else w.minv, w.shape[0],
            _tag(w.kind, w.group, w.lanes, plan.rows, plan.vnni, plan.amx))


def _grouped(m) -> bool:
    return isinstance(m[0], tuple)


def bind_weights(lw: LayerWeights, plan: qmatmul.KernelPlan | None = None):
    """A layer's weights as the compiled layer takes them under ``plan`` (default ``KernelPlan()``), or None
    where a matrix is not a packed integer weight (that layer stays array code)."""
    plan = qmatmul.KernelPlan() if plan is None else plan
    mats = {name: _matrix(getattr(lw, name), plan) for name in ("wqkv", "wo", "wgu", "wdown")}
    if any(m is None for m in mats.values()):
        return None
    _vector = lambda a, empty: empty if a is None else np.ascontiguousarray(a, np.float32)  # noqa: E731
    return Weights(attn_norm=_vector(lw.attn_norm, _EMPTY1), ffn_norm=_vector(lw.ffn_norm, _EMPTY1),
                   qk_norm=_vector(lw.qk_norm, heads_kernel.NO_NORM),
                   post_attn_norm=_vector(lw.post_attn_norm, _EMPTY1[:0]),
                   post_ffw_norm=_vector(lw.post_ffw_norm, _EMPTY1[:0]), bqkv=_vector(lw.bqkv, _EMPTY1[:0]),
                   **mats)


def _cache_sources(cache) -> tuple:
    return cache.k, cache.v, cache.lengths, cache.last_counts, cache.held_from


def bind_cache(cache, vround=None, ksearch=False) -> Kv:
    """The :class:`Kv` of a CPU cache (views of its arrays, its geometry; no attend copy bound); ``vround``:
    its layer's ``Transformer.value_rounding`` (None: V rounded to nearest); ``ksearch``:
    ``Transformer.key_search``."""
    spec = cache.spec
    return Kv(bits(cache.k).view(np.uint8), bits(cache.v).view(np.uint8), cache.lengths, cache.last_counts,
              cache.held_from, spec.sinks, cache.ring, spec.window or 0, spec.max_chunk, spec.max_len or 0,
              spec.check_finite, EXPONENT_BITS.get(spec.dtype, 0), cpu.KIND[spec.dtype], cpu.KIND[spec.v_dtype],
              EXPONENT_BITS.get(spec.v_dtype, 0), spec.dtype_v is not None or spec.dtype in QUANTIZED,
              bool(spec.rotate_k), _NO_ROUNDING if vround is None else vround, bool(ksearch), 0, 0)


def attend_address(argtypes: tuple, storages: tuple) -> int:
    """The address of the :data:`ATTENDS` copy for ``storages`` (K's and V's cpu.KIND) compiled, or loaded
    from Numba's disk cache, for ``argtypes`` (:func:`_attend_types`): the only code that differs between
    storages, compiled apart from the layer (docs/DESIGN.md §15)."""
    fn = ATTENDS[_READS[storages[0]][0], _READS[storages[1]][0]]
    fn.compile(argtypes)
    result = fn.overloads[argtypes]
    if result.signature.return_type != _OUT_ROWS:
        raise TypeError(f"attend_stored returned {result.signature.return_type} for {argtypes}; expected {_OUT_ROWS}")
    return result.library.get_pointer_to_function(result.fndesc.llvm_func_name)


class CompiledLayers:
    """A Transformer's layers as compiled calls under its :class:`~streamattn.quant.matmul.KernelPlan`:
    its numbers and each layer's weights bound once (None for a layer that stays array code, bound again
    when any of its weights or planes was replaced), and each cache's :class:`Kv` kept here (made again
    when any of its arrays was replaced: a grown ring, a restored state; dropped with the cache);
    :meth:`run` runs one layer."""

    step = Step

    def __init__(self, tf):
        c = tf.config
        self.cfg = Cfg(c.n_heads, c.n_kv_heads, float(c.norm_eps), np.float32(c.norm_eps), c.rope_style == "neox",
                       float(c.attn_scale), c.activation == "gelu_tanh",
                       None if c.attn_softcap is None else np.float32(c.attn_softcap))
        self.plan = tf.plan                         # the drivers the weights' tags name
        self.layers = tf.layers
        self.sources = [_sources(lw) for lw in tf.layers]
        self.weights = [bind_weights(lw, self.plan) for lw in tf.layers]
        self.caches = {}                            # id(cache) -> [weakref to it, its arrays bound, Kv]
        self.attends = {}                           # (attend op's argument types, storage pair) -> (address, code)
        self.value_rounding, self.key_search = tf.value_rounding, tf.key_search

    def kv(self, cache, vround=None) -> Kv:
        """The cache's :class:`Kv` (V rounded with ``vround``, K as ``Transformer.key_search`` says for its
        spec), bound now if it was not or any of its arrays (or ``vround``) was replaced."""
        b = self.caches.get(id(cache))   # an entry is this cache's: one of a cache that is gone has left
        src = _cache_sources(cache) + (vround,)
        if b is None or not all(map(operator.is_, b[1], src)):
            key, table = id(cache), self.caches
            b = [weakref.ref(cache, lambda _, key=key: table.pop(key, None)), src,
                 bind_cache(cache, vround, self.key_search(cache.spec))]
            table[key] = b
        return b[2]

    def bound(self, cache, vround, step: Step, again: bool = False) -> Kv:
        """:meth:`kv` with its attend copy bound (:func:`attend_address`) for the types of ``step``'s
        fields; ``again``: bound anew (a step of other types than the last)."""
        kv = self.kv(cache, vround)
        if kv.attend and not again:
            return kv
        argtypes = _attend_types(*map(typeof, (kv, self.cfg.scale, self.cfg.softcap, step.counts, step.status,
                                               step.serial)))
        key = argtypes, _storage_pair(kv.kind, kv.kind_v)
        if key not in self.attends:
            self.attends[key] = attend_address(argtypes, (kv.kind, kv.kind_v)), _types_code(argtypes) * 9 + key[1]
        address, code = self.attends[key]
        kv = kv._replace(attend=address, code=code)
        self.caches[id(cache)][2] = kv
        return kv

    def accepts(self, caches: list, T: int) -> bool:
        """Whether every layer's cache takes a chunk of T more tokens of its one sequence: a causal ring
        too small for it is grown first (as :meth:`run` grows it), unless some cache refuses the chunk
        (max_len, a window that could not answer it), which then changes nothing. ``Transformer._wavefront``
        runs only where this holds, so that a refused chunk fails before any block is written."""
        if any(c.xp is not np for c in caches):      # (run hands such a layer to the array code)
            return False
        counts = np.array([T], np.int64)

        def refuses(i, c):
            return _refuses(self.kv(c, self.value_rounding(i, c.spec)), counts)
        need = [int((c.lengths + T).max()) for c in caches]
        small = [not c.spec.window and n > c.slots for c, n in zip(caches, need)]
        if any(refuses(i, c) for i, c in enumerate(caches) if not small[i]):
            return False
        if any(s and (c.view_of is not None or (c.spec.max_len is not None and n > c.spec.max_len))
               for c, n, s in zip(caches, need, small)):
            return False                              # one could not grow: grow none
        for c, s in zip(caches, small):
            if s:
                self._grow(c, counts)
        return not any(refuses(i, c) for i, c in enumerate(caches) if small[i])   # the others: checked above

    def run(self, i: int, x, cache, step: Step) -> bool:
        """Layer i on the residual rows x [B*T, d] (float32, in place) and its CPU cache; False where it
        did nothing and the array layer must run it (see the module docstring)."""
        src = _sources(self.layers[i])
        if not all(map(operator.is_, src, self.sources[i])):
            self.sources[i], self.weights[i] = src, bind_weights(self.layers[i], self.plan)
        w = self.weights[i]
        if w is None or cache.xp is not np:
            return False
        vround = self.value_rounding(i, cache.spec)
        kv = self.kv(cache, vround)
        if not kv.attend:
            kv = self.bound(cache, vround, step)
        if run_layer(x, w, (self.cfg, kv, step)) or self._again(x, w, cache, vround, step):
            return True
        if kv.window:
            return False
        old = cache.k, cache.v
        if not self._grow(cache, step.counts):
            return False
        if run_layer(x, w, (self.cfg, self.bound(cache, vround, step), step)) \
                or self._again(x, w, cache, vround, step):
            return True
        cache.k, cache.v = old                       # refused as not finite: the ring as it was (and its
        self.caches.pop(id(cache), None)             # contents, which write_rows left untouched)
        return False

    def _again(self, x, w, cache, vround, step: Step) -> bool:
        """After :func:`run_layer` did nothing: where that was because its attend copy was bound for other
        types than this step's (status 2), bind it again and run the layer again."""
        if step.status[0] != 2:
            return False
        if run_layer(x, w, (self.cfg, self.bound(cache, vround, step, again=True), step)):
            return True
        if step.status[0] == 2:
            raise RuntimeError("the compiled attend op was bound for other argument types than the layer "
                               "passes it (streamattn.models.compiled.CompiledLayers.bound)")
        return False

    @staticmethod
    def _grow(cache, counts) -> bool:
        """Grow a causal cache for counts[b] more tokens of each sequence b here (as the array layer would,
        by doubling) rather than hand the layer back; False where that is not the reason or the cache
        cannot (a head() view)."""
        need = int((cache.lengths + counts).max())
        if need <= cache.slots or (cache.spec.max_len is not None and need > cache.spec.max_len) \
                or cache.view_of is not None:
            return False
        cache.reserve(need)
        return True


def _sources(lw: LayerWeights) -> tuple:
    """What a layer's binding was made from: its weights and their planes (compared by identity)."""
    out = []
    for f in vars(lw).values():
        out.append(f)
        if isinstance(f, qmatmul.QWeight):
            out += (f.qs, f.scale, f.minv)
    return tuple(out)
