"""A window cache streams indefinitely: ~20k tokens, fixed storage after the ring is full, still exact.

The long version (a million tokens, latency and RSS) is ``python -m streamattn.bench.stream``; this is its CI
guard: the storage arrays are never reallocated or resized, and sampled outputs equal the float64
oracle over the full history (tests/oracle.py) after ~1000 wraps of the ring.
"""

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache, attend
from oracle import History, check

TOKENS = 20_000


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_window_cache_streams_20k_tokens_at_fixed_memory(dtype, one_thread):
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=16, dtype=dtype, window=13, sinks=2, max_chunk=4)
    rng = np.random.default_rng(7)
    cache, hist = KVCache(spec), History(spec.batch)
    chunks = [1, 4, 3, 1, 2, 1, 1, 4]                 # every chunk size up to C, mostly decode
    storage = None
    step = checked = 0
    while cache.lengths.min() < TOKENS:
        T = chunks[step % len(chunks)]
        counts = np.full(spec.batch, T) if step % 5 else rng.integers(0, T + 1, size=spec.batch)  # ragged
        k = rng.standard_normal((spec.batch, spec.kv_heads, T, spec.head_dim), dtype=np.float32)
        v = rng.standard_normal((spec.batch, spec.kv_heads, T, spec.head_dim), dtype=np.float32)
        q = rng.standard_normal((spec.batch, 4, T, spec.head_dim), dtype=np.float32)   # GQA 4/2
        cache.append(k, v, counts=counts)
        hist.append(k, v, counts)
        out, lse = attend(q, cache, backend="cpu")
        if storage is None and cache.lengths.min() >= spec.slots:       # the ring is full: freeze
            storage = (cache.k, cache.v, cache.k.ctypes.data, cache.v.ctypes.data, cache.nbytes)
        if storage is not None:
            assert cache.k is storage[0] and cache.v is storage[1], f"step {step}: storage replaced"
            assert (cache.k.ctypes.data, cache.v.ctypes.data, cache.nbytes) == storage[2:], \
                f"step {step}: storage moved or resized"
        if step % 151 == 0 or cache.lengths.min() >= TOKENS:
            check(out, lse, q, hist, counts, spec, what=f"{dtype} step {step}, lengths {cache.lengths.tolist()}")
            checked += 1
        step += 1
    assert cache.nbytes == 2 * spec.batch * spec.kv_heads * spec.slots * spec.head_dim * np.dtype(dtype).itemsize
    assert cache.lengths.min() // spec.slots >= 1000  # ~1000 wraps of the ring
    assert checked >= 50
