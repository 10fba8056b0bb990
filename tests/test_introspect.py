"""Introspection: weights over absolute positions, sink vs window mass, V contributions."""

import numpy as np

from streamattn import CacheSpec, KVCache, attend
from streamattn.kv.introspect import inspect_attention


def filled_cache(rng, steps=30):
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=64, window=6, sinks=2)
    cache = KVCache(spec)
    for _ in range(steps):
        k, v = rng.standard_normal((2, 1, 1, 1, 64)).astype(np.float32)
        cache.append(k, v)
    return cache


def test_report_matches_the_kernel_and_the_mask():
    rng = np.random.default_rng(0)
    cache = filled_cache(rng)
    q = rng.standard_normal((1, 3, 1, 64)).astype(np.float32)
    rep = inspect_attention(q, cache)
    assert rep.positions.tolist() == [0, 1, 24, 25, 26, 27, 28, 29]
    assert rep.q_positions.tolist() == [29]
    np.testing.assert_allclose(rep.sink_mass + rep.window_mass, 1.0)
    np.testing.assert_allclose(rep.sink_mass[:, 0], rep.weights[:, 0, :2].sum(-1))
    out, _ = attend(q, cache, backend="cpu")
    np.testing.assert_allclose(rep.out[:, 0], out[0, :, 0], rtol=1e-5, atol=1e-6)


def test_soft_capped_report_matches_the_kernel():
    """With the model's soft cap (gemma2) the weights are those the kernel used, not the uncapped ones."""
    rng = np.random.default_rng(1)
    cache = filled_cache(rng)
    q = 8 * rng.standard_normal((1, 3, 1, 64)).astype(np.float32)
    rep = inspect_attention(q, cache, softcap=2.0)
    out, _ = attend(q, cache, backend="cpu", softcap=2.0)
    np.testing.assert_allclose(rep.out[:, 0], out[0, :, 0], rtol=1e-5, atol=1e-6)
    assert np.abs(rep.weights - inspect_attention(q, cache).weights).max() > 0.1


def test_contributions_expose_a_broken_v_row():
    """Same weights, a corrupted V row: the weights stay, that row's contribution jumps."""
    rng = np.random.default_rng(1)
    cache = filled_cache(rng)
    q = rng.standard_normal((1, 1, 1, 64)).astype(np.float32)
    before = inspect_attention(q, cache)
    slot = cache.slots_of(np.array([27]))[0]
    cache.v[0, 0, slot] *= 100.0
    after = inspect_attention(q, cache)
    np.testing.assert_allclose(after.weights, before.weights)
    i = before.positions.tolist().index(27)
    ratio = after.contributions[0, 0] / before.contributions[0, 0]
    assert np.isclose(ratio[i], 100.0) and np.allclose(np.delete(ratio, i), 1.0)


def test_top_positions():
    rng = np.random.default_rng(2)
    cache = filled_cache(rng)
    k, _, pos = cache.temporal_view(0)
    q = (k[:, pos.tolist().index(25)] * 10)[None, :, None, :]   # point the query at position 25
    rep = inspect_attention(q, cache)
    assert rep.top(0, k=1)[0][0] == 25
