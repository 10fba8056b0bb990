"""Attention at the float32 edge (issue 29 group 8): finite q, k, v whose weighted sum overflows float32
while the answer does not are answered as the float64 reference answers; scores past float32 are refused
by name, never answered NaN silently."""

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache
from streamattn.kv.dispatch import attend
from streamattn.kv.reference import attention

BACKENDS = ["cpu", "reference"]


def cache_with(k, v, **spec):
    c = KVCache(CacheSpec(batch=1, kv_heads=k.shape[1], head_dim=k.shape[3], **spec))
    c.append(k, v)
    return c


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 3, 19])
def test_huge_values_are_answered_as_the_reference(backend, T):
    rng = np.random.default_rng(T)
    k = rng.standard_normal((1, 1, T, 8)).astype(np.float32)
    v = np.full((1, 1, T, 8), 3e38, np.float32)
    v[..., 1] = -3e38
    v[..., 2] = rng.uniform(-3e38, 3e38, T)
    q = rng.standard_normal((1, 2, T, 8)).astype(np.float32)
    out, lse = attend(q, cache_with(k, v), backend=backend)
    for t in range(T):
        ro, rl = attention(q[0][:, t:t + 1], k[0][:, :t + 1], v[0][:, :t + 1], [t])
        np.testing.assert_allclose(out[0, :, t], ro[:, 0].astype(np.float32), rtol=1e-5)
        np.testing.assert_allclose(lse[0, :, t], rl[:, 0], rtol=1e-5)
    assert np.isfinite(out).all() and out[0, 0, 0, 0] == np.float32(3e38)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")   # the reference's f32 lse
@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_past_float32_are_refused(backend):
    k = np.ones((1, 1, 4, 8), np.float32)
    c = cache_with(k, np.ones_like(k))
    q = np.ones((1, 1, 4, 8), np.float32)
    q[0, 0, 2] = 3e38
    with pytest.raises(ValueError, match=r"attention scores overflow float32 \(sequence 0, query head 0, row 2\)"):
        attend(q, c, backend=backend)
    with pytest.raises(ValueError, match="attention scores overflow float32"):
        attend(q, c, backend=backend, scale=1.0)
    with pytest.raises(ValueError, match="attention scores overflow float32"):
        attend(np.ones_like(q), c, backend=backend, scale=1e38)
    out, _ = attend(np.ones_like(q), c, backend=backend)                   # the cache is as it was
    assert np.allclose(out, 1.0)


def test_unchecked_non_finite_values_are_not_recomputed():
    k = np.ones((1, 1, 2, 8), np.float32)
    v = k.copy()
    v[0, 0, 0, 0] = np.inf
    c = cache_with(k, v, check_finite=False)
    out, lse = attend(np.ones((1, 1, 2, 8), np.float32), c, backend="cpu")
    assert not np.isfinite(out[0, 0, :, 0]).any()         # as the oracle: an inf value is not a float32 edge
