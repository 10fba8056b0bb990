"""Bad input: a clear error naming the argument and value, and the cache bit-for-bit unchanged."""

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache, attend


def snapshot(cache):
    return (cache.k.copy(), cache.v.copy(), cache.lengths.copy(), cache.last_counts.copy(), cache.held_from.copy(),
            cache.slots)


def assert_unchanged(cache, snap):
    k, v, lengths, last, held, slots = snap
    assert cache.slots == slots
    assert np.array_equal(cache.k.view(np.uint8), k.view(np.uint8))
    assert np.array_equal(cache.v.view(np.uint8), v.view(np.uint8))
    assert np.array_equal(cache.lengths, lengths) and np.array_equal(cache.last_counts, last)
    assert np.array_equal(cache.held_from, held)


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=0), r"window must be an integer >= 1 \(got 0\); use window=None"),
    (dict(window=-3), r"window must be an integer >= 1 \(got -3\)"),
    (dict(window=4, sinks=-1), r"sinks must be an integer >= 0 \(got -1\)"),
    (dict(sinks=2), r"sinks=2 needs a window"),
    (dict(dtype="int8"), r"dtype must be one of .* \(got 'int8'\)"),
    (dict(max_chunk=0), r"max_chunk must be an integer >= 1 \(got 0\)"),
    (dict(window=8, max_len=100), r"max_len=100 applies to causal caches only"),
    (dict(head_dim=2.5), r"head_dim must be an integer >= 1 \(got 2.5\)"),
])
def test_spec_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheSpec(**{**dict(batch=1, kv_heads=1, head_dim=8), **kwargs})


@pytest.fixture(params=[dict(window=3, sinks=1, max_chunk=2), dict(max_len=6)])
def filled(request):
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=8, dtype="float16", **request.param)
    cache = KVCache(spec)
    rng = np.random.default_rng(0)
    for _ in range(2):
        x = rng.standard_normal((2, 2, 2, 8)).astype(np.float32)
        cache.append(x, x)
    return cache


def good(T=1, batch=2, heads=2, d=8):
    return np.ones((batch, heads, T, d), np.float32)


@pytest.mark.parametrize("args,err,match", [
    ((good(batch=3), good(batch=3)), ValueError, r"k must have shape \[batch=2, kv_heads=2, T>=1, head_dim=8\] \(got \(3, 2, 1, 8\)\)"),
    ((good(heads=3), good(heads=3)), ValueError, r"kv_heads=2"),
    ((good(d=4), good(d=4)), ValueError, r"head_dim=8"),
    ((good(), good(T=2)), ValueError, r"k and v must have the same shape"),
    ((good().astype(np.int32), good()), TypeError, r"k must hold floats \(got dtype int32\)"),
    ((good().tolist(), good()), TypeError, r"k must be a numpy array"),
])
def test_append_rejects_bad_arrays(filled, args, err, match):
    snap = snapshot(filled)
    with pytest.raises(err, match=match):
        filled.append(*args)
    assert_unchanged(filled, snap)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("which", ["k", "v"])
def test_append_rejects_non_finite(filled, bad, which):
    snap = snapshot(filled)
    k, v = good(2), good(2)
    (k if which == "k" else v)[1, 1, 1, 3] = bad
    with pytest.raises(ValueError, match=rf"{which} holds NaN or inf for sequence 1; the cache is unchanged"):
        filled.append(k, v)
    assert_unchanged(filled, snap)


def test_non_finite_in_padding_is_ignored(filled):
    k = good(2)
    k[0, 0, 1] = np.nan
    before = filled.lengths.copy()
    filled.append(k, good(2), counts=[1, 2])   # row 1 of sequence 0 is padding: accepted, never stored
    assert (filled.lengths - before).tolist() == [1, 2] and filled.last_counts.tolist() == [1, 2]
    assert np.isfinite(filled.k.astype(np.float32)).all()


def test_non_finite_check_can_be_turned_off():
    cache = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=8, check_finite=False))
    x = good(1, 1, 1)
    x[..., 0] = np.nan
    cache.append(x, x)
    assert cache.lengths.tolist() == [1]


def test_chunk_longer_than_C_in_window_mode():
    cache = KVCache(CacheSpec(batch=2, kv_heads=2, head_dim=8, window=3, sinks=1, max_chunk=2))
    cache.append(good(2), good(2))
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"a chunk of 3 tokens exceeds max_chunk=2"):
        cache.append(good(3), good(3))
    assert_unchanged(cache, snap)
    causal = KVCache(CacheSpec(batch=2, kv_heads=2, head_dim=8))
    causal.append(good(300), good(300))   # causal caches take chunks of any length
    assert causal.lengths.tolist() == [300, 300]


def test_exceeding_the_causal_cap():
    cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=8, max_len=5))
    cache.append(good(4, heads=1), good(4, heads=1))
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"sequence 0 would reach 6 tokens, over max_len=5"):
        cache.append(good(2, heads=1), good(2, heads=1), counts=[2, 1])
    assert_unchanged(cache, snap)
    cache.append(good(2, heads=1), good(2, heads=1), counts=[1, 1])  # exactly at the cap is fine
    assert cache.lengths.tolist() == [5, 5] and cache.slots == 5


@pytest.mark.parametrize("counts,match", [
    ([1, 2, 3], r"counts must be an int array of shape \(2,\)"),
    ([3, 0], r"counts must lie in 0..T=2 \(got \[3, 0\]\)"),
    ([-1, 0], r"counts must lie in 0..T=2"),
    ([0.5, 1.0], r"counts must be an int array"),
])
def test_append_rejects_bad_counts(filled, counts, match):
    snap = snapshot(filled)
    with pytest.raises(ValueError, match=match):
        filled.append(good(2), good(2), counts=counts)
    assert_unchanged(filled, snap)


def test_attend_rejects_bad_queries(filled):
    snap = snapshot(filled)
    with pytest.raises(ValueError, match=r"q must have shape \[batch=2, q_heads=k\*2, T, head_dim=8\] \(got \(2, 3, 1, 8\)\)"):
        attend(np.ones((2, 3, 1, 8), np.float32), filled, backend="cpu")
    with pytest.raises(ValueError, match=r"backend must be one of"):
        attend(good(2), filled, backend="tpu")
    with pytest.raises(ValueError, match=r"counts must be 2 ints in 0..min\(T=1, lengths\)"):
        attend(good(1), filled, backend="cpu", counts=[2, 2])
    assert_unchanged(filled, snap)


def test_reset_one_sequence():
    rng = np.random.default_rng(0)
    cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=8, window=4))
    x = rng.standard_normal((2, 1, 1, 8)).astype(np.float32)
    for _ in range(6):
        cache.append(x, x)
    keep = cache.k[1].copy()
    cache.reset(0)
    assert cache.lengths.tolist() == [0, 6] and not cache.k[0].any() and np.array_equal(cache.k[1], keep)
    with pytest.raises(ValueError, match=r"b must be a sequence index in 0..1 \(got 2\)"):
        cache.reset(2)
