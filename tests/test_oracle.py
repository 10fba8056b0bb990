"""Every backend equals float64 full masked attention over the whole history, after every append."""

import zlib

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache, attend
from streamattn.kv import reference
from oracle import History, check

BACKENDS = ["cpu", "reference"]


def stream(spec, q_heads, steps, backend, *, seed=0, chunks=None, ragged=False, scale=None, softcap=None,
           q_gain=1.0):
    """Append ``steps`` chunks (sizes from ``chunks`` or 1), checking every output against the oracle
    (queries N(0, q_gain²); scores soft-capped by ``softcap``)."""
    rng = np.random.default_rng(seed)
    cache, hist = KVCache(spec), History(spec.batch, spec)   # (quantized storage: the values as stored)
    for step in range(steps):
        T = int(chunks[step % len(chunks)]) if chunks else 1
        shape = (spec.batch, spec.kv_heads, T, spec.head_dim)
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        counts = rng.integers(0 if ragged else T, T + 1, size=spec.batch) if ragged else np.full(spec.batch, T)
        cache.append(k, v, counts=counts)
        hist.append(k, v, counts)
        q = (q_gain * rng.standard_normal((spec.batch, q_heads, T, spec.head_dim))).astype(np.float32)
        out, lse = attend(q, cache, backend=backend, scale=scale, softcap=softcap)
        check(out, lse, q, hist, counts, spec, scale, what=f"{backend} step {step}", softcap=softcap)
    return cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("window,sinks", [(None, 0), (1, 0), (3, 0), (19, 0), (5, 2), (19, 3)])
def test_decode_every_mode_and_dtype(backend, dtype, window, sinks):
    spec = CacheSpec(batch=2, kv_heads=3, head_dim=64, dtype=dtype, window=window, sinks=sinks)
    steps = 3 * (spec.slots or 20) + 7  # >= 3 full wraps of the ring
    stream(spec, 9, steps, backend, seed=zlib.crc32(f"{dtype}/{window}/{sinks}".encode()) % 1000)  # not hash(): salted


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window,sinks,C", [(None, 0, 4), (3, 0, 3), (19, 0, 7), (5, 2, 5), (1, 1, 3)])
def test_chunks_of_every_size_up_to_C(backend, window, sinks, C):
    """Write the chunk, then attend: exact for every chunk size 1..C (the ring's C-1 slack)."""
    spec = CacheSpec(batch=2, kv_heads=1, head_dim=64, window=window, sinks=sinks, max_chunk=C)
    chunks = list(range(1, C + 1)) + list(range(C, 0, -1))
    stream(spec, 4, 6 * C + 5, backend, chunks=chunks, seed=C)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_ragged_batch_gqa_mqa(dtype):
    for kv_heads, q_heads in [(3, 9), (1, 4), (2, 2)]:
        spec = CacheSpec(batch=3, kv_heads=kv_heads, head_dim=64, dtype=dtype, window=11, sinks=2, max_chunk=4)
        stream(spec, q_heads, 25, "cpu", chunks=[1, 4, 3, 2], ragged=True, seed=kv_heads)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("window", [None, 99])
def test_head_dims_and_long_history(head_dim, window):
    """Long enough that the key range is split across threads (exact split-K merge)."""
    spec = CacheSpec(batch=1, kv_heads=2, head_dim=head_dim, window=window, max_chunk=64)
    stream(spec, 8, 40, "cpu", chunks=[64, 1, 37, 64, 3], seed=head_dim)


def test_page_merge_over_several_pages():
    """B=1, one KV head, 3000 keys: two pages of keys, merged by their log-sum-exps; exact."""
    from streamattn.kv.backends import cpu
    assert cpu.count_pages([3000], [1], 0, 0) == 2 and cpu.count_pages([3000], [1000], 0, 0) == 2
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=64, window=None, max_chunk=1000)
    stream(spec, 1, 4, "cpu", chunks=[1000, 1000, 999, 1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("window,sinks,head_dim", [(None, 0, 64), (5, 2, 64), (3, 0, 48)])
def test_soft_capped_scores(backend, dtype, window, sinks, head_dim):
    """Gemma-2's attention soft-capping (cap * tanh(s / cap) of every scaled score s, before the mask):
    decode and chunks, ragged, GQA, through ring wraps; head_dim 48 takes the plain-loop kernels. Scores
    ~ N(0, 8²) against a cap of 5, so the cap changes the answers (checked: the uncapped oracle is far)."""
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=head_dim, dtype=dtype, window=window, sinks=sinks, max_chunk=3)
    stream(spec, 4, 3 * (spec.slots or 8) + 4, backend, chunks=[3, 1, 2], ragged=True, softcap=5.0, q_gain=8.0,
           seed=head_dim + len(dtype))
    rng = np.random.default_rng(1)
    k, v, q = (rng.standard_normal((2, 9, head_dim)) for _ in range(3))
    capped = reference.attention(8 * q, k, v, np.arange(9), softcap=5.0)[0]
    assert np.abs(capped - reference.attention(8 * q, k, v, np.arange(9))[0]).max() > 0.1


@pytest.mark.parametrize("softcap", [0, -1.0, np.inf, np.nan, True, "5"])
def test_a_bad_softcap_is_refused_by_name(softcap):
    cache = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=16))
    x = np.ones((1, 1, 1, 16), np.float32)
    cache.append(x, x)
    with pytest.raises(ValueError, match=r"softcap must be a finite number > 0, or None"):
        attend(x, cache, backend="cpu", softcap=softcap)


