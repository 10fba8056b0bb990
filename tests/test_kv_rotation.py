"""The key rotation of quantized K caches (streamattn.kv.rotation, CacheSpec.rotate_k): H is orthonormal, the
cache stores k @ H and attention scores q @ H, so every backend is exact against the oracle over what is
stored and the scores are those of the unrotated cache; the flag travels with snapshots and the engine."""

import argparse

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache, attend
from streamattn.kv import snapshot
from streamattn.kv.dispatch import append_attend
from streamattn.kv.introspect import inspect_attention
from streamattn.kv.rotation import _butterflies, hadamard, rotate, rotate_rows
from streamattn.kv.storage import dequantize
from oracle import rotation
from test_oracle import stream


@pytest.mark.parametrize("head_dim", [1, 8, 24, 32, 40, 64, 80, 96, 128, 256])
def test_rotation_is_orthonormal_and_its_own_inverse(head_dim):
    H = hadamard(head_dim)
    assert np.allclose(H @ H.T, np.eye(head_dim), atol=1e-12) and np.array_equal(H, H.T)
    assert np.array_equal(H, rotation(head_dim))                   # the oracle's, built by scipy
    blocks = min(head_dim, 32)                                     # no block mixes two quantization blocks
    assert not H[:blocks, blocks:].any()
    x = np.random.default_rng(head_dim).standard_normal((3, head_dim))
    assert np.allclose(rotate(rotate(x)), x, atol=1e-12)
    with pytest.raises(ValueError, match="head_dim must be an integer >= 1"):
        hadamard(0)


def test_rotation_spreads_an_outlier_over_its_block():
    """The reason for it: one outlier channel in a 32-block; q4_0's key error falls by more than 3x."""
    rng = np.random.default_rng(1)
    k = rng.standard_normal((64, 1, 1, 64)).astype(np.float32)
    k[..., 45] = 20.0                                              # as SmolLM2's channels 44-51 (docs/PERF.md)
    err = {}
    for on in (False, True):
        c = KVCache(CacheSpec(batch=64, kv_heads=1, head_dim=64, dtype="q4_0", rotate_k=on))
        c.append(k, k)
        stored = dequantize(c.k[:, :, :1], "q4_0", 64)
        back = stored @ hadamard(64).astype(np.float32) if on else stored
        err[on] = np.linalg.norm(back - k) / np.linalg.norm(k)
    assert err[True] * 3 < err[False]


def test_default_is_on_for_a_quantized_k_only():
    spec = dict(batch=1, kv_heads=1, head_dim=64)
    assert CacheSpec(**spec, dtype="q4_0").rotate_k and CacheSpec(**spec, dtype="q8_0", dtype_v="float16").rotate_k
    assert not CacheSpec(**spec, dtype="float16").rotate_k
    assert not CacheSpec(**spec, dtype="float16", dtype_v="q4_0").rotate_k       # V is never rotated
    assert not CacheSpec(**spec, dtype="q4_0", rotate_k=False).rotate_k
    assert CacheSpec(**spec, dtype="float32", rotate_k=np.bool_(True)).rotate_k is True
    assert CacheSpec(**spec, dtype="q4_0") == CacheSpec(**spec, dtype="q4_0", rotate_k=True)
    with pytest.raises(ValueError, match="rotate_k must be True, False or None.*got 'yes'"):
        CacheSpec(**spec, rotate_k="yes")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype,dtype_v", [("q4_0", "q4_0"), ("q4_0", "float32"), ("q8_0", "q8_0"),
                                           ("float32", "float32")])
@pytest.mark.parametrize("window,sinks", [(None, 0), (7, 0), (5, 2)])
def test_backends_against_the_oracle_over_rotated_keys(backend, dtype, dtype_v, window, sinks):
    """Across >= 3 ring wraps, GQA 6/2, chunks 1..4: the oracle stores k @ H as the cache does and scores
    q @ H (tests/oracle.py), so the float32 tolerance holds."""
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=64, dtype=dtype, dtype_v=dtype_v, window=window, sinks=sinks,
                     max_chunk=4, rotate_k=True)
    steps = 3 * (spec.slots or 12) + 5
    stream(spec, 6, steps, backend, chunks=[1, 4, 3, 2, 1], seed=len(dtype) + (window or 0))


