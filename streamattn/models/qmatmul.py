"""``x @ W.T`` on packed GGUF weights (:mod:`streamattn.models.quant`): quantized activations, drivers.

Route (ggml's): each activation row is quantized once per matmul to int8 per 32 columns (scale ``xd``
and ``xs = xd * sum(q)``, llama.cpp's Q8_1), then every 32-block of a weight row is one integer dot
product, turned to float and added lane-wise with one FMA by ``scale * xd`` (the IR kernels are in
:mod:`streamattn.models.qmatmul_kernels`). Float kinds (F32/F16/BF16) take float32 activations as
they are and a 16-lane FMA per chunk.

Weight rows are the outer loop (split over threads); for each, the activation rows go in groups of
:data:`ROWS` through a kernel that unpacks each weight block once for the whole group, then the
remainder one by one; the groups' activations are first copied interleaved by block
(:func:`group_activations`), so one pointer reaches a group's R rows. A weight row is read from memory once and stays in L1 for every activation row
of the call (prefill chunks and decode batches). Each weight row's planes are prefetched
:data:`PREFETCH_BYTES` ahead; the loader keeps all planes in one buffer (streamattn/models/arrange.py).

Batch invariance: an output element ``out[b, r]`` is always the same function of row ``r`` and
activation row ``b`` alone — the blocks in column order into 8 float lanes, then a fixed tree of lane
sums, whether b went through a group kernel or the 1-row one (qmatmul_kernels says why). Threads split
rows, never a reduction, so a sequence's logits are bit-identical alone or in any batch, with any
thread count.

The integer instructions are x86 AVX2 (also present on every AVX-512 CPU); :data:`HAVE_KERNELS` says
whether this CPU has them, and ``load_gguf(path, weights="f32")`` is the path for others.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from numba import njit, prange

from streamattn.backends import cpu_simd
from streamattn.kernel_cache import drop_when_changed
from streamattn.models import qacts, qmatmul_kernels
from streamattn.models.qmatmul_kernels import (VNNI, WIDE, WIDE_VNNI, _host_cpu_has, make_fdot_rows, make_qdot_rows,
                                                prefetch_rows)
from streamattn.models.qacts import (glu_quantize_rows, group_activations, group_activations_wide,  # noqa: F401
                                      norm_quantize_rows, quantize_rows)
from streamattn.models.quant import QWeight

#: Activation rows per weight-block unpacking (measured: docs/PERF.md): 8 with the wide (AVX-512) kernels,
#: whose 32 vector registers hold 8 rows' accumulators and scale products, else 4. Results do not depend on it.
ROWS = 8 if WIDE else 4
GROUP_ROWS = (1, 2, 4, 8)
#: Weight rows per call of the kernel that takes activation rows one by one (decode): an activation block
#: is loaded once for both, and their chains interleave. Results do not depend on it (docs/PERF.md).
WEIGHT_ROWS = 2
#: How far ahead of the weight row being read each of its planes is prefetched (measured: docs/PERF.md; the
#: hardware prefetcher alone left a decode step's weight reads at ~10 GB/s, ~45% under a plain read's).
#: Read when a weight kind's drivers are first built (:func:`_qdrivers` is cached).
PREFETCH_BYTES = 4096
_FKINDS = {"f32": 0, "f16": 1, "bf16": 2}


HAVE_KERNELS = _host_cpu_has("avx2")


def _drop_stale_cache() -> None:
    """Delete this module's and qacts' cache files once when what their cached code inlines or calls
    changed (qmatmul_kernels.py, cpu_simd.py, qacts.py: :func:`streamattn.kernel_cache.drop_when_changed`).
    The drivers are closures made on demand, so their files go by name rather than by dispatcher."""
    def delete(directory):
        for module in (__name__, qacts.__name__):
            for f in directory.glob(f"{module.rsplit('.', 1)[-1]}.*.nb[ic]"):
                f.unlink()
    drop_when_changed([m.__file__ for m in (qmatmul_kernels, cpu_simd, qacts)], "streamattn_qmatmul_kernels.sha256",
                      lambda: _grouped._cache._cache_path, delete)


def _njit_drivers(loops):
    """The serial and the row-parallel driver from one source: ``loops(rows)`` returns the loop over
    weight rows, ``rows`` being ``range`` or ``prange``. Numba keys a cached closure on its cells, so
    the two (which differ in that cell) never share an entry, though its key ignores the parallel flag."""
    return njit(cache=True)(loops(range)), njit(parallel=True, cache=True)(loops(prange))


@functools.cache
def _qdrivers(kind: str, group: int, R: int, vnni: bool = VNNI, WR: int = 1, wide: bool = False):
    """Serial and row-parallel loops over weight rows r: activation rows in groups of R, then one by
    one, out[b, r] = dot(qs, scale, minv, r, xq, xd, xs, b). ``vnni``: which integer dot product
    (:func:`~streamattn.models.qmatmul_kernels.make_qdot_rows`; the same results). ``WR``: weight rows
    per call of the one-by-one kernel (the same results; the loop then runs over pairs of rows)."""
    wvnni = vnni and WIDE_VNNI if wide else vnni        # the 512-bit vpdpbusd is AVX512-VNNI's
    dot_r = make_qdot_rows(kind, group, R, wvnni, 1, wide)
    dot_1, dot_w = make_qdot_rows(kind, group, 1, wvnni, 1, wide), make_qdot_rows(kind, group, 1, wvnni, WR, wide)
    has_min = kind == "q4"
    pf = PREFETCH_BYTES

    def loops(rows):
        def body(qs, scale, minv, xq, xd, xs, out):
            M, N = xq.shape[0], qs.shape[0]
            full = M - M % R
            ahead = (pf + qs.strides[0] - 1) // qs.strides[0]    # weight rows
            for k in rows((N + WR - 1) // WR):
                r = k * WR
                prefetch_rows(qs, r + ahead, WR)
                prefetch_rows(scale, r + ahead, WR)
                if has_min:
                    prefetch_rows(minv, r + ahead, WR)
                for rr in range(r, min(r + WR, N)):
                    for b in range(0, full, R):
                        dot_r(qs, scale, minv, rr, xq, xd, xs, b, out)
                for b in range(full, M):
                    if r + WR <= N:
                        dot_w(qs, scale, minv, r, xq, xd, xs, b, out)
                    else:
                        for rr in range(r, N):
                            dot_1(qs, scale, minv, rr, xq, xd, xs, b, out)
        return body
    return _njit_drivers(loops)


@functools.cache
def _fdrivers(kind: str, R: int):
    """As :func:`_qdrivers` for float storage: out[b, r] = dot(w, r, x, b)."""
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
    return _njit_drivers(loops)


@njit(cache=True)
def _grouped(xq, xd, xs, R, wide, group):
    """Copies of quantized activations in the layout the R-row kernels read (:func:`group_activations`,
    or :func:`group_activations_wide` for the wide kernels, whose whole chunks go as pairs)."""
    M, K = xq.shape
    gq, gd, gs = np.empty((M, K), np.int8), np.empty((M, K // 32), np.float32), np.empty((M, K // 32), np.float32)
    if wide:
        ch = 16 if group == 32 else 8
        group_activations_wide(xq, xd, xs, R, ch * (K // 32 // ch), gq, gd, gs)
    else:
        group_activations(xq, xd, xs, R, gq, gd, gs)
    return gq, gd, gs


_drop_stale_cache()
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
    return _quantized_matmul(w, *acts).reshape(*x.shape[:-1], w.shape[0])


def glu_qmatmul(gu, gelu: bool, w: QWeight):
    """``(act(g) * u) @ W.T`` for gu = [g | u]: float32 [..., 2F] and a "q4"/"q8" weight [N, F]."""
    g2 = np.ascontiguousarray(gu.reshape(-1, gu.shape[-1]), np.float32)
    acts = _acts_like(g2.shape[0], g2.shape[1] // 2)
    glu_quantize_rows(g2, gelu, *acts)
    return _quantized_matmul(w, *acts).reshape(*gu.shape[:-1], w.shape[0])


def _quantized_matmul(w: QWeight, xq, xd, xs, *, parallel=None, group_rows=None, vnni=None, wide=None):
    """``x @ W.T`` for a "q4"/"q8" weight and activations already quantized (the layout of
    :func:`quantize_activations`), options already checked: :func:`qmatmul`'s work without its checks,
    for the fused callers above, whose shapes are the model's own (~2 us a call less)."""
    group_rows = ROWS if group_rows is None else group_rows
    vnni = VNNI if vnni is None else vnni
    wide = WIDE if wide is None else wide
    M = xq.shape[0]
    out = np.empty((M, w.shape[0]), np.float32)
    if group_rows > 1 and M >= group_rows:
        xq, xd, xs = _grouped(xq, xd, xs, group_rows, wide, w.group)
    par = numba.get_num_threads() > 1 if parallel is None else parallel
    minv = w.minv if w.minv is not None else _EMPTY
    wr = WEIGHT_ROWS if w.kind == "q4" else 1
    _qdrivers(w.kind, w.group, group_rows, vnni, wr, wide)[par](w.qs, w.scale, minv, xq, xd, xs, out)
    return out


