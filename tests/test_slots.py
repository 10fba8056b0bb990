"""Slot arithmetic with literal expected slots, and the window off-by-one pinned down."""

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache, attend
from streamattn.kv import snapshot
from streamattn.kv.storage import ring_slots, slot_positions
from streamattn.kv.reference import visible


def test_ring_slots_literal():
    # sinks 2, ring 3: positions 0,1 fixed; 2,3,4 -> slots 2,3,4; 5 wraps to 2
    assert ring_slots(np.arange(9), sinks=2, ring=3).tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 2]
    assert ring_slots(np.arange(7), sinks=0, ring=4).tolist() == [0, 1, 2, 3, 0, 1, 2]


def test_slot_positions_literal():
    assert slot_positions(0, slots=5, sinks=2).tolist() == [-1, -1, -1, -1, -1]
    assert slot_positions(1, slots=5, sinks=2).tolist() == [0, -1, -1, -1, -1]
    assert slot_positions(3, slots=5, sinks=2).tolist() == [0, 1, 2, -1, -1]
    assert slot_positions(6, slots=5, sinks=2).tolist() == [0, 1, 5, 3, 4]
    assert slot_positions(10, slots=4, sinks=0).tolist() == [8, 9, 6, 7]


def test_slots_formula_n_s_plus_n_c_plus_C_minus_1():
    assert CacheSpec(batch=1, kv_heads=1, head_dim=8, window=512).slots == 512
    assert CacheSpec(batch=1, kv_heads=1, head_dim=8, window=512, sinks=4, max_chunk=64).slots == 579


def test_cache_writes_where_the_formula_says():
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=1, window=3, sinks=1, max_chunk=2)  # 5 slots
    cache = KVCache(spec)
    for chunk in ([0.0, 1.0], [2.0], [3.0, 4.0], [5.0, 6.0]):
        x = np.array(chunk, np.float32).reshape(1, 1, -1, 1)
        cache.append(x, x)
    # positions 0..6: 0 -> slot 0; 1..6 -> 1 + (j-1) % 4 = 1,2,3,4,1,2
    assert cache.k[0, 0, :, 0].tolist() == [0.0, 5.0, 6.0, 3.0, 4.0]


@pytest.mark.parametrize("window", [1, 2, 4])
def test_window_counts_the_current_token(window):
    """window n_c: exactly n_c keys, the current one included (HF keeps n_c - 1 past + current)."""
    mask = visible(np.arange(10), np.arange(10), window=window)
    assert mask.sum(axis=1)[window:].tolist() == [window] * (10 - window)
    assert mask[9].nonzero()[0].tolist() == list(range(10 - window, 10))


def test_window_one_is_the_current_value():
    """window=1: the output is exactly the current V row, whatever q is."""
    rng = np.random.default_rng(0)
    cache = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=64, window=1))
    for _ in range(5):
        k, v = rng.standard_normal((2, 1, 1, 1, 64)).astype(np.float32)
        cache.append(k, v)
        out, _ = attend(rng.standard_normal((1, 2, 1, 64)).astype(np.float32), cache, backend="cpu")
        np.testing.assert_allclose(out[0, :, 0], np.repeat(v[0, :, 0], 2, 0), rtol=1e-6)


def test_window_memory_is_fixed():
    """Sliding-window layers never allocate the full context (vLLM PR #39254)."""
    spec = CacheSpec(batch=2, kv_heads=1, head_dim=8, window=16, sinks=2, max_chunk=4)
    cache = KVCache(spec)
    before = cache.nbytes
    x = np.zeros((2, 1, 4, 8), np.float32)
    for _ in range(100):
        cache.append(x, x)
    assert cache.nbytes == before == 2 * 2 * 1 * (2 + 16 + 3) * 8 * 4


def test_causal_grows_by_doubling_and_keeps_rows():
    cache = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=2))
    x = np.arange(600, dtype=np.float32).reshape(1, 1, 300, 2)
    cache.append(x, x)
    assert cache.slots == 512
    cache.append(x, x)
    assert cache.slots == 1024 and np.array_equal(cache.k[0, 0, 300:600], x[0, 0])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_storage_starts_on_a_cache_line(tmp_path, dtype):
    """K and V storage is 64-byte aligned when created, after it grows, and when a snapshot is read back."""
    def aligned(c):
        return all(a.ctypes.data % 64 == 0 and a.flags.c_contiguous and a.flags.writeable for a in (c.k, c.v))

    spec = CacheSpec(batch=2, kv_heads=3, head_dim=8, dtype=dtype)
    cache = KVCache(spec)
    assert aligned(cache) and not cache.k.any()
    x = np.ones((2, 3, 300, 8), np.float32)
    cache.append(x, x)                                         # 256 -> 512 slots
    assert cache.slots == 512 and aligned(cache)
    snapshot.save(tmp_path / "c.npz", cache)
    again = snapshot.load(tmp_path / "c.npz")
    assert aligned(again) and np.array_equal(again.k, cache.k)
    snapshot.restore(cache, tmp_path / "c.npz")
    assert aligned(cache)
