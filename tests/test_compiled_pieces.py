"""A matrix held as row groups of different kinds (Llama's Q4_K_M wqkv: Q4_K q and k beside a Q6_K v) in the
compiled layer: one parallel region whose threads take the groups' interleaved groups by bytes
(``compiled.share``), against each group's own driver over all its rows.

The whole model's bits with such matrices are in tests/test_quant_types_model.py.
"""

import numba
import numpy as np
import pytest
from numba import typeof

from _model_util import random_blocks
from streamattn.models import compiled
from streamattn.quant import matmul as qmatmul
from streamattn.quant.weights import pack

pytestmark = pytest.mark.skipif(not qmatmul.HAVE_KERNELS, reason="the packed kernels need AVX2")

K = 512


def parts(starts_per_n: list, total: int, T: int) -> list:
    """For each part t of T: every (row group, g) whose first byte is in [total t / T, total (t + 1) / T)."""
    out = []
    for t in range(T):
        lo, hi = total * t // T, total * (t + 1) // T
        got = []
        for i, (start, per, n) in enumerate(starts_per_n):
            g0, g1 = compiled.share(start, per, n, lo, hi)
            assert 0 <= g0 <= g1 <= n
            got += [(i, g) for g in range(g0, g1)]
        out.append(got)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_byte_shares_give_every_group_to_one_part_and_parts_even_bytes(seed):
    rng = np.random.default_rng(seed)
    n_groups = rng.integers(0, 40, rng.integers(1, 4))
    per = rng.integers(1, 5000, n_groups.shape[0])
    starts = np.concatenate([[0], np.cumsum(n_groups * per)[:-1]])
    total = int((n_groups * per).sum())
    T = int(rng.integers(1, 9))
    got = parts([(int(s), int(p), int(n)) for s, p, n in zip(starts, per, n_groups)], total, T)
    flat = [x for part in got for x in part]
    assert sorted(flat) == [(i, g) for i in range(n_groups.shape[0]) for g in range(n_groups[i])]   # once each
    assert flat == sorted(flat)                            # in order: each part one run of groups
    for part in got:                                       # a part's bytes within one group of its share
        assert abs(sum(int(per[i]) for i, _ in part) - total / T) <= per.max() + 1


def test_share_edges():
    assert compiled.share(0, 10, 5, 0, 50) == (0, 5)
    assert compiled.share(0, 10, 5, 1, 50) == (1, 5)        # group 0 starts before the part
    assert compiled.share(100, 10, 5, 0, 100) == (0, 0)     # the part ends where the row group starts
    assert compiled.share(100, 10, 5, 0, 101) == (0, 1)
    assert compiled.share(0, 10, 5, 200, 300) == (5, 5)     # after it
    assert compiled.group_bytes(np.zeros((3, 7), np.uint8), np.zeros((3, 2), np.uint16),
                                np.zeros((1, 1), np.float32)) == 7 + 4     # a kind without a min plane


def pieces(rows: tuple, types: tuple, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    return tuple(pack("t", t, random_blocks(t, n, K, rng), (n, K)) for n, t in zip(rows, types))


def test_pieces_give_each_groups_own_bits_on_one_and_two_threads():
    """Odd row counts (a last interleaved group with padding rows), the two threads' boundary inside a row group;
    1, 3 and 9 activation rows (the drivers' 1-row, R-row and 8-row passes); a norm and a gated activation
    quantized first. (One matrix type: its driver is compiled in the test's process, not cached. Two row
    groups: tests/test_quant_types_model.py's gate/up.)"""
    rows = (37, 19, 21)
    ws = pieces(rows, ("Q4_K", "Q4_K", "Q6_K"))
    mm = qmatmul.Matmuls(qmatmul.KernelPlan())
    wt = compiled._matrix(ws, mm.plan)
    assert wt is not None
    per = [compiled.group_bytes(w[0], w[1], w[2]) for w in wt]
    starts = np.concatenate([[0], np.cumsum([p * w[0].shape[0] for p, w in zip(per, wt)])])
    cut = int(starts[-1]) // 2                               # the two threads' boundary
    inside = [compiled.share(int(a), int(p), w[0].shape[0], 0, cut) for a, p, w in zip(starts, per, wt)]
    assert any(0 < g1 < w[0].shape[0] for (_, g1), w in zip(inside, wt)), (per, starts, inside)
    drive = compiled._drive(typeof(wt))
    before = numba.get_num_threads()
    two = numba.config.NUMBA_NUM_THREADS >= 2
    counts = [1, 2] if two else [1]
    try:
        for mode, M in [(qmatmul.NORM, 1), (qmatmul.NORM, 3), (qmatmul.SILU, 9), (qmatmul.SILU, 1)]:
            x = np.random.default_rng(M).standard_normal((M, K * (2 if mode == qmatmul.SILU else 1)),
                                                         dtype=np.float32)
            nw = np.linspace(0.5, 1.5, K, dtype=np.float32)
            numba.set_num_threads(1)
            if mode == qmatmul.NORM:
                want = np.concatenate([mm.norm(x, nw, 1e-5, w) for w in ws], 1)
            else:
                want = np.concatenate([mm.glu(x, False, w) for w in ws], 1)
            assert want.shape == (M, sum(rows))
            for n in counts:
                numba.set_num_threads(n)
                for one_thread in (True, False):
                    np.testing.assert_array_equal(drive(np.int64(mode), x, nw, 1e-5, wt, one_thread), want)
    finally:
        numba.set_num_threads(before)
    # the parallel region reads the thread count by symbol, not through a ctypes pointer (which would keep
    # the compiled layer holding such a matrix off the disk cache)
    assert drive.overloads and not any(c.library.has_dynamic_globals for c in drive.overloads.values())
    if not two:
        pytest.skip("checked on one thread only: two need NUMBA_NUM_THREADS >= 2")
