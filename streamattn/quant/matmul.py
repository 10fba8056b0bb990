"""``x @ W.T`` on packed GGUF weights (:mod:`streamattn.quant.weights`): quantized activations, drivers.

Route (ggml's): each activation row is quantized once per matmul to int8 per 32 columns (scale ``xd``
and ``xs = xd * sum(q)``, llama.cpp's Q8_1; :mod:`streamattn.quant.activations`), then every block of a
weight row is one exact integer dot product, turned to float and added with one FMA by ``scale * xd``
(the IR kernels and their contract are in :mod:`streamattn.quant.kernels`). Float kinds
(F32/F16/BF16) take float32 activations as they are and a 16-lane FMA per chunk.

A packed weight's rows come in interleaved groups of :data:`~streamattn.quant.kernels.LANES`
(one vector lane per row). Groups are the outer loop (split over threads); for each, the activation
rows go in groups of ``rows`` (:class:`KernelPlan`) through a kernel that unpacks each weight block once
for the whole group, then the remainder (fewer rows) through one kernel of its size; the kernel that
reads a group's weights first also prefetches them :data:`PREFETCH_BYTES` ahead (the kinds of
:data:`NO_PREFETCH`: :data:`MULTI_ROW_PREFETCH_BYTES`, and not at all with one row). A group's weights
are read from memory once and stay in L1/L2 for every activation row of the call (prefill chunks and
decode batches).

Batch invariance: an output element ``out[b, r]`` is always the same function of row ``r`` and
activation row ``b`` alone — the blocks in column order into one float accumulator, whatever group
of rows either sat in (streamattn.quant.kernels says why). Threads split weight groups, never a reduction, so a
sequence's logits are bit-identical alone or in any batch, with any thread count.

The integer instructions are x86 AVX2 (also present on every AVX-512 CPU); :data:`HAVE_KERNELS` says
whether this CPU has them, and ``load_gguf(path, weights="f32")`` is the path for others.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from streamattn.runtime import cpu_target, kernel_cache, llvm_ir
from streamattn.runtime.kernel_cache import variant
from streamattn.quant import activations, kernels, levels
from streamattn.quant import amx as amx_kernels
from streamattn.quant.activations import (glu_quantize_rows, glu_quantize_rows_parallel, norm_quantize_rows,  # noqa: F401
                                      norm_quantize_rows_parallel, quantize_rows)
from streamattn.quant.kernels import LANES, LANES_VNNI, make_fdot_rows, make_qdot
from streamattn.quant.weights import QWeight
from streamattn.runtime.threads import many_threads

kernel_cache.register(__name__, depends_on=[activations, amx_kernels, kernels, levels, llvm_ir])  # the IR they inline

#: Activation rows per weight-block unpacking of the default :class:`KernelPlan` (measured: docs/PERF.md).
#: Results do not depend on it.
ROWS = 8 if LANES == 16 else 4
GROUP_ROWS = (1, 2, 4, 8)
#: How far ahead of the weights being read the one-row kernel prefetches (measured: docs/PERF.md; the
#: hardware prefetcher alone left a decode step's weight reads well under a plain read's). Not a multiple
#: of 4 KiB: exactly one page ahead read slower (measured: docs/perf/2026-12-05.md). Read when a weight
#: kind's drivers are first built (:func:`qdrivers` is cached).
PREFETCH_BYTES = 3584
#: Kinds whose one-row kernels do not prefetch PREFETCH_BYTES ahead: "q6k" and "q4k" read each row group's
#: blocks forwards (their words in the order the kernel first takes them), which the hardware prefetcher
#: follows within a page; PREFETCH_BYTES ahead made their one-row GEMV slower on the 16-lane route
#: (measured: docs/PERF.md). What they do instead: :data:`ONE_ROW_PREFETCH_BYTES`, :data:`TOUCH_BYTES`.
NO_PREFETCH = ("q6k", "q4k")
#: How far ahead the one-row kernels of these kinds prefetch every line of a group's weights: "q6k" from
#: 4 KiB pages (a file's) read faster with every line this far ahead than with only a line a block
#: touched 16 KiB ahead (measured: docs/PERF.md, section "One-thread K-quant GEMV and a file's 4 KiB pages").
ONE_ROW_PREFETCH_BYTES = {"q6k": 32768}
#: How far ahead the multi-row kernels of the :data:`NO_PREFETCH` kinds prefetch a group's weights on its first
#: pass: with 2-8 activation rows a block takes several times the one-row kernel's instructions, and without
#: prefetching a pass read from memory at half the one-row rate or less; about ten 128-column units ahead it
#: runs near the one-row time (measured: docs/PERF.md).
MULTI_ROW_PREFETCH_BYTES = 16384
#: How far ahead of each block the one-row kernels of these kinds prefetch one line (``touch`` of
#: :func:`~streamattn.quant.kernels.make_qdot`). Weights mapped from a file sit in 4 KiB pages, and the
#: hardware prefetcher, which follows a group's reads within a page, starts each next page cold: one line
#: a block this far ahead made the one-row Q4_K GEMV from memory faster on such pages, where every line
#: prefetched ahead made it slower (measured: docs/PERF.md, section "One-thread K-quant GEMV and a file's
#: 4 KiB pages"). Read when a weight kind's drivers are first built, as the other distances.
TOUCH_BYTES = {"q4k": 32768}          # a prefetch, never a load: past a buffer's end a load would fault
_FKINDS = {"f32": 0, "f16": 1, "bf16": 2}


HAVE_KERNELS = cpu_target.has("avx2")


@dataclass(frozen=True)
class KernelPlan:
    """Which of the packed-weight kernels a model's matmuls run. Every plan gives the same bits
    (tests/test_quant_kernels.py); a model keeps one for its life (``Transformer(model, plan=...)``).

    Parameters
    ----------
    rows : {1, 2, 4, 8}
        Activation rows per weight-block unpacking (default :data:`ROWS`, measured: docs/PERF.md).
    lanes : {8, 16}
        The widest interleaved row group the kernels take (default: this CPU's vectors,
        :data:`~streamattn.quant.kernels.LANES`); a weight packed wider than this does not run.
    vnni : bool
        Integer dot products by ``vpdpbusd`` (default: where the CPU has it at the kernels' width,
        :data:`~streamattn.quant.kernels.LANES_VNNI`) or by ``vpmaddubsw`` + ``vpmaddwd``.
    amx : bool, optional
        Activation rows in whole 16s (prompt chunks) by AMX tile multiplies; needs ``vnni`` and 16 lanes.
        Default (None): where this CPU and OS allow it (:data:`streamattn.quant.amx.AVAILABLE`) and the
        environment does not say ``STREAMATTN_AMX=0``, with ``vnni`` and 16 lanes. The result is the same.
    """

    rows: int = ROWS
    lanes: int = LANES
    vnni: bool = LANES_VNNI
    amx: bool | None = None

    def __post_init__(self):
        if isinstance(self.rows, bool) or self.rows not in GROUP_ROWS:
            raise ValueError(f"rows must be one of {GROUP_ROWS} (got {self.rows!r})")
        if isinstance(self.lanes, bool) or self.lanes not in (8, 16) or self.lanes > LANES:
            raise ValueError(f"lanes must be 8{' or 16' if LANES == 16 else ''}, this CPU's vector widths "
                             f"(got {self.lanes!r})")
        if not isinstance(self.vnni, bool):
            raise ValueError(f"vnni must be True or False (got {self.vnni!r})")
        if self.vnni and not LANES_VNNI:
            raise ValueError(f"vnni=True needs vpdpbusd at {LANES} lanes (AVX512-VNNI, or AVX-VNNI for 8 lanes); "
                             "this CPU has none")
        if self.amx is None:
            object.__setattr__(self, "amx", amx_kernels.DEFAULT and self.vnni and self.lanes == 16)
        if not isinstance(self.amx, bool):
            raise ValueError(f"amx must be True or False (got {self.amx!r})")
        if self.amx:
            _check_amx(self.vnni, self.lanes)


def _check_amx(vnni: bool, lanes: int = 16) -> None:
    """ValueError unless an ``amx=True`` request can run: AMX usable here, ``vnni`` and 16 lanes."""
    if not (amx_kernels.AVAILABLE and vnni and lanes == 16):
        raise ValueError("amx=True needs AMX-INT8 with the OS's permission for the tile state, vnni=True and "
                         f"lanes=16 (this CPU and OS: AMX {'usable' if amx_kernels.AVAILABLE else 'unusable'}; "
                         f"vnni={vnni}, lanes={lanes})")


@njit(cache=True)
def _lines(rows, cols):
    """uint8 [rows, cols] whose first byte starts a 64-byte cache line (a tile's rows are then whole
    lines; Numba's allocations are only 16-byte aligned, and tile stores across lines made a call's
    time swing from one allocation to the next; measured: docs/perf/2026-12-04.md)."""
    raw = np.empty(rows * cols + 64, np.uint8)
    off = (64 - raw.ctypes.data % 64) % 64
    return raw[off:off + rows * cols].reshape((rows, cols))


def _njit_drivers(loops, tag: str):
    """The serial and the row-parallel driver from one source: ``loops(rows)`` returns the loop over
    weight rows, ``rows`` being ``range`` or ``prange``; ``tag`` names the drivers' variant (each copy
    is compiled under its own name: :func:`streamattn.runtime.kernel_cache.variant`)."""
    return (njit(cache=True)(variant(loops(range), f"{tag}_serial")),
            njit(parallel=True, cache=True)(variant(loops(prange), f"{tag}_parallel")))


#: What a driver quantizes first (its ``mode``): nothing (the activations are given), plain rows, RMSNorm
#: rows, or the gated activation of [g | u] rows (silu, gelu-tanh): :mod:`streamattn.quant.activations`.
GIVEN, PLAIN, NORM, SILU, GELU = -1, 0, 1, 2, 3


def qdrivers(kind: str, group: int, R: int, lanes: int = LANES, vnni: bool = LANES_VNNI, amx: bool = False):
    """:func:`_qdrivers` with ``amx`` kept only where the tile kernels run: 16 lanes, VNNI, AMX usable here
    and a :func:`~streamattn.quant.amx.tiled` kind (so a request that cannot be met shares the vector
    drivers, not a second compiled copy of them)."""
    return _qdrivers(kind, group, R, lanes, vnni,
                     bool(amx and lanes == 16 and vnni and amx_kernels.AVAILABLE and amx_kernels.tiled(kind, group)))


@functools.cache
def _qdrivers(kind: str, group: int, R: int, lanes: int, vnni: bool, amx: bool):
    """Serial and group-parallel drivers ``run(mode, x, nw, eps, xq, xd, xs, xc, qs, scale, minv, out)
    -> out``: unless ``mode`` is GIVEN, first quantize ``x`` (see :data:`GIVEN`; norm weight ``nw``,
    ``eps``) into new activations and a new ``out`` (the arguments are then placeholders); then loop over
    the weight's interleaved groups g: activation rows in groups of R, then the rest (< R rows) in one
    pass of a kernel of its size, out[b, lanes g + n] = dot(qs, scale, minv, g, xq, xd, xs, xc, b).
    ``vnni``: which integer dot product (:func:`~streamattn.quant.kernels.make_qdot`; the same results);
    ``amx``: the rows in whole 16s by tile multiplies first where the kind takes them
    (:func:`streamattn.quant.amx.tiled`; the same results). The kernel that reads a group's weights first
    prefetches them (:data:`PREFETCH_BYTES`, :data:`MULTI_ROW_PREFETCH_BYTES`,
    :data:`ONE_ROW_PREFETCH_BYTES`; the one-row kernels of the kinds of :data:`TOUCH_BYTES` one line a
    block, that far ahead; the R-row kernel's later passes find them in cache), as a decode batch of R
    rows reads them once. Under R = 4 (the AVX2 plan) a decode batch of 8-15 rows takes its first 8 in
    one 8-row pass, then 4 and the rest (faster for that step; prompt chunks keep R = 4, where 8 rows a
    pass measured slower: docs/perf/2026-12-03.md).

    One compiled call for the model's whole ``norm -> quantize -> matmul``: between two such calls a
    decode step streams megabytes of weights, and the Python of a call made of several (numpy buffers,
    two dispatches, lookups) ran with its data evicted (docs/DESIGN.md §23; measured: docs/PERF.md)."""
    def ahead(n):                              # bytes a first pass of n rows prefetches
        if kind not in NO_PREFETCH:
            return PREFETCH_BYTES
        return ONE_ROW_PREFETCH_BYTES.get(kind, 0) if n == 1 else MULTI_ROW_PREFETCH_BYTES

    def touch(n):                              # bytes ahead a kernel of n rows touches one line a block
        return TOUCH_BYTES.get(kind, 0) if n == 1 else 0
    dot_r = make_qdot(kind, group, R, lanes, vnni, 0, touch(R))
    dot_rp = make_qdot(kind, group, R, lanes, vnni, ahead(R), touch(R))    # a group's first R rows
    batch = R == 4                             # decode batches of 8-15 rows: the first 8 in one pass
    n8 = 8 if batch else R
    dot_8p = make_qdot(kind, group, n8, lanes, vnni, ahead(n8), touch(n8))
    dot_4 = make_qdot(kind, group, min(R, 4), lanes, vnni, ahead(min(R, 4)), touch(min(R, 4)))

    def rest(n):                               # the kernel of the last n < R rows (1-row where none is used)
        n = n if n < R else 1
        return make_qdot(kind, group, n, lanes, vnni, ahead(n), touch(n))
    dot_1, dot_2, dot_3, dot_5, dot_6, dot_7 = (rest(n) for n in (1, 2, 3, 5, 6, 7))
    if amx:                                    # (None otherwise: the branch below is pruned, never compiled)
        tiles, dot_t, unpack = (amx_kernels.make_config(), amx_kernels.make_qdot_tiles(kind),
                                amx_kernels.make_unpack(kind))
    else:
        tiles = dot_t = unpack = None
    T, STEPS, CHUNK = amx_kernels.ROWS, amx_kernels.STEP_BYTES, amx_kernels.CHUNK

    def loops(rows):
        split = rows is prange                  # the parallel driver: prompt rows quantized over threads too

        def run(mode, x, nw, eps, xq, xd, xs, xc, qs, scale, minv, out):
            if mode != GIVEN:
                M = x.shape[0]
                K = x.shape[1] // 2 if mode >= SILU else x.shape[1]
                xq = _lines(M, K).view(np.int8)            # (tile loads read its rows)
                xd = np.empty((M, K // 32), np.float32)
                xs = np.empty((M, K // 32), np.float32)
                xc = np.empty((M, K // 16), np.int32)
                pieces = split and M >= activations.SPLIT_ROWS
                if mode == NORM:
                    if pieces:
                        norm_quantize_rows_parallel(x, nw, eps, xq, xd, xs, xc)
                    else:
                        norm_quantize_rows(x, nw, eps, xq, xd, xs, xc)
                elif mode >= SILU:
                    if pieces:
                        glu_quantize_rows_parallel(x, mode == GELU, xq, xd, xs, xc)
                    else:
                        glu_quantize_rows(x, mode == GELU, xq, xd, xs, xc)
                else:
                    quantize_rows(x, xq, xd, xs, xc)
                out = np.empty((M, qs.shape[0] * lanes), np.float32)
            M = xq.shape[0]
            eight = batch and 8 <= M < 16
            for g in rows(qs.shape[0]):
                t = 0
                if amx:                        # rows 0 .. t - 1 in 16s on the tile unit
                    t = M - M % T
                    if t > 0:
                        nblk = xq.shape[1] // 32
                        wbuf = _lines(nblk, STEPS)                         # the group's steps
                        cbuf = _lines(min(nblk, CHUNK), 64 * T)            # a phase's sums
                        tiles(True)
                        unpack(qs, g, wbuf)
                        for m in range(0, t, T):
                            dot_t(wbuf, scale, minv, g, xq, xd, xs, xc, m, out, cbuf)
                        tiles(False)
                full = 8 if eight else M - (M - t) % R
                if eight:
                    dot_8p(qs, scale, minv, g, xq, xd, xs, xc, 0, out)
                elif full > t:                 # the first pass over the group's weights reads memory
                    dot_rp(qs, scale, minv, g, xq, xd, xs, xc, t, out)
                    for b in range(t + R, full, R):
                        dot_r(qs, scale, minv, g, xq, xd, xs, xc, b, out)
                b = full                       # the rest, < R rows (< 8 after 8: 4 first), in one pass
                if (R > 4 or eight) and M - b >= 4 and (eight or M - b == 4):
                    dot_4(qs, scale, minv, g, xq, xd, xs, xc, b, out)
                    b += 4
                n = M - b
                if n == 1:
                    dot_1(qs, scale, minv, g, xq, xd, xs, xc, b, out)
                elif n == 2:
                    dot_2(qs, scale, minv, g, xq, xd, xs, xc, b, out)
                elif n == 3:
                    dot_3(qs, scale, minv, g, xq, xd, xs, xc, b, out)
                elif n == 5:
                    dot_5(qs, scale, minv, g, xq, xd, xs, xc, b, out)
                elif n == 6:
                    dot_6(qs, scale, minv, g, xq, xd, xs, xc, b, out)
                elif n == 7:
                    dot_7(qs, scale, minv, g, xq, xd, xs, xc, b, out)
            return out
        return run
    return _njit_drivers(loops, f"q_{kind}_{group}_{R}_{lanes}_{int(vnni)}_{int(amx)}")


def _activation_kernels(split: bool):
    """:func:`activations_for` (``split``: prompt rows quantized over threads, as the parallel drivers do)."""

    def activations_for(mode, x, nw, eps):
        """The activations a driver makes of ``x`` before it multiplies (``mode`` PLAIN, NORM, SILU or GELU,
        as :func:`qdrivers`; the same functions, so the same bytes): (xq, xd, xs, xc) for the GIVEN mode,
        so that the row groups of a matrix of several kinds (:meth:`Matmuls.pieces`) quantize once."""
        M = x.shape[0]
        K = x.shape[1] // 2 if mode >= SILU else x.shape[1]
        xq = _lines(M, K).view(np.int8)
        xd = np.empty((M, K // 32), np.float32)
        xs = np.empty((M, K // 32), np.float32)
        xc = np.empty((M, K // 16), np.int32)
        pieces = split and M >= activations.SPLIT_ROWS
        if mode == NORM:
            if pieces:
                norm_quantize_rows_parallel(x, nw, eps, xq, xd, xs, xc)
            else:
                norm_quantize_rows(x, nw, eps, xq, xd, xs, xc)
        elif mode >= SILU:
            if pieces:
                glu_quantize_rows_parallel(x, mode == GELU, xq, xd, xs, xc)
            else:
                glu_quantize_rows(x, mode == GELU, xq, xd, xs, xc)
        else:
            quantize_rows(x, xq, xd, xs, xc)
        return xq, xd, xs, xc
    return activations_for


#: (serial, parallel) :func:`activations_for`: the parallel one only quantizes prompt rows over threads.
activations_for = (njit(cache=True)(variant(_activation_kernels(False), "serial")),
                   njit(cache=True)(variant(_activation_kernels(True), "parallel")))


@functools.cache
def _fdrivers(kind: str, R: int):
    """As :func:`qdrivers` for float storage: out[b, r] = dot(w, r, x, b)."""
    dot_r, dot_1 = make_fdot_rows(_FKINDS[kind], R), make_fdot_rows(_FKINDS[kind], 1)

    def loops(rows):
        def body(w, x, out):
            M = x.shape[0]
            full = M - M % R
            for r in rows(w.shape[0]):
                for b in range(0, full, R):
                    dot_r(w, r, x, b, out)
                for b in range(full, M):
                    dot_1(w, r, x, b, out)
        return body
    return _njit_drivers(loops, f"f_{kind}_{R}")


_EMPTY = np.zeros((1, 1), np.float32)
_EMPTY1 = np.zeros(1, np.float32)
_NO_ACTS = (np.zeros((1, 32), np.int8), np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32),
            np.zeros((1, 2), np.int32))             # placeholders where a driver makes its own activations


def quantize_activations(x):
    """x: float32 [M, K] -> (xq int8 [M, K], xd, xs float32 [M, K/32], xc int32 [M, K/16]) for
    :func:`qmatmul` (:func:`streamattn.quant.activations.quantize_rows`)."""
    M, K = x.shape
    acts = (_lines(M, K).view(np.int8), np.empty((M, K // 32), np.float32), np.empty((M, K // 32), np.float32),
            np.empty((M, K // 16), np.int32))
    quantize_rows(x, *acts)
    return acts


class Matmuls:
    """A model's packed matmuls under its :class:`KernelPlan`: one compiled call each that quantizes the
    activations (plain, RMSNorm, gated activation) and multiplies. What a weight needs of its drivers is
    looked up once and kept here, by weight (the model owns this table: ``Transformer.matmuls``); a weight
    whose planes were replaced is bound again, and one that is gone leaves the table."""

    def __init__(self, plan: KernelPlan):
        self.plan = plan
        self._bound = {}         # id(w) -> (weakref to w, drivers, qs, scale, minv, rows)

    def norm(self, x, norm_w, eps: float, w: QWeight):
        """``rms_norm(x) @ W.T`` for a "q4"/"q8" weight, the norm fused into the activations' quantization.
        x: float32 [..., K], norm_w: float32 [K] -> [..., N]."""
        return self._fused(NORM, x, norm_w, eps, w)

    def plain(self, x, w: QWeight):
        """``x @ W.T`` for a "q4"/"q8" weight and float32 x [..., K] of the weight's columns: :func:`qmatmul`
        without its checks, for the model, whose shapes are its own."""
        return self._fused(PLAIN, x, _EMPTY1, 0.0, w)

    def glu(self, gu, gelu: bool, w: QWeight):
        """``(act(g) * u) @ W.T`` for gu = [g | u]: float32 [..., 2F] and a "q4"/"q8" weight [N, F]."""
        return self._fused(GELU if gelu else SILU, gu, _EMPTY1, 0.0, w)

    def pieces(self, mode: int, x, nw, eps: float, ws: tuple):
        """What :meth:`norm`, :meth:`plain` or :meth:`glu` (``mode``: NORM, PLAIN, SILU, GELU) gives for a
        matrix held as row groups of different kinds (``ws``: QWeights of the kernels' kinds, their rows
        concatenated): the activations made once (:data:`activations_for`), each group's drivers on them,
        the results side by side. Each group's columns are the bits a call on that group alone gives."""
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != np.float32 or not x2.flags.c_contiguous:
            x2 = np.ascontiguousarray(x2, np.float32)
        if nw.dtype != np.float32 or not nw.flags.c_contiguous:
            nw = np.ascontiguousarray(nw, np.float32)
        par = many_threads()
        acts = activations_for[par](mode, x2, nw, eps)
        outs = []
        for w in ws:
            b = self._bound.get(id(w))
            if b is None or b[2] is not w.qs or b[3] is not w.scale or b[4] is not w.minv:
                b = self._bind(w)
            _, drivers, qs, scale, minv, n = b
            out = np.empty((x2.shape[0], qs.shape[0] * w.lanes), np.float32)
            drivers[par](GIVEN, _EMPTY, _EMPTY1, 0.0, *acts, qs, scale, _EMPTY if minv is None else minv, out)
            outs.append(_real_rows(out, n))
        return np.concatenate(outs, axis=1).reshape(*x.shape[:-1], -1)

    def drivers(self, w: QWeight) -> tuple:
        """The plan's (serial, group-parallel) drivers for w's kind (:func:`qdrivers`)."""
        return qdrivers(w.kind, w.group, self.plan.rows, w.lanes, self.plan.vnni, self.plan.amx)

    def _fused(self, mode, x, nw, eps, w):
        """One driver call that quantizes x (``mode``) and multiplies (:func:`qdrivers`): ~120 calls a
        decode step on the array layers."""
        b = self._bound.get(id(w))       # an entry is w's: one of a weight that is gone has left (_bind)
        if b is None or b[2] is not w.qs or b[3] is not w.scale or b[4] is not w.minv:
            b = self._bind(w)                            # first use, or planes replaced
        _, drivers, qs, scale, minv, n = b
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != np.float32 or not x2.flags.c_contiguous:
            x2 = np.ascontiguousarray(x2, np.float32)
        if nw.dtype != np.float32 or not nw.flags.c_contiguous:
            nw = np.ascontiguousarray(nw, np.float32)
        # positional: from Python, Numba folds keywords at ~0.6 us a call (the compiled layers call by name)
        out = drivers[many_threads()](mode, x2, nw, eps, *_NO_ACTS, qs, scale, _EMPTY if minv is None else minv,
                                      _EMPTY)
        return _real_rows(out, n).reshape(*x.shape[:-1], n)

    def _bind(self, w: QWeight) -> tuple:
        """w's entry of the table, which leaves it when w is gone (so an entry found by id is always w's);
        refuses what this CPU's kernels cannot run (no AVX2; groups wider than the plan's lanes)."""
        _check_runs_here(w, self.plan.lanes)
        key, table = id(w), self._bound
        b = (weakref.ref(w, lambda _, key=key: table.pop(key, None)), self.drivers(w), w.qs, w.scale, w.minv,
             w.shape[0])
        table[key] = b
        return b


def _real_rows(out, n: int):
    """out [M, groups * lanes] without the columns of the last group's padding rows (contiguous)."""
    return out if out.shape[1] == n else np.ascontiguousarray(out[:, :n])


def _check_runs_here(w: QWeight, lanes: int = LANES) -> None:
    """RuntimeError without AVX2; ValueError for a weight interleaved wider than ``lanes`` (at most this
    CPU's vectors)."""
    if not HAVE_KERNELS:
        raise RuntimeError("the packed-weight kernels need an x86 CPU with AVX2; load the model with "
                           "weights='f32' (CLI: --weights f32)")
    if w.lanes not in (8, 16) or w.lanes > lanes:
        raise ValueError(f"weight {w.shape} is interleaved by {w.lanes} rows; these kernels take groups "
                         f"of 8{' or 16' if lanes == 16 else ''} (pack it with lanes=None)")


def _quantized_matmul(w: QWeight, xq, xd, xs, xc, *, parallel=None, group_rows=None, vnni=None, amx=None):
    """``x @ W.T`` for a "q4"/"q8" weight and activations already quantized (the layout of
    :func:`quantize_activations`), options already checked: :func:`qmatmul`'s work without its checks."""
    group_rows = ROWS if group_rows is None else group_rows
    vnni = LANES_VNNI if vnni is None else vnni
    amx = amx_kernels.DEFAULT if amx is None else amx
    _check_runs_here(w)
    M, N = xq.shape[0], w.shape[0]
    out = np.empty((M, w.qs.shape[0] * w.lanes), np.float32)
    par = many_threads() if parallel is None else parallel
    minv = w.minv if w.minv is not None else _EMPTY
    qdrivers(w.kind, w.group, group_rows, w.lanes, vnni, amx)[par](mode=GIVEN, x=_EMPTY, nw=_EMPTY1, eps=0.0, xq=xq, xd=xd,
                                                              xs=xs, xc=xc, qs=w.qs, scale=w.scale, minv=minv, out=out)
    return _real_rows(out, N)


def qmatmul(x, w: QWeight, *, acts=None, parallel: bool | None = None, group_rows: int | None = None,
            vnni: bool | None = None, amx: bool | None = None):
    """``x @ W.T`` for a packed weight.

    Parameters
    ----------
    x : float32 [..., K]
    w : QWeight [N, K]
    acts : tuple, optional
        x already quantized by :func:`quantize_activations` (shared by matmuls of the same input).
    parallel : bool, optional
        Split rows over Numba's threads (default: when more than one is set). The result is the same.
    group_rows : {1, 2, 4, 8}, optional
        Activation rows per weight-block unpacking (default :data:`ROWS`; a model takes its own from its
        :class:`KernelPlan`). The result is the same.
    vnni : bool, optional
        Integer dot products by ``vpdpbusd`` (default: where the CPU has it at the kernels' width,
        :data:`~streamattn.quant.kernels.LANES_VNNI`) or by ``vpmaddubsw`` + ``vpmaddwd``.
        The result is the same; True on a CPU without it raises.
    amx : bool, optional
        Rows in whole 16s by AMX tile multiplies (default: as ``KernelPlan().amx``; needs ``vnni``; weights
        interleaved by 8 lanes take the vector kernels). The result is the same; True where AMX is not
        usable raises.

    Returns
    -------
    float32 [..., N]

    Examples
    --------
    >>> from streamattn.quant.weights import pack
    >>> w = pack("w", "F32", np.eye(32, dtype=np.float32), (32, 32))
    >>> bool((qmatmul(np.arange(64, dtype=np.float32).reshape(2, 32), w)[1] == np.arange(32, 64)).all())
    True
    """
    if not HAVE_KERNELS:
        raise RuntimeError("the packed-weight kernels need an x86 CPU with AVX2; load the model with "
                           "weights='f32' (CLI: --weights f32)")
    N, K = w.shape
    group_rows = ROWS if group_rows is None else group_rows
    if group_rows not in GROUP_ROWS:
        raise ValueError(f"group_rows must be one of {GROUP_ROWS} (got {group_rows!r})")
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {w.shape} expects {K}")
    vnni = LANES_VNNI if vnni is None else bool(vnni)
    if vnni and not LANES_VNNI:
        raise ValueError(f"vnni=True needs vpdpbusd at {LANES} lanes (AVX512-VNNI, or AVX-VNNI for 8 lanes); "
                         "this CPU has none")
    if amx:
        _check_amx(vnni)
    lead = x.shape[:-1]
    x2 = np.ascontiguousarray(x.reshape(-1, K), np.float32)
    par = many_threads() if parallel is None else parallel
    if w.kind in _FKINDS:
        out = np.empty((x2.shape[0], N), np.float32)
        _fdrivers(w.kind, group_rows)[par](w.qs, x2, out)
    else:
        acts = quantize_activations(x2) if acts is None else acts
        out = _quantized_matmul(w, *acts, parallel=par, group_rows=group_rows, vnni=vnni, amx=amx)
    return out.reshape(*lead, N)