def test_scale_override():
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=64, window=7, sinks=1)
    stream(spec, 4, 20, "cpu", scale=0.37)
    stream(spec, 4, 20, "reference", scale=0.37)


def test_odd_sizes_and_queries_in_float16():
    """q in float16: output comes back in q's dtype, still equal to the oracle."""
    rng = np.random.default_rng(5)
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=64, dtype="float16", window=3)
    cache, hist = KVCache(spec), History(1)
    for _ in range(11):
        k = rng.standard_normal((1, 1, 1, 64)).astype(np.float16)
        v = rng.standard_normal((1, 1, 1, 64)).astype(np.float16)
        cache.append(k, v)
        hist.append(k, v, [1])
        q = rng.standard_normal((1, 3, 1, 64)).astype(np.float16)
        out, lse = attend(q, cache, backend="cpu")
        assert out.dtype == np.float16
        check(out.astype(np.float32), lse, q.astype(np.float32), hist, [1], spec)


def test_sinks_never_overwritten():
    rng = np.random.default_rng(1)
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=64, window=3, sinks=2)
    cache = KVCache(spec)
    first = rng.standard_normal((1, 1, 2, 64)).astype(np.float32)
    cache.append(first[:, :, :1], first[:, :, :1])
    cache.append(first[:, :, 1:], first[:, :, 1:])
    for _ in range(50):
        x = rng.standard_normal((1, 1, 1, 64)).astype(np.float32)
        cache.append(x, x)
    assert np.array_equal(cache.k[0, 0, :2], first[0, 0])
    k, _, pos = cache.temporal_view(0)
    assert pos.tolist() == [0, 1, 49, 50, 51]


def test_vectorised_exp_is_accurate_and_flushes_masked_scores():
    """The kernel's own exp (a polynomial, not libm): relative error <= 1e-6, -inf -> exactly 0."""
    from streamattn.kv.backends.cpu_tiles import exp_tile, tile_sum
    x = np.concatenate([np.linspace(-87, 0, 997), [-np.inf, -200.0, -1e-30], [-np.inf] * 8]).astype(np.float32)
    ref = np.exp(x.astype(np.float64) - 0.25)
    got = x.copy()
    exp_tile(got, x.size, np.float32(0.25))
    total = tile_sum(got, x.size)
    rel = np.abs(got / np.where(ref > 0, ref, 1) - 1)
    # Near the running max (the weights that matter) 1e-6; far below it float32's rounding of
    # (x - max) * log2(e) itself costs ~|y| * 2^-24 relative, still far inside the f32 tolerance.
    assert rel[x >= -10].max() <= 1e-6
    assert rel[(ref > 1e-30) & (x < -10)].max() <= 1e-5
    assert got[-11] == 0.0 and got[-10] == 0.0 and not got[-8:].any()
    assert abs(total / ref.sum() - 1) <= 1e-6


@pytest.mark.parametrize("kv_heads,q_heads", [(1, 4), (2, 2)])
def test_long_history_keeps_float32_tolerance(kv_heads, q_heads):
    """65,536 keys in one split: float32 running sums alone drifted past 1e-5 here (seen in the bench)."""
    rng = np.random.default_rng(7)
    spec = CacheSpec(batch=1, kv_heads=kv_heads, head_dim=128)
    cache, hist = KVCache(spec), History(1)
    k, v = rng.standard_normal((2, 1, kv_heads, 65536, 128)).astype(np.float32)
    cache.append(k, v)
    hist.append(k, v, [65536])
    q = rng.standard_normal((1, q_heads, 1, 128)).astype(np.float32)
    from streamattn.kv.backends import cpu
    out, lse = cpu.attend(q, cache.k, cache.v, cache.lengths, np.array([1]), window=0, sinks=0,
                          scale=128 ** -0.5, kind="float32")
    check(out, lse, q, hist, [1], spec)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("q_heads", [1, 4])
def test_scores_rising_over_several_pages(dtype, q_heads):
    """Keys over 2 full pages and part of a third, the scores rising from page to page, so the merge
    rescales every earlier page; decode must stay exact."""
    from streamattn.kv.backends import cpu
    rng = np.random.default_rng(11)
    L, D = 2 * cpu.PAGE + 300, 16
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=D, dtype=dtype)
    q = rng.standard_normal((1, q_heads, 1, D)).astype(np.float32)
    ramp = np.linspace(0.0, 3.0, L, dtype=np.float32)[:, None] * q[0, 0, 0] / np.linalg.norm(q[0, 0, 0])
    k = (rng.standard_normal((1, 1, L, D)) + ramp).astype(np.float32)
    v = rng.standard_normal((1, 1, L, D)).astype(np.float32)
    cache, hist = KVCache(spec), History(1)
    for part in (slice(0, L - 1), slice(L - 1, L)):           # the history, then the decoded token
        cache.append(k[:, :, part], v[:, :, part])
        hist.append(k[:, :, part], v[:, :, part], [part.stop - part.start])
    out, lse = attend(q, cache, backend="cpu")
    check(out, lse, q, hist, [1], spec)
