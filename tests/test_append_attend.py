"""dispatch.append_attend, the model's write-then-attend without re-checking what it built: the same
answers and cache state as ``cache.append`` then ``attend``, and the checks that can fail still fail."""

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache, attend
from streamattn.kv.dispatch import append_attend

from test_errors import assert_unchanged, snapshot

SPECS = {
    "causal": dict(),
    "window": dict(window=5, max_chunk=3),
    "sinks": dict(window=4, sinks=2, max_chunk=3),
}


def chunk(rng, B, heads, T, d=16):
    return rng.standard_normal((B, heads, T, d)).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "q8_0", "q4_0"])
@pytest.mark.parametrize("mode", SPECS)
def test_same_answers_and_state_as_append_then_attend(mode, dtype):
    """Two caches fed the same chunks, one through each path: outputs and storage equal bit for bit,
    through ring wraps, ragged counts, T = 1 and T = 3, q_sink on the sinks cache."""
    rng = np.random.default_rng(7)
    spec = CacheSpec(batch=2, kv_heads=1, head_dim=16, dtype=dtype, **SPECS[mode])
    fast, slow = KVCache(spec), KVCache(spec)
    for step, (T, counts) in enumerate([(3, None), (1, None), (3, np.array([2, 3])), (1, np.array([1, 0]))] * 4):
        k, v, q, qs = (chunk(rng, 2, h, T) for h in (1, 1, 3, 3))
        q_sink = qs if mode == "sinks" else None
        got = append_attend(q, k, v, fast, backend="cpu", scale=0.3, counts=counts, q_sink=q_sink)
        slow.append(k, v, counts=counts)
        want = attend(q, slow, backend="cpu", scale=0.3, counts=counts, q_sink=q_sink)
        for g, w in zip(got, want):
            assert np.array_equal(g, w, equal_nan=True), step
        assert_unchanged(fast, snapshot(slow))
    assert int(fast.lengths.max()) > fast.slots or mode == "causal"          # the ring wrapped


@pytest.mark.parametrize("mode", SPECS)
def test_soft_capped_like_append_then_attend(mode):
    """With a soft cap, the model's path (the one compiled call for causal chunks, the staged one else)
    gives the bits of append then attend with the same cap, and not those without it."""
    rng = np.random.default_rng(3)
    spec = CacheSpec(batch=2, kv_heads=1, head_dim=16, **SPECS[mode])
    fast, slow = KVCache(spec), KVCache(spec)
    for T in (3, 1, 1, 3, 2):
        k, v, q = (chunk(rng, 2, h, T) for h in (1, 1, 3))
        q *= 8                                                   # scores well past the cap
        got = append_attend(q, k, v, fast, backend="cpu", scale=0.3, softcap=2.0)
        slow.append(k, v)
        want = attend(q, slow, backend="cpu", scale=0.3, softcap=2.0)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
        assert not np.allclose(got[0], attend(q, slow, backend="cpu", scale=0.3)[0], atol=1e-3)


@pytest.mark.parametrize("mode", ["causal", "window"])
@pytest.mark.parametrize("dtype,value", [("float32", np.nan), ("float16", 1e5), ("bfloat16", np.inf)])
def test_non_finite_key_is_refused_and_the_cache_unchanged(dtype, value, mode):
    """Both routes (a causal cache takes the one compiled call, a window cache the staged one)."""
    rng = np.random.default_rng(1)
    cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=16, dtype=dtype, **SPECS[mode]))
    append_attend(chunk(rng, 2, 2, 1), chunk(rng, 2, 1, 1), chunk(rng, 2, 1, 1), cache, backend="cpu", scale=0.25)
    snap = snapshot(cache)
    for which in "kv":
        k, v = chunk(rng, 2, 1, 1), chunk(rng, 2, 1, 1)
        (k if which == "k" else v)[1, 0, 0, 3] = value
        with pytest.raises(ValueError, match=rf"{which} holds NaN or inf for sequence 1; the cache is unchanged"):
            append_attend(chunk(rng, 2, 2, 1), k, v, cache, backend="cpu", scale=0.25)
        assert_unchanged(cache, snap)