@pytest.mark.parametrize("head_dim", [80, 96, 40])
def test_odd_head_dims(head_dim):
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=head_dim, dtype="q4_0", window=9, max_chunk=8)
    stream(spec, 3, 8, "cpu", chunks=[8, 1, 5], seed=head_dim)


def _pair(spec_kw, rng, steps, T):
    """The same appends into a float32 cache, rotated and not; returns the caches and the last chunk."""
    caches = [KVCache(CacheSpec(**spec_kw, rotate_k=on)) for on in (False, True)]
    for _ in range(steps):
        s = caches[0].spec
        k = rng.standard_normal((s.batch, s.kv_heads, T, s.head_dim)).astype(np.float32)
        v = rng.standard_normal(k.shape).astype(np.float32)
        for c in caches:
            c.append(k, v)
    return caches


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_scores_are_unchanged_positions_cache_included(backend):
    """float32 storage, rotated or not: the same outputs and lse (float32 rounding apart), with a q_sink
    (sinks at cache positions: the sink keys scored by another query, rotated by the same H)."""
    rng = np.random.default_rng(7)
    kw = dict(batch=2, kv_heads=2, head_dim=64, window=6, sinks=2, max_chunk=3)
    plain, rotated = _pair(kw, rng, 9, 3)
    q, q_sink = (rng.standard_normal((2, 4, 3, 64)).astype(np.float32) for _ in range(2))
    a = attend(q, plain, backend=backend, q_sink=q_sink)
    b = attend(q, rotated, backend=backend, q_sink=q_sink)
    assert np.abs(a[0] - b[0]).max() < 1e-5 and np.abs(a[1] - b[1]).max() < 1e-5
    c = attend(q, rotated, backend=backend)                        # q_sink does change the answer
    assert np.abs(c[0] - b[0]).max() > 1e-3
    assert not np.allclose(rotated.k, plain.k, atol=1e-3)          # and the keys are stored rotated


def test_one_call_append_attend_rotates_too():
    """The causal CPU fast path (write and attend in one compiled call) stores and scores in the frame."""
    rng = np.random.default_rng(8)
    kw = dict(batch=1, kv_heads=1, head_dim=64, max_chunk=4)
    plain, rotated = (KVCache(CacheSpec(**kw, rotate_k=on)) for on in (False, True))
    for _ in range(5):
        q, k, v = (rng.standard_normal((1, 2, 4, 64)).astype(np.float32)[:, :1 if i else 2] for i in range(3))
        a = append_attend(q, k, v, plain, backend="cpu", scale=0.125)
        b = append_attend(q, k, v, rotated, backend="cpu", scale=0.125)
        assert np.abs(a[0] - b[0]).max() < 1e-5
    assert np.allclose(rotated.k[0, 0, :20], plain.k[0, 0, :20] @ hadamard(64), atol=1e-5)


def test_introspection_weights_are_unchanged():
    rng = np.random.default_rng(9)
    plain, rotated = _pair(dict(batch=1, kv_heads=1, head_dim=32, window=4, sinks=1), rng, 7, 1)
    q = rng.standard_normal((1, 2, 1, 32)).astype(np.float32)
    a, b = inspect_attention(q, plain), inspect_attention(q, rotated)
    assert np.allclose(a.weights, b.weights, atol=1e-6) and np.allclose(a.out, b.out, atol=1e-6)


def test_snapshot_carries_the_flag_and_refuses_a_mismatch(tmp_path):
    rng = np.random.default_rng(10)
    spec = CacheSpec(batch=1, kv_heads=2, head_dim=64, dtype="q4_0", window=5, sinks=1)
    cache = KVCache(spec)
    for _ in range(9):
        x = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
        cache.append(x, x)
    snapshot.save(tmp_path / "kv.npz", cache)
    got = snapshot.load(tmp_path / "kv.npz")
    assert got.spec.rotate_k and np.array_equal(got.k, cache.k)
    with pytest.raises(snapshot.StateFileError, match="rotate_k=True in the file, False requested"):
        snapshot.restore(KVCache(CacheSpec(batch=1, kv_heads=2, head_dim=64, dtype="q4_0", window=5, sinks=1,
                                           rotate_k=False)), tmp_path / "kv.npz")


