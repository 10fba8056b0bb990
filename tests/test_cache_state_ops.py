"""KVCache's own state operations (what snapshot, state and the benchmarks call): exact, and refusing bad
input with the cache unchanged."""

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache
from test_errors import assert_unchanged, snapshot

SPEC = CacheSpec(batch=2, kv_heads=2, head_dim=8, dtype="float16", window=4, sinks=1, max_chunk=2)  # 6 slots


def filled(spec=SPEC, steps=9):
    cache = KVCache(spec)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        x = rng.standard_normal((spec.batch, spec.kv_heads, 1, spec.head_dim)).astype(np.float32)
        cache.append(x, -x, counts=[1, 1 if _ % 2 else 0])
    return cache


def test_export_then_from_state_is_bit_exact_and_take_state_swaps_it_in():
    cache = filled()
    st = cache.export_state()
    assert st["k"].shape == (2, 2, 6, 8) and st["lengths"].tolist() == [9, 4]
    copy = KVCache.from_state(SPEC, st, slots=cache.slots)
    assert_unchanged(copy, snapshot(cache))
    other = KVCache(SPEC)
    other.take_state(copy)
    assert_unchanged(other, snapshot(cache))
    causal = filled(CacheSpec(batch=2, kv_heads=2, head_dim=8), steps=3)
    st = causal.export_state(slice(0, 1))                       # one row, only the used slots
    assert st["k"].shape == (1, 2, 3, 8) and st["held_from"].tolist() == [0]


def test_write_sequence_fills_one_sequence_and_defaults_held_from_to_appends_alone():
    cache, src = KVCache(SPEC), filled()
    st = src.export_state(slice(0, 1))
    cache.write_sequence(1, st["k"][0], st["v"][0], length=9, last_count=1)
    assert cache.lengths.tolist() == [0, 9] and cache.held_from.tolist() == [1, 4]   # max(n_s, L - R) = 9 - 5
    assert np.array_equal(cache.k[1], src.k[0]) and not cache.k[0].any()


@pytest.mark.parametrize("change,match", [
    (dict(b=2), r"b must be a sequence index in 0..1 \(got 2\)"),
    (dict(k=np.zeros((2, 3, 8), np.float32)), r"k must be float16 \[2, n, 8\] \(got float32"),
    (dict(length=2), r"inconsistent \(n <= min\(slots=6, length\)\)"),
    (dict(last_count=10), r"last_count=10 are inconsistent"),
])
def test_write_sequence_refuses_bad_input_and_changes_nothing(change, match):
    cache = filled()
    st = cache.export_state(slice(0, 1))
    args = dict(b=0, k=st["k"][0], v=st["v"][0], length=9, last_count=1) | change
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=match):
        cache.write_sequence(args.pop("b"), args.pop("k"), args.pop("v"), **args)
    assert_unchanged(cache, snap)


def test_truncate_and_take_state_refuse_bad_input_and_change_nothing():
    cache = filled()
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"k must be an integer in 0..lengths\[1\]=4 \(got 5\)"):
        cache.truncate(1, 5)
    with pytest.raises(ValueError, match=r"b must be a sequence index in 0..1 \(got True\)"):
        cache.truncate(True, 1)
    with pytest.raises(ValueError, match="take_state needs a cache with the same spec and device"):
        cache.take_state(KVCache(CacheSpec(batch=2, kv_heads=2, head_dim=8, window=4, sinks=1, max_chunk=2)))
    assert_unchanged(cache, snap)
    cache.truncate(1, 2)                                   # zeroes what it drops
    assert cache.lengths.tolist() == [9, 2] and not cache.k[1][:, 2:].any() and cache.last_counts[1] == 0
