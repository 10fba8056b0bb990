"""Scores against q8_0 keys by integer byte dot products (streamattn.backends.cpu_q8), each piece against
float64 numpy: the query's limbs are the query rounded once at float32's step of its block, the scores
are within float32 rounding of q . k over the stored keys, and a row's bits depend on nothing but the row
and the key. The attention tests (test_kv_quant, test_attention_invariance) run the kernel inside
attend on hosts that have it."""

import numpy as np
import pytest
from numba import njit

from streamattn import storage
from streamattn.backends import cpu_q8

needs_vnni = pytest.mark.skipif(not cpu_q8.AVAILABLE, reason="this CPU has no AVX512-VNNI (the float path runs)")


def _limbs(q):
    rows, D = q.shape
    nb = D // 32
    ql = np.empty((rows, nb * 96), np.int8)
    qc = np.empty((rows, nb * 3), np.int32)
    qe = np.empty((rows, nb), np.float32)
    cpu_q8.query_limbs(q, ql, qc, qe)
    return ql, qc, qe


def _queries(rng, rows, D):
    """Rows whose blocks span magnitudes, with a zero block and a block of one nonzero value."""
    q = rng.standard_normal((rows, D)).astype(np.float32)
    q *= np.float32(10.0) ** rng.integers(-30, 30, size=(rows, D // 32, 1)).repeat(32, 2).reshape(rows, D)
    q[0, :32] = 0.0
    if rows > 1 and D >= 64:
        q[1, 32:64] = 0.0
        q[1, 40] = -3.0e-38
    return q


def test_limbs_write_the_query_rounded_once():
    rng = np.random.default_rng(1)
    q = _queries(rng, 4, 128)
    ql, qc, qe = _limbs(q)
    limbs = ql.reshape(4, 4, 3, 32).astype(np.int64)
    Q = limbs[:, :, 0] * 65536 + limbs[:, :, 1] * 256 + limbs[:, :, 2]              # [rows, blocks, 32]
    assert np.abs(Q).max() <= cpu_q8.LIMIT
    e = -np.log2(qe.astype(np.float64))                                            # 2^-e is exact
    assert np.array_equal(e, np.round(e))
    exact = q.reshape(4, 4, 32).astype(np.float64) * 2.0 ** e[:, :, None]
    assert np.abs(exact - Q).max() <= 0.5                                          # one rounding, to nearest
    top = np.abs(q.reshape(4, 4, 32).astype(np.float64)).max(2)
    # the block's largest value uses the range: rounded under 2^-22 of itself, float32's step there; a
    # block under 2^-103 (its 2^-e would be no float32 normal) is rounded at 2^-127 instead
    normal = top * 2.0 ** 126 >= cpu_q8.LIMIT
    assert (np.abs(Q).max(2)[normal] > cpu_q8.LIMIT // 2).all()
    assert ((e == 126) == ~normal).all() and ((top > 0) & ~normal).sum() == 1
    assert (Q[top == 0] == 0).all()
    assert np.array_equal(qc.reshape(4, 4, 3), -128 * limbs.sum(3))


def test_a_block_that_is_not_finite_scores_nan():
    q = np.ones((2, 64), np.float32)
    q[0, 33] = np.inf
    q[1, 5] = np.nan
    ql, qc, qe = _limbs(q)
    assert qe[0, 0] == 1.0 / 2 ** 22 and np.isnan(qe[0, 1]) and np.isnan(qe[1, 0]) and qe[1, 1] == qe[0, 0]


def _scores(q, kt, n):
    ql, qc, qe = _limbs(q)
    sc = np.full((q.shape[0], n + 16), 7.0, np.float32)
    kpad = np.zeros((16, kt.shape[1]), np.uint8)
    stail = np.empty((q.shape[0], 16), np.float32)
    cpu_q8._tile_scores_q8(ql, qc, qe, kt, n, sc, kpad, stail)
    return sc


@needs_vnni
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_scores_are_q_dot_the_stored_keys(D, rows):
    rng = np.random.default_rng(D * 10 + rows)
    n = 16 * 3 + 5                                                # whole blocks of 16 keys and a tail
    kf = rng.standard_normal((n, D)).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 3, (n, 1))
    kf[2] = 0.0
    kf[3, :32] = 127.0                                            # quants at the edge of int8
    kf[3, 32:] = -1.0
    kt, _ = storage.quantize(kf, "q8_0")
    q = _queries(rng, rows, D)
    sc = _scores(q, kt, n)
    kd = storage.dequantize(kt, "q8_0", D).astype(np.float64)
    want = q.astype(np.float64) @ kd.T
    bound = np.abs(q.astype(np.float64)) @ np.abs(kd.T)           # the size of float32 rounding's terms
    assert (np.abs(sc[:, :n] - want) <= 1e-6 * bound).all()
    assert (sc[:, n:] == 7.0).all()                               # nothing written past the keys


@needs_vnni
def test_a_rows_bits_depend_only_on_it_and_the_key():
    rng = np.random.default_rng(3)
    D = 128
    kf = rng.standard_normal((80, D)).astype(np.float32)
    kt, _ = storage.quantize(kf, "q8_0")
    q = rng.standard_normal((7, D)).astype(np.float32)
    together = _scores(q, kt, 80)
    for r in range(7):                                            # alone, and with fewer keys (a tail)
        assert np.array_equal(_scores(q[r:r + 1], kt, 80)[0, :80], together[r, :80])
        assert np.array_equal(_scores(q[r:r + 1], kt, 37)[0, :37], together[r, :37])


@njit
def _limb_rows(qf, kind):
    ql, qc, qe = cpu_q8.limbs_for(qf, kind)
    return ql.shape[0]


def test_the_integer_path_takes_q8_0_keys_in_whole_blocks_only():
    q64, q80 = np.ones((3, 64), np.float32), np.ones((3, 80), np.float32)
    assert _limb_rows(q64, 3) == (3 if cpu_q8.AVAILABLE else 0)
    assert _limb_rows(q80, 3) == 0                                # a half block: the float kernels
    assert _limb_rows(q64, 4) == 0 and _limb_rows(q64, 1) == 0    # q4_0, float16


@needs_vnni
def test_a_key_or_query_that_is_not_finite_scores_nan():
    """An inf block scale (a q8_0 block past float16's range) scores NaN even where the integer sum is 0,
    as the float kernels' 0 * inf does; a NaN query block likewise. The other keys and rows are unchanged."""
    rng = np.random.default_rng(5)
    kf = rng.standard_normal((20, 64)).astype(np.float32)
    kt, _ = storage.quantize(kf, "q8_0")
    q = rng.standard_normal((2, 64)).astype(np.float32)
    clean = _scores(q, kt, 20)
    kt[4, 0:2] = np.array([np.inf], np.float16).view(np.uint8)     # key 4, block 0: scale inf
    kt[4, 2:34] = 0                                                 # and every quant 0
    q[1, 40] = np.nan
    sc = _scores(q, kt, 20)
    assert np.isnan(sc[0, 4]) and np.isnan(sc[1, :20]).all()
    keep = np.arange(20) != 4
    assert np.array_equal(sc[0, :20][keep], clean[0, :20][keep])