def qmatmul(x, w: QWeight, *, acts=None, parallel: bool | None = None, group_rows: int | None = None,
            vnni: bool | None = None, wide: bool | None = None):
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
        Activation rows per weight-block unpacking (default: the module's :data:`ROWS`, read at each
        call, so a benchmark can switch it for a whole model). The result is the same.
    vnni : bool, optional
        Integer dot products by ``vpdpbusd`` (default: where the CPU has it, :data:`VNNI`) or by
        ``vpmaddubsw`` + ``vpmaddwd``. The result is the same; True on a CPU without VNNI raises.
    wide : bool, optional
        Rows taken one by one go through the 512-bit two-blocks-per-vector kernel (default: where the
        CPU has AVX-512 BW, :data:`~streamattn.models.qmatmul_kernels.WIDE`). The result is the same.

    Returns
    -------
    float32 [..., N]

    Examples
    --------
    >>> from streamattn.models.quant import pack
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
    vnni = VNNI if vnni is None else bool(vnni)
    if vnni and not VNNI:
        raise ValueError("vnni=True needs a CPU with AVX-VNNI or AVX512-VNNI (this one has neither)")
    wide = WIDE if wide is None else bool(wide)
    if wide and not WIDE:
        raise ValueError("wide=True needs a CPU with AVX-512 BW (this one has none)")
    lead = x.shape[:-1]
    x2 = np.ascontiguousarray(x.reshape(-1, K), np.float32)
    par = numba.get_num_threads() > 1 if parallel is None else parallel
    if w.kind in _FKINDS:
        out = np.empty((x2.shape[0], N), np.float32)
        _fdrivers(w.kind, group_rows)[par](w.qs, x2, out)
    else:
        xq, xd, xs = quantize_activations(x2) if acts is None else acts
        out = _quantized_matmul(w, xq, xd, xs, parallel=par, group_rows=group_rows, vnni=vnni, wide=wide)
    return out.reshape(*lead, N)
