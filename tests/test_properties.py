"""hypothesis: random modes, sizes and chunk schedules against the oracle."""

import numpy as np
from hypothesis import given, settings, strategies as st, HealthCheck

from streamattn import CacheSpec, KVCache, attend
from oracle import History, check


@st.composite
def scenarios(draw):
    window = draw(st.one_of(st.none(), st.integers(1, 12)))
    sinks = draw(st.integers(0, 3)) if window else 0
    C = draw(st.integers(1, 5))
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 4]))
    spec = CacheSpec(batch=draw(st.integers(1, 3)), kv_heads=kv_heads, head_dim=draw(st.sampled_from([64, 128])),
                     dtype=draw(st.sampled_from(["float32", "float16", "bfloat16"])),
                     window=window, sinks=sinks, max_chunk=C)
    chunks = draw(st.lists(st.lists(st.integers(0, C), min_size=spec.batch, max_size=spec.batch),
                           min_size=1, max_size=30))
    return spec, kv_heads * group, chunks, draw(st.integers(0, 2**31))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_any_schedule_equals_oracle(scenario):
    spec, q_heads, chunks, seed = scenario
    rng = np.random.default_rng(seed)
    cache, hist = KVCache(spec), History(spec.batch)
    for counts in chunks:
        counts = np.array(counts)
        T = max(1, int(counts.max()))
        shape = (spec.batch, spec.kv_heads, T, spec.head_dim)
        k = rng.standard_normal(shape).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        cache.append(k, v, counts=counts)
        hist.append(k, v, counts)
        assert cache.lengths.tolist() == [hist.length(b) for b in range(spec.batch)]
        q = rng.standard_normal((spec.batch, q_heads, T, spec.head_dim)).astype(np.float32)
        out, lse = attend(q, cache, backend="cpu")
        check(out, lse, q, hist, counts, spec, what=f"{spec}")
