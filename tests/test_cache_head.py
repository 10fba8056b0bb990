"""KVCache.head(n): a view of the first n sequences that appends and attends into the parent's rows."""

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache, attend


@pytest.mark.parametrize("window, sinks", [(None, 0), (5, 0), (5, 2)])
def test_head_view_appends_into_the_parent_exactly(window, sinks):
    rng = np.random.default_rng(0)
    spec = CacheSpec(batch=4, kv_heads=2, head_dim=8, window=window, sinks=sinks, max_chunk=3)
    a, b = KVCache(spec), KVCache(spec)
    for _ in range(7):                                   # different lengths per row; rings wrap
        cnt = rng.integers(0, 4, 4)
        k, v = rng.standard_normal((4, 2, 3, 8)), rng.standard_normal((4, 2, 3, 8))
        a.append(k, v, counts=cnt)
        b.append(k, v, counts=cnt)
    for _ in range(5):
        k, v = rng.standard_normal((2, 2, 3, 8)), rng.standard_normal((2, 2, 3, 8))
        cnt = rng.integers(0, 4, 2)
        if window is None:
            a.reserve(int((a.lengths[:2] + cnt).max()))
        view = a.head(2)
        view.append(k, v, counts=cnt)
        b.append(np.concatenate([k, np.zeros_like(k)]), np.concatenate([v, np.zeros_like(v)]),
                 counts=np.concatenate([cnt, [0, 0]]))
        q = rng.standard_normal((2, 4, 3, 8))
        o_view, _ = attend(q, view, counts=cnt, backend="reference")
        o_full, _ = attend(np.concatenate([q, q]), b, counts=np.concatenate([cnt, [0, 0]]), backend="reference")
        for r in range(2):
            np.testing.assert_array_equal(o_view[r, :, :cnt[r]], o_full[r, :, :cnt[r]])
    n = a.slots
    np.testing.assert_array_equal(a.k[:, :, :n], b.k[:, :, :n])
    np.testing.assert_array_equal(a.v[:, :, :n], b.v[:, :, :n])
    for name in ("lengths", "held_from"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_array_equal(a.last_counts[:2], b.last_counts[:2])   # rows past the view: untouched


def test_head_view_cannot_grow_and_checks_n():
    a = KVCache(CacheSpec(batch=3, kv_heads=1, head_dim=4, max_chunk=64))
    with pytest.raises(ValueError, match="n must be an integer in 1..batch=3"):
        a.head(4)
    view = a.head(1)
    big = np.ones((1, 1, 64, 4))
    for _ in range(a.slots // 64):                      # fill the initial capacity through the view
        view.append(big, big)
    with pytest.raises(ValueError, match="reserve"):
        view.append(big, big)
    n0 = a.slots
    assert a.lengths.tolist() == [n0, 0, 0]             # the refused append changed nothing
    a.reserve(n0 + 64)
    a.head(1).append(big, big)
    assert a.lengths.tolist() == [n0 + 64, 0, 0] and a.slots >= n0 + 64