def test_padding_rows_may_hold_anything():
    """A NaN in a padding row (past counts[b]) is no stored value: accepted, as by append."""
    rng = np.random.default_rng(2)
    cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=16, window=4, max_chunk=2))
    k = chunk(rng, 2, 1, 2)
    k[1, 0, 1] = np.nan
    out, lse = append_attend(chunk(rng, 2, 1, 2), k, chunk(rng, 2, 1, 2), cache, backend="cpu", scale=0.25,
                              counts=np.array([2, 1]))
    assert np.isfinite(out[1, :, 0]).all() and (out[1, :, 1] == 0).all() and lse[1, 0, 1] == -np.inf


def test_room_and_count_checks_still_run():
    rng = np.random.default_rng(3)
    window = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=16, window=4, max_chunk=2))
    with pytest.raises(ValueError, match="a chunk of 3 tokens exceeds max_chunk=2"):
        append_attend(chunk(rng, 1, 1, 3), chunk(rng, 1, 1, 3), chunk(rng, 1, 1, 3), window, backend="cpu", scale=1.0)
    with pytest.raises(ValueError, match=r"counts must lie in 0..T=1"):
        append_attend(chunk(rng, 1, 1, 1), chunk(rng, 1, 1, 1), chunk(rng, 1, 1, 1), window, backend="cpu",
                       scale=1.0, counts=np.array([2]))
    causal = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=16, max_len=2))
    args = [chunk(rng, 1, 1, 2) for _ in range(3)]
    append_attend(*args, causal, backend="cpu", scale=1.0)
    snap = snapshot(causal)
    with pytest.raises(ValueError, match="sequence 0 would reach 3 tokens, over max_len=2"):
        append_attend(*(a[:, :, :1] for a in args), causal, backend="cpu", scale=1.0)
    assert_unchanged(causal, snap)


def test_a_rewound_ring_still_refuses_what_it_cannot_answer():
    rng = np.random.default_rng(4)
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=16, window=3, max_chunk=2)
    fast, slow = KVCache(spec), KVCache(spec)
    for cache in (fast, slow):
        for _ in range(9):
            cache.append(chunk(rng, 1, 1, 1), chunk(rng, 1, 1, 1))
        cache.truncate(0, 3)                       # unchecked: the ring lost keys the next queries need
    args = [chunk(rng, 1, 1, 2) for _ in range(3)]
    slow.append(args[1], args[2])
    with pytest.raises(ValueError, match="sequence 0 can attend only its newest") as want:
        attend(args[0], slow, backend="cpu")
    with pytest.raises(ValueError, match="sequence 0 can attend only its newest") as got:
        append_attend(*args, fast, backend="cpu", scale=0.25)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("mode", ["causal", "window"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_query_comes_back_nan(bad, mode):
    """Not refused (the model's q is not re-checked) but never a number: the row is NaN, out and lse."""
    rng = np.random.default_rng(5)
    cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=16, **SPECS[mode]))
    for _ in range(3):
        append_attend(chunk(rng, 2, 2, 1), chunk(rng, 2, 1, 1), chunk(rng, 2, 1, 1), cache, backend="cpu", scale=0.25)
    q = chunk(rng, 2, 2, 1)
    q[1, 1, 0, 4] = bad
    out, lse = append_attend(q, chunk(rng, 2, 1, 1), chunk(rng, 2, 1, 1), cache, backend="cpu", scale=0.25)
    assert np.isnan(out[1, 1]).all() and np.isnan(lse[1, 1]).all()
    assert np.isfinite(out[0]).all() and np.isfinite(out[1, 0]).all() and np.isfinite(lse[1, 0]).all()


@pytest.mark.parametrize("mode", ["causal", "window"])
def test_a_non_finite_key_with_the_check_off_gives_nan(mode):
    rng = np.random.default_rng(6)
    cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=16, check_finite=False, **SPECS[mode]))
    k = chunk(rng, 2, 1, 1)
    k[0, 0, 0, 0] = np.nan
    out, lse = append_attend(chunk(rng, 2, 1, 1), k, chunk(rng, 2, 1, 1), cache, backend="cpu", scale=0.25)
    assert np.isnan(out[0]).all() and np.isnan(lse[0]).all() and np.isfinite(out[1]).all()