def test_version_2_files_hold_unrotated_keys(tmp_path):
    """A file written before rotate_k (version 2) loads as rotate_k=False, never as the new default."""
    import json
    from streamattn.kv.snapshot import _digest
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=32, dtype="q4_0", rotate_k=False)
    cache = KVCache(spec)
    cache.append(np.ones((1, 1, 2, 32), np.float32), np.ones((1, 1, 2, 32), np.float32))
    snapshot.save(tmp_path / "v4.npz", cache)
    with np.load(tmp_path / "v4.npz") as f:
        members = {n: f[n] for n in f.files}
    meta = json.loads(bytes(members.pop("meta")))
    meta["version"] = 2
    del meta["layers"][0]["spec"]["rotate_k"], meta["layers"][0]["spec"]["sink_dtype"]   # both newer than 2
    meta["sha256"] = _digest(meta, members)
    np.savez(tmp_path / "v2.npz", meta=np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8),
             **members)
    got = snapshot.load(tmp_path / "v2.npz")
    assert got.spec == spec and np.array_equal(got.k, cache.k)


def test_the_flag_reaches_the_caches():
    """--no-rotate-k through ModelOptions and EngineConfig to CacheSpec; the default leaves it to the dtype."""
    from streamattn.engine.core import EngineConfig
    from streamattn.engine.options import ModelOptions, add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    for argv, want in ((["--cache-dtype", "q4_0"], None), (["--cache-dtype", "q4_0", "--no-rotate-k"], False)):
        opts = ModelOptions.from_args(p.parse_args(argv))
        assert opts.rotate_k is want
        kw = EngineConfig(cache_dtype=opts.k_dtype, rotate_k=opts.rotate_k).cache_kwargs
        assert kw["rotate_k"] is want
        assert CacheSpec(batch=1, kv_heads=1, head_dim=64, dtype=kw["dtype"], rotate_k=kw["rotate_k"]).rotate_k \
            is (want is None)
    from streamattn.serve.config import ServeConfig
    for bad in ("off", 1, 0):                    # 1 == True: refused by type where it is given, not later
        with pytest.raises(ValueError, match="rotate_k"):
            ModelOptions(rotate_k=bad)
        with pytest.raises(ValueError, match="rotate_k"):
            ServeConfig(rotate_k=bad)


@pytest.mark.parametrize("head_dim", [24, 64, 80])
def test_a_rows_rotation_does_not_depend_on_the_other_rows(head_dim):
    """Batch invariance (docs/DESIGN.md §7): a row rotated alone has the bits it has inside any batch or
    chunk (a matrix product would not promise that), and equals x @ H rounded once from float64. The
    compiled rows (float32 numpy arrays, and the compiled layer) and the array butterflies (other devices
    and dtypes) give the same bits, strided input included."""
    rng = np.random.default_rng(head_dim)
    x = (rng.standard_normal((3, 4, 9, head_dim)) * rng.uniform(0.01, 20, head_dim)).astype(np.float32)
    whole = rotate(x)
    assert whole.dtype == np.float32 and np.array_equal(whole, (x.astype(np.float64) @ rotation(head_dim)).astype(np.float32))
    for b, h, t in [(0, 0, 0), (2, 3, 8), (1, 2, 4)]:
        assert np.array_equal(rotate(x[b, h, t]), whole[b, h, t])
        assert np.array_equal(rotate(x[b:b + 1, :, t:t + 1]), whole[b:b + 1, :, t:t + 1])
    assert np.array_equal(rotate_rows(x), _butterflies(x, np))
    assert np.array_equal(rotate(x[:, ::2]), _butterflies(x[:, ::2], np))
