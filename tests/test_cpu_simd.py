"""The CPU backend's LLVM-IR vector kernels, each against float64 numpy on the values it was given.

The oracle tests cover them inside the kernel; these pin down each one alone, at the sizes where
their block structure has edges: head_dim in whole groups of 64 and in single 16-lane chunks (48, 80),
rows in blocks of 4, 3, 2 and 1, keys ending mid-block, and float16/bfloat16 widening.
"""

import functools

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from streamattn.kv.backends import cpu_simd
from streamattn.runtime import llvm_ir
from streamattn.kv.storage import to_storage, widen_bf16

KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}


def _store(x, dtype):
    """(the array the kernel reads: float32, or the uint16 bits of 16-bit storage; its float64 values)."""
    s = to_storage(x, dtype, np)
    wide = widen_bf16(s, np) if dtype == "bfloat16" else s
    return (s if dtype == "float32" else s.view(np.uint16)), np.asarray(wide, np.float64)


@functools.cache
def _qk_all(R):
    f, KB = cpu_simd.QK[R], cpu_simd.QK_KEYS[R]

    @njit
    def run(qf, kt, sc, kind):
        for r in range(0, qf.shape[0] - R + 1, R):
            for j in range(0, kt.shape[0] - KB + 1, KB):
                f(qf, r, kt, j, sc, kind)
    return run


@functools.cache
def _pv(R):
    f = cpu_simd.PV[R]

    @njit
    def run(acc, r0, p, vt, n, kind):
        f(acc, r0, p, vt, n, kind)
    return run


@pytest.mark.parametrize("dtype", list(KINDS))
@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.parametrize("D", [16, 48, 64, 80, 128])
def test_scores_blocks_equal_dot_products(dtype, R, D):
    rng = np.random.default_rng(D * 10 + R)
    rows, n = 12, 48                                  # whole blocks: 12 rows, 48 keys
    qf = rng.standard_normal((rows, D)).astype(np.float32)
    kt, kw = _store(rng.standard_normal((n, D)).astype(np.float32), dtype)
    sc = np.full((rows, n), np.nan, np.float32)
    _qk_all(R)(qf, kt, sc, KINDS[dtype])
    want = qf.astype(np.float64) @ kw.T
    assert np.abs(sc - want).max() <= 1e-5 * np.abs(want).max()


def test_scores_of_a_ring_slice_with_a_row_stride():
    """kt as the kernel sees it: a slice of [heads, slots, D] storage; prefetches past its end are harmless."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 8, 64)).astype(np.float32)
    kt = k[1, 4:8]                                    # the last 4 slots: prefetch reaches 16 rows beyond
    qf = rng.standard_normal((4, 64)).astype(np.float32)
    sc = np.zeros((4, 4), np.float32)
    _qk_all(4)(qf, kt, sc, 0)
    want = qf.astype(np.float64) @ kt.astype(np.float64).T
    assert np.abs(sc - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("dtype", list(KINDS))
@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.parametrize("D", [16, 48, 64, 80, 256])
@pytest.mark.parametrize("n", [0, 1, 37])
def test_accumulate_adds_weighted_rows(dtype, R, D, n):
    rng = np.random.default_rng(D + n + R)
    rows = 6
    acc = rng.standard_normal((rows, D)).astype(np.float32)
    p = rng.random((rows, 40)).astype(np.float32)
    vt, vw = _store(rng.standard_normal((max(n, 1), D)).astype(np.float32), dtype)
    r0 = rows - R                                     # the last R rows; the others must not change
    got = acc.copy()
    _pv(R)(got, r0, p, vt, n, KINDS[dtype])
    want = acc.astype(np.float64)
    want[r0:] += p[r0:, :n].astype(np.float64) @ vw[:n]
    assert np.array_equal(got[:r0], acc[:r0])
    assert np.abs(got - want).max() <= 1e-5 * max(np.abs(want).max(), 1.0)


@njit
def _row_max(x, n, init):
    return cpu_simd.row_max(x, n, init)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 64, 130, 1000])
def test_row_max(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(max(n, 1)).astype(np.float32)
    x[::3] = -np.inf                                  # masked scores
    assert _row_max(x, n, np.float32(-np.inf)) == (x[:n].max() if n else -np.inf)
    assert _row_max(x, n, np.float32(50.0)) == 50.0
    assert _row_max(np.full(20, -np.inf, np.float32), 20, np.float32(-np.inf)) == -np.inf


@njit
def _pow2_all(ks, out):
    for i in range(ks.shape[0]):
        out[i] = llvm_ir.pow2(ks[i])


def test_row_max_refuses_a_strided_row():
    """It loads 16 consecutive floats: a strided view must not type-check, let alone run."""
    col = np.zeros((20, 2), np.float32)[:, 1]
    with pytest.raises(TypingError):
        _row_max(col, 20, np.float32(0.0))


def test_pow2_is_exact_and_zero_at_the_floor():
    ks = np.arange(-127, 128, dtype=np.int32)
    out = np.empty(ks.size, np.float32)
    _pow2_all(ks, out)
    assert out[0] == 0.0
    assert np.array_equal(out[1:], np.ldexp(np.float32(1), ks[1:]).astype(np.float32))
