"""The key rotation of a quantized K cache: an orthonormal Walsh–Hadamard transform H along head_dim.

A cache whose spec has ``rotate_k`` stores every key row as ``k @ H`` (after RoPE, before it is quantized),
and attention scores it with ``q @ H``. H is orthonormal, so ``(q @ H) · (k @ H) = q · k`` in exact
arithmetic: only the quantization error changes. Post-RoPE keys carry a few outlier channels (SmolLM2:
channels 44–51 and 60–63 reach 15–21 against an rms of 2); a 32-value block with one of them gets a scale
that crushes its 31 other values to a few levels. H spreads each outlier over its whole block, so the block's
values look alike and its 4-bit grid fits them (docs/DESIGN.md §6; llama.cpp did the same for its K cache,
PR #21038). V is not rotated: it is averaged, not dotted, and its error was measured small (docs/PERF.md).

H is block diagonal: a Sylvester Hadamard matrix of 32 (GGUF's block size) per quantization block, scaled by
1/√32, and a tail of head_dim mod 32 values split into power-of-two blocks (80 = 32 + 32 + 16), so every
head_dim has one (no power of two needed) and no block mixes values of two quantization blocks. Blocks of 32
measured a smaller key error than one transform over all of head_dim 64 (docs/PERF.md). H is symmetric and
its own inverse, with entries ±2^(-k/2): exact in float32 up to the rounding of 1/√32.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit

from ..runtime import kernel_cache
from .spec import QBLOCK

kernel_cache.register(__name__)    # (its kernels call only its own code)


@functools.cache
def hadamard(head_dim: int) -> np.ndarray:
    """The rotation H of a ``head_dim`` row: float64 [head_dim, head_dim], orthonormal, symmetric.

    >>> H = hadamard(80)
    >>> bool(np.allclose(H @ H, np.eye(80)))
    True
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
        raise ValueError(f"head_dim must be an integer >= 1 (got {head_dim!r})")
    sizes = _block_sizes(head_dim)                              # 80 = 32 + 32 + 16, 24 = 16 + 8
    H = np.zeros((head_dim, head_dim))
    start = 0
    for n in sizes:
        block = np.ones((1, 1))
        while block.shape[0] < n:                               # Sylvester: [[B, B], [B, -B]]
            block = np.block([[block, block], [block, -block]])
        H[start:start + n, start:start + n] = block / np.sqrt(n)
        start += n
    H.setflags(write=False)
    return H


def rotate(x, xp=np):
    """``x @ H`` over the last axis (head_dim): the frame a rotated cache stores keys and scores queries in.

    x : float [..., head_dim] on ``xp``'s device. Returns a new array of x's shape and dtype.

    Computed as Walsh–Hadamard butterflies (a + b, a − b) per block, in float64, then one scale by 1/√n
    and one rounding to x's dtype: every output element is the same fixed sequence of element-wise
    operations on its own row, so a row's result does not depend on how many rows share the call (a
    matrix product would: BLAS picks its kernel and summation order by shape), which the batch invariance
    of docs/DESIGN.md §7 and exact speculation (§24) need. The float64 sums of ±float32 values are exact
    for rows whose values span less than 2^29, so the result is x @ H rounded once. float32 numpy arrays go
    through :func:`rotate_rows` (compiled, one pass per row), others through array butterflies on ``xp``:
    the same operations in the same order, so the same bits.
    """
    if xp is np and x.dtype == np.float32:
        return rotate_rows(np.ascontiguousarray(x))
    return _butterflies(x, xp)


def _butterflies(x, xp):
    """:func:`rotate` as whole-array operations on ``xp`` (any device, any float dtype)."""
    d = x.shape[-1]
    y = x.astype(np.float64)                                     # [..., head_dim], a copy
    start = 0
    for n in _block_sizes(d):
        h = n // 2
        while h >= 1:                                            # [[B, B], [B, -B]]: halves, then quarters, ...
            blk = y[..., start:start + n].reshape(*y.shape[:-1], n // (2 * h), 2, h)
            a, b = blk[..., 0:1, :], blk[..., 1:2, :]
            y[..., start:start + n] = xp.concatenate([a + b, a - b], axis=-2).reshape(*y.shape[:-1], n)
            h //= 2
        y[..., start:start + n] *= 1.0 / np.sqrt(n)
        start += n
    return y.astype(x.dtype)


@njit(cache=True)
def rotate_rows(x):
    """:func:`rotate` of a C-contiguous float32 array x [..., head_dim], row by row: the butterflies of
    :func:`_butterflies` in float64 in the same order (blocks of 32, then the tail's powers of two, largest
    first), the same scale by 1/sqrt(n), one rounding. Also called inside the compiled layer."""
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    out = np.empty_like(rows)
    y = np.empty(D, np.float64)
    for r in range(rows.shape[0]):
        for d in range(D):
            y[d] = rows[r, d]
        start = 0
        while start < D:
            n = _block_at(D - start)
            h = n // 2
            while h >= 1:
                for g in range(start, start + n, 2 * h):
                    for j in range(g, g + h):
                        a, b = y[j], y[j + h]
                        y[j], y[j + h] = a + b, a - b
                h //= 2
            s = 1.0 / np.sqrt(np.float64(n))
            for d in range(start, start + n):
                y[d] *= s
            start += n
        for d in range(D):
            out[r, d] = np.float32(y[d])
    return out.reshape(x.shape)


@njit(cache=True)
def _block_at(rest):
    """Size of the block that starts where ``rest`` values of a row remain: QBLOCK, else the tail's largest
    power of two (so a row is blocks of QBLOCK, then the tail's powers of two, largest first)."""
    n = QBLOCK
    while n > rest:
        n //= 2
    return n


def _block_sizes(head_dim: int) -> list:
    """The blocks of a ``head_dim`` row in order (80 -> [32, 32, 16]): :func:`_block_at` from each start."""
    sizes, start = [], 0
    while start < head_dim:
        sizes.append(_block_at(head_dim - start))
        start += sizes[-1]
    return sizes