def test_causal_cpu_chunks_take_the_one_compiled_call(monkeypatch):
    """A causal cache without sinks, every row real: write and attention in one compiled call
    (backends.cpu.write_attend); ragged counts, sinks and windows go the staged way. Both give the bits of
    append then attend (test_same_answers_and_state_as_append_then_attend)."""
    from streamattn.kv.backends import cpu
    calls = []
    real = cpu.write_attend
    monkeypatch.setattr(cpu, "write_attend", lambda *a: calls.append(a[9].copy()) or real(*a))
    rng = np.random.default_rng(8)
    causal = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=16, dtype="float16"))
    append_attend(chunk(rng, 2, 2, 3), chunk(rng, 2, 1, 3), chunk(rng, 2, 1, 3), causal, backend="cpu", scale=0.5)
    assert len(calls) == 1 and calls[0].tolist() == [3, 3]
    append_attend(chunk(rng, 2, 2, 1), chunk(rng, 2, 1, 1), chunk(rng, 2, 1, 1), causal, backend="cpu", scale=0.5,
                   counts=np.array([1, 0]))
    window = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=16, **SPECS["window"]))
    append_attend(chunk(rng, 2, 2, 1), chunk(rng, 2, 1, 1), chunk(rng, 2, 1, 1), window, backend="cpu", scale=0.5)
    assert len(calls) == 1



def test_the_one_compiled_call_reuses_the_kernels_attend_compiles(monkeypatch):
    """write_attend hands its constants (no sinks, no window) on as int64 and bool, not as Numba's literal
    types, so it runs the write_rows and attend_all that ``attend`` and the compiled layer run: no copy of
    the attention kernels is compiled only for it."""
    from numba import njit, types
    from streamattn.kv import storage
    from streamattn.kv.backends import cpu
    # A dispatcher of its own: its callees are typed here, where the cached one would load them with it.
    monkeypatch.setattr(cpu, "write_attend", njit(cpu.write_attend.py_func))
    rng = np.random.default_rng(9)
    causal = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=16, dtype="float16"))
    append_attend(chunk(rng, 2, 2, 3), chunk(rng, 2, 1, 3), chunk(rng, 2, 1, 3), causal, backend="cpu", scale=0.5)
    assert cpu.write_attend.signatures
    for kernel in (storage.write_rows, cpu.attend_all):
        literal = [sig for sig in kernel.signatures if any(isinstance(t, types.Literal) for t in sig)]
        assert kernel.signatures and not literal, f"{kernel.py_func.__name__} compiled for literals: {literal}"


def test_the_score_tiles_compile_one_row_kernel_per_storage():
    """tile_scores passes its row index and the tail's 16 keys as int64: one copy of each row kernel
    per storage, none for Numba's literal types (a first ``r = 0`` would be typed Literal[int](0))."""
    from numba import njit, types
    from streamattn.kv.backends import cpu_tiles
    tile_scores = njit(cpu_tiles.tile_scores.py_func)    # typed here, not loaded whole from the disk cache
    rng = np.random.default_rng(10)
    for rows in (7, 3):                                  # rows 4, 2, 1, and the 3-row kernel
        qf = rng.standard_normal((rows, 16)).astype(np.float32)
        kt = rng.standard_normal((21, 16)).astype(np.float32)          # 16 keys and a tail of 5
        sc = np.zeros((rows, 48), np.float32)
        tile_scores(qf, kt, 21, sc, 0, np.zeros((16, 16), np.float32), np.zeros((rows, 16), np.float32))
        np.testing.assert_allclose(sc[:, :21], qf.astype(np.float64) @ kt.T.astype(np.float64), rtol=1e-5,
                                   atol=1e-5)
    for kernel, keys in ((cpu_tiles._qk_rows, 3), (cpu_tiles._qk_rows3, 2)):     # keys: kt's place
        literal = [sig for sig in kernel.signatures if any(isinstance(t, types.Literal) for t in sig)]
        assert not literal, f"{kernel.py_func.__name__} compiled for literals: {literal}"
        assert len(kernel.signatures) == len({sig[keys] for sig in kernel.signatures}) >= 1   # one per storage
