"""float32 -> bfloat16 as storage.to_storage stores it: round to nearest even, NaN kept NaN.

The rounding adds 0x7FFF plus the kept half's low bit; for a NaN with a large payload that carry wraps past
the sign (0x7FFFFFFF, the NaN every CUDA float op produces, became 0x8000: -0.0) and the finite check passed
it. A NaN now keeps its top half, quieted; every other input must round exactly as the plain formula does.
"""
import numpy as np
import pytest

from streamattn import CacheSpec, KVCache
from streamattn.kv.storage import check_stored_finite, to_storage

NAN_BITS = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0xFFC00000, 0x7FFF8000, 0xFFFF8000, 0x7F80FFFF]
# +inf, -inf; the largest finite float32 (rounds up to inf, as before); the largest that stays finite; a tie
# below it that rounds down to even; its neighbour that rounds up to inf; zeros and the smallest subnormal
EDGE_BITS = {0x7F800000: 0x7F80, 0xFF800000: 0xFF80, 0x7F7FFFFF: 0x7F80, 0xFF7FFFFF: 0xFF80,
             0x7F7F7FFF: 0x7F7F, 0x7F7E8000: 0x7F7E, 0x7F7F8000: 0x7F80, 0: 0, 0x80000000: 0x8000, 1: 0}


def _plain(bits):
    """The rounding rule as it was before NaNs were kept (uint64, so nothing wraps; only NaNs differ)."""
    b = bits.astype(np.uint64)
    return (((b + ((b >> 16) & 1) + 0x7FFF) & 0xFFFFFFFF) >> 16).astype(np.uint16)


def test_nans_stay_nan_with_their_sign():
    x = np.array(NAN_BITS, np.uint32)
    got = to_storage(x.view(np.float32), "bfloat16", np)
    assert got.dtype == np.uint16
    assert ((got & 0x7F80) == 0x7F80).all() and ((got & 0x7F) != 0).all(), [hex(g) for g in got]
    assert np.array_equal(got >> 15, (x >> 31).astype(np.uint16))          # the sign kept
    assert np.array_equal(got & 0x40, np.full_like(got, 0x40))            # quiet
    assert int(got[0]) == 0x7FFF and int(got[1]) == 0xFFFF and int(got[2]) == 0x7FC0 and int(got[3]) == 0x7FC0
    assert int(_plain(x[:1])[0]) == 0x8000                                # what the old rule stored: -0.0


def test_infinities_and_edges_unchanged():
    x = np.array(list(EDGE_BITS), np.uint32)
    got = to_storage(x.view(np.float32), "bfloat16", np)
    assert [hex(g) for g in got] == [hex(w) for w in EDGE_BITS.values()]


def test_every_non_nan_rounds_as_before():
    """Four million random bit patterns and all 2^16 patterns around each rounding boundary's neighbours of
    one exponent: equal to the plain formula wherever the input is not NaN."""
    rng = np.random.default_rng(7)
    low = np.arange(2**16, dtype=np.uint32)
    x = np.concatenate([rng.integers(0, 2**32, 4_000_000, dtype=np.uint32),
                        0x3F810000 + low, 0x7F7F0000 + low, 0xFF7F0000 + low, 0x00000000 + low])
    got = to_storage(x.view(np.float32), "bfloat16", np)
    nan = (x & 0x7FFFFFFF) > 0x7F800000
    assert nan.any() and (~nan).sum() > 3_900_000
    assert np.array_equal(got[~nan], _plain(x[~nan]))
    assert ((got[nan] & 0x7FFF) > 0x7F80).all()


@pytest.mark.parametrize("nan", NAN_BITS[:4])
def test_finite_check_refuses_every_nan(nan):
    """Each NaN as stored is refused by check_stored_finite and by the cache, exactly as 0x7FC00000 is."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
    v = rng.standard_normal((2, 1, 2, 16)).astype(np.float32)
    k.view(np.uint32)[1, 0, 1, 5] = nan
    ks, vs = to_storage(k, "bfloat16", np), to_storage(v, "bfloat16", np)
    with pytest.raises(ValueError, match="k holds NaN or inf for sequence 1"):
        check_stored_finite(ks, vs, np.array([2, 2]), "bfloat16", np)
    check_stored_finite(ks, vs, np.array([2, 1]), "bfloat16", np)       # the row is padding: accepted
    cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=16, dtype="bfloat16", window=4, max_chunk=2))
    with pytest.raises(ValueError, match="k holds NaN or inf for sequence 1; the cache is unchanged"):
        cache.append(k, v)
    assert (cache.lengths == 0).all()
