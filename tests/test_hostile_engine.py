"""Hostile and careless input to the engine API (issue 17 items 2, 3, 6, 7): clear errors, state unchanged,
never a wrong number that looks like a valid one."""

import json

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache, attend
from streamattn.kv import state
from streamattn.kv import snapshot as snapshot_file
from streamattn.kv.spec import LIMITS

from test_errors import assert_unchanged, snapshot


def ones(T=1, *, batch=2, heads=1, d=8, value=1.0):
    return np.full((batch, heads, T, d), value, np.float32)


def filled(**kw):
    cache = KVCache(CacheSpec(**{**dict(batch=2, kv_heads=1, head_dim=8, window=4, max_chunk=2), **kw}))
    rng = np.random.default_rng(0)
    for _ in range(3):
        cache.append(rng.standard_normal((2, 1, 1, 8)).astype(np.float32),
                     rng.standard_normal((2, 1, 1, 8)).astype(np.float32))
    return cache


# -- item 2: NaN / inf never comes back as a padding row --------------------------------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_attend_refuses_non_finite_q(bad):
    cache = filled()
    q = ones()
    q[1, 0, 0, 2] = bad
    with pytest.raises(ValueError, match="q holds NaN or inf"):
        attend(q, cache, backend="cpu")


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -np.inf, "2", True])
def test_attend_refuses_bad_scale(scale):
    with pytest.raises(ValueError, match=r"scale must be a finite number \(got"):
        attend(ones(), filled(), backend="cpu", scale=scale)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_non_finite_key_with_the_check_off_gives_nan_not_zeros(backend, dtype):
    cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=8, window=4, dtype=dtype, check_finite=False))
    k = ones()
    k[0, 0, 0, 0] = np.nan
    cache.append(k, ones())
    out, lse = attend(ones(), cache, backend=backend)
    assert np.isnan(out[0]).all() and np.isnan(lse[0]).all()          # sequence 0 saw the NaN key
    assert np.isfinite(out[1]).all() and np.isfinite(lse[1]).all()     # sequence 1 did not
    out, lse = attend(ones(), cache, backend=backend, counts=np.array([0, 1]))
    assert (out[0] == 0).all() and (lse[0] == -np.inf).all()           # a true padding row stays padding


# -- item 3: the check runs on the values as stored --------------------------------------------------
@pytest.mark.parametrize("dtype,value", [("float16", 1e5), ("float16", -7e4), ("bfloat16", float(np.finfo(np.float32).max))])
def test_append_refuses_values_that_overflow_the_storage(dtype, value):
    cache = filled(dtype=dtype)
    snap = snapshot(cache)
    k = ones()
    k[1, 0, 0, 5] = value
    with pytest.raises(ValueError, match=rf"k holds NaN or inf for sequence 1; the cache is unchanged .*{dtype}"):
        cache.append(k, ones())
    assert_unchanged(cache, snap)
    cache.append(ones(value=6e4), ones())                              # representable: accepted


# -- item 6: attend and can_rewind validate like append and rewind ----------------------------------
@pytest.mark.parametrize("counts", [[0.7, 1.9], [True, True], np.array([1.0, 1.0]), ["1", "1"]])
def test_attend_refuses_non_integer_counts(counts):
    with pytest.raises(ValueError, match=r"counts must be an int array of shape \(2,\)"):
        attend(ones(), filled(), backend="cpu", counts=counts)


@pytest.mark.parametrize("dtype", [np.int64, np.int8, bool, object, np.complex64])
def test_attend_refuses_non_float_q(dtype):
    with pytest.raises(TypeError, match=r"q must hold floats .*got dtype"):
        attend(ones().astype(dtype), filled(), backend="cpu")


def test_can_rewind_validates():
    cache = filled()
    for b in (-1, 5, 1.0, True):
        with pytest.raises(ValueError, match=rf"b must be a sequence index in 0..1 \(got {b!r}\)"):
            state.can_rewind(cache, b, 1)
    for k in (1.5, True, "1"):
        with pytest.raises(ValueError, match=rf"k must be an integer \(got {k!r}\)"):
            state.can_rewind(cache, 0, k)
    assert state.can_rewind(cache, 1, np.int64(1)) and not state.can_rewind(cache, 0, -1)
    assert not state.can_rewind(cache, 0, 4)                            # more than it holds


# -- item 7: CacheSpec ----------------------------------------------------------------------------------
def test_numpy_integer_fields_are_normalised_and_save(tmp_path):
    spec = CacheSpec(batch=np.int64(1), kv_heads=np.int32(1), head_dim=np.uint16(8), window=np.int64(4),
                     sinks=np.int8(1), max_chunk=np.int64(2), check_finite=np.bool_(False))
    assert all(type(getattr(spec, n)) is int for n in ("batch", "kv_heads", "head_dim", "window", "sinks",
                                                        "max_chunk"))
    assert spec.check_finite is False
    cache = KVCache(spec)
    snapshot_file.save(tmp_path / "s.npz", cache)
    assert snapshot_file.load(tmp_path / "s.npz").spec == spec
    json.dumps(spec.__dict__)


@pytest.mark.parametrize("value", [1, 0, "yes", None, 2.0])
def test_check_finite_must_be_a_bool(value):
    with pytest.raises(ValueError, match=rf"check_finite must be True or False \(got {value!r}\)"):
        CacheSpec(batch=1, kv_heads=1, head_dim=8, check_finite=value)


@pytest.mark.parametrize("field,value", [("max_chunk", 10**7), ("max_chunk", 2**62), ("window", 2**40),
                                         ("batch", 10**9), ("head_dim", 2**20), ("max_len", 2**62)])
def test_absurd_sizes_are_refused_before_allocation(field, value):
    kw = dict(batch=1, kv_heads=1, head_dim=8, window=4)
    if field == "max_len":
        kw.pop("window")
    with pytest.raises(ValueError, match=rf"{field} must be at most {LIMITS[field]} \(got {value}\)"):
        CacheSpec(**{**kw, field: value})


@pytest.mark.parametrize("tokens", [-5, 2.5, True, "8"])
def test_reserve_validates(tokens):
    cache = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=8))
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=rf"tokens must be an integer >= 0 \(got {tokens!r}\)"):
        cache.reserve(tokens)
    assert_unchanged(cache, snap)


def test_the_device_form_of_the_nan_rule_matches_the_host_form():
    """dispatch._poison_on_device (used for CuPy results) run with numpy as the array module."""
    from streamattn.kv import dispatch
    rng = np.random.default_rng(3)
    out = rng.standard_normal((2, 3, 4, 8)).astype(np.float16)
    lse = rng.standard_normal((2, 3, 4)).astype(np.float32)
    lse[0, 1, 2] = -np.inf                       # a real row that saw a NaN key
    lse[1, :, 3] = -np.inf                       # padding (counts[1] = 3)
    counts = np.array([4, 3])
    want_out, want_lse = dispatch._poison_non_finite(out.copy(), lse.copy(), counts, np)
    real = (np.arange(4)[None, :] < counts[:, None])[:, None, :]
    got_out, got_lse = dispatch._poison_on_device(out.copy(), lse.copy(), real, np)
    assert got_out.dtype == np.float16
    np.testing.assert_array_equal(got_out, want_out)
    np.testing.assert_array_equal(got_lse, want_lse)
    assert np.isnan(want_out[0, 1, 2]).all() and (want_lse[1, :, 3] == -np.inf).all()
