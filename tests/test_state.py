"""Cache state: snapshot/restore bit-exact, every bad file refused by name, fork and rewind against the oracle."""

import copy
import dataclasses
import json
import os
import re

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache, attend
from streamattn.kv import backends, snapshot, state
from oracle import History, as_stored, check

DTYPES = ["float32", "float16", "bfloat16"]


pytestmark = pytest.mark.usefixtures("one_thread")


MODES = {  # name: spec keywords
    "causal": dict(window=None, max_chunk=3),
    "causal-capped": dict(window=None, max_chunk=3, max_len=200),
    "window": dict(window=5, max_chunk=3),
    "window-1": dict(window=1, max_chunk=2),
    "sinks": dict(window=4, sinks=2, max_chunk=3),
}
Q_HEADS = 4  # GQA: 2 query heads per KV head


def make_spec(mode, dtype="float32", batch=3):
    return CacheSpec(batch=batch, kv_heads=2, head_dim=16, dtype=dtype, **MODES[mode])


def feed(cache, hist, rng, steps, *, ragged=True, check_backend=None):
    """Append ``steps`` random chunks (ragged counts 0..C), keeping the history; optionally check each."""
    spec = cache.spec
    for _ in range(steps):
        T = int(rng.integers(1, spec.max_chunk + 1))
        counts = rng.integers(0, T + 1, spec.batch) if ragged else np.full(spec.batch, T)
        k, v = rng.standard_normal((2, spec.batch, spec.kv_heads, T, spec.head_dim)).astype(np.float32)
        cache.append(k, v, counts=counts)
        hist.append(as_stored(k, spec.dtype), as_stored(v, spec.dtype), counts)
        if check_backend:
            probe(cache, hist, rng, backend=check_backend, counts=counts)


def probe(cache, hist, rng, *, backend, counts=None, what=""):
    """Attend ``counts`` (default: all the cache can answer, up to C) newest queries; check against the oracle
    over the stored values (``hist`` holds them) at the float32 tolerance: state adds no error of its own."""
    spec = cache.spec
    if counts is None:
        counts = np.minimum(cache.answerable(), spec.max_chunk)
    counts = np.asarray(counts, np.int64)
    q = rng.standard_normal((spec.batch, Q_HEADS, max(1, int(counts.max())), spec.head_dim)).astype(np.float32)
    out, lse = attend(q, cache, backend=backend, counts=counts)
    check(out, lse, q, hist, counts, dataclasses.replace(spec, dtype="float32"), what=what or backend)
    return out


def filled(mode, dtype="float32", *, seed=0, steps=40, batch=3):
    rng = np.random.default_rng(seed)
    cache, hist = KVCache(make_spec(mode, dtype, batch)), History(batch)
    feed(cache, hist, rng, steps)
    return cache, hist, rng


def clone(cache):
    """An independent copy of a cache (its arrays copied; a cache holds its array module, so no deepcopy)."""
    c = copy.copy(cache)
    for name in ("k", "v", "lengths", "last_counts", "held_from"):
        setattr(c, name, getattr(cache, name).copy())
    return c


def hcopy(hist):
    """An independent copy of a History (its row arrays are never changed in place, so they are shared)."""
    h = copy.copy(hist)
    h.k, h.v = [list(x) for x in hist.k], [list(x) for x in hist.v]
    return h


def assert_same_state(a, b):
    assert a.spec == b.spec and a.slots == b.slots and a.device == b.device
    for name in ("k", "v"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"{name} differs"
    for name in ("lengths", "last_counts", "held_from"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


# -- snapshot / restore ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(MODES))
def test_round_trip_is_bit_exact(tmp_path, mode, dtype):
    cache, hist, rng = filled(mode, dtype)
    if cache.spec.window is not None:
        state.rewind(cache, 1, 1)           # held_from above its usual value must survive too
        hist.truncate(1, hist.length(1) - 1)
    path = tmp_path / "kv.npz"
    snapshot.save(path, cache)
    loaded = snapshot.load(path)
    assert_same_state(cache, loaded)
    other, _, _ = filled(mode, dtype, seed=9, steps=3)    # restore over a different state, same spec
    snapshot.restore(other, path)
    assert_same_state(cache, other)
    # identical inputs, identical outputs; then both continue and stay equal to the oracle and each other
    q = rng.standard_normal((3, Q_HEADS, 1, 16)).astype(np.float32)
    counts = np.minimum(cache.answerable(), 1)
    for backend in ("cpu", "reference"):
        a = attend(q, cache, backend=backend, counts=counts)
        b = attend(q, loaded, backend=backend, counts=counts)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    seed = int(rng.integers(1 << 30))
    feed(cache, hcopy(hist), np.random.default_rng(seed), 7, check_backend="cpu")
    feed(loaded, hist, np.random.default_rng(seed), 7, check_backend="reference")
    assert_same_state(cache, loaded)


def test_file_holds_only_used_slots(tmp_path):
    cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=8))       # causal: 256 slots allocated
    x = np.ones((2, 1, 5, 8), np.float32)
    cache.append(x, x, counts=[5, 3])
    snapshot.save(tmp_path / "kv.npz", cache)
    with np.load(tmp_path / "kv.npz") as z:
        assert z["layer0.k"].shape == (2, 1, 5, 8)
        meta = json.loads(z["meta"].tobytes())
    assert meta["format"] == "streamattn-kv" and meta["version"] == 5 and meta["layout"] == "cache"
    assert meta["layers"][0]["slots"] == 256 and meta["layers"][0]["used"] == 5
    assert snapshot.load(tmp_path / "kv.npz").slots == 256


def test_multi_layer_model_in_one_file(tmp_path):
    """A hybrid model (window layers and a full-attention layer, as Gemma 3): all layers, one file."""
    rng = np.random.default_rng(3)
    specs = [make_spec("sinks", "bfloat16"), make_spec("window", "float16"), make_spec("causal")]
    layers = [KVCache(s) for s in specs]
    for c in layers:
        feed(c, History(3), rng, 20)
    snapshot.save(tmp_path / "model.npz", layers)
    loaded = snapshot.load(tmp_path / "model.npz", spec=specs)
    assert isinstance(loaded, list) and len(loaded) == 3
    for a, b in zip(layers, loaded):
        assert_same_state(a, b)
    fresh = [KVCache(s) for s in specs]
    snapshot.restore(fresh, tmp_path / "model.npz")
    for a, b in zip(layers, fresh):
        assert_same_state(a, b)
    with pytest.raises(snapshot.StateFileError, match=r"model.npz: holds 3 layer\(s\), 2 requested"):
        snapshot.restore(fresh[:2], tmp_path / "model.npz")


@pytest.mark.parametrize("mode", ["causal", "sinks"])
def test_save_one_sequence_load_into_another_batch(tmp_path, mode):
    """llama.cpp #5843: one sequence of a batch saved alone, loaded into a slot of a cache of another batch."""
    cache, hist, rng = filled(mode, "float16", batch=3)
    snapshot.save_sequence(tmp_path / "seq.npz", cache, 1)
    target, thist, _ = filled(mode, "float16", seed=5, batch=2)
    keep = clone(target)
    snapshot.load_sequence(tmp_path / "seq.npz", target, 0)
    hist.copy(1, 0, into=thist)
    assert np.array_equal(target.k[1], keep.k[1]) and target.lengths[1] == keep.lengths[1]   # other untouched
    assert target.lengths[0] == cache.lengths[1] and target.held_from[0] == cache.held_from[1]
    feed(target, thist, rng, 2 * (target.slots if mode == "sinks" else 10), check_backend="cpu")
    single = snapshot.load(tmp_path / "seq.npz")          # or as a batch-1 cache of its own
    assert single.spec.batch == 1 and np.array_equal(single.k[0], cache.k[1][:, :single.slots])


def test_load_on_the_cpu_whatever_device_saved(tmp_path):
    """The file holds host arrays: a snapshot loads with device='cpu' into numpy arrays."""
    cache, hist, rng = filled("sinks", "bfloat16")
    snapshot.save(tmp_path / "kv.npz", cache)
    loaded = snapshot.load(tmp_path / "kv.npz", device="cpu")
    assert type(loaded.k) is np.ndarray and loaded.device == "cpu"
    probe(loaded, hist, rng, backend="cpu")


def test_write_is_atomic(tmp_path, monkeypatch):
    cache, _, _ = filled("window")
    path = tmp_path / "kv.npz"
    snapshot.save(path, cache)
    before = path.read_bytes()
    cache.append(*np.ones((2, 3, 2, 1, 16), np.float32))

    def crash(f, **arrays):              # dies half way through writing the archive
        f.write(b"PK\x03\x04 half an archive")
        raise OSError("disk full")
    monkeypatch.setattr(snapshot.np, "savez", crash)
    with pytest.raises(OSError, match="disk full"):
        snapshot.save(path, cache)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["kv.npz"]   # old file, no temp left
    monkeypatch.undo()
    monkeypatch.setattr(snapshot.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("rename failed")))
    with pytest.raises(OSError, match="rename failed"):
        snapshot.save(path, cache)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["kv.npz"]


# -- bad files ------------------------------------------------------------------------------------
def rewrite(path, change):
    """Re-zip a state file after ``change(members, meta)`` edits it (the checksum is NOT recomputed)."""
    with np.load(path) as z:
        members = {n: z[n] for n in z.files}
    meta = json.loads(members["meta"].tobytes())
    change(members, meta)
    members["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **members)


def reseal(members, meta):
    """Recompute the digest, as a hand-made file with consistent checksum would have."""
    meta["sha256"] = snapshot._digest(meta, {n: a for n, a in members.items() if n != "meta"})


def truncate_to(n):
    return lambda path: path.write_bytes(path.read_bytes()[:n])


def flip_payload_byte(path):
    raw = bytearray(path.read_bytes())
    with np.load(path) as z:
        needle = z["layer0.k"].tobytes()[:32]
    at = raw.find(needle)
    assert at > 0
    raw[at + 5] ^= 0x40
    path.write_bytes(bytes(raw))


RUINED = r"not a readable streamattn state file: truncated or corrupted"
BAD_FILES = {
    "truncated-half": (lambda p: truncate_to(len(p.read_bytes()) // 2)(p),
                       RUINED + r" \(BadZipFile: File is not a zip file\)"),
    "truncated-last-byte": (lambda p: truncate_to(len(p.read_bytes()) - 1)(p), RUINED),
    "empty": (truncate_to(0), RUINED + r" \(ValueError: no zip header: the file starts with b''\)"),
    "flipped-bit": (flip_payload_byte, RUINED + r" \(BadZipFile: Bad CRC-32 for file 'layer0.k.npy'\)"),
    "payload-changed": (lambda p: rewrite(p, lambda m, meta: m["layer0.lengths"].__setitem__(0, 1)),
                        r"checksum mismatch: the payload hashes to sha256 [0-9a-f]{16}\.\.\., the file records "
                        r"[0-9a-f]{16}\.\.\.: the file is corrupted"),
    "meta-changed": (lambda p: rewrite(p, lambda m, meta: meta["layers"][0]["spec"].update(window=6)),
                     r"checksum mismatch"),
    "version-6": (lambda p: rewrite(p, lambda m, meta: meta.update(version=6)),
                  r"format version 6 is not supported: this streamattn reads versions \(1, 2, 3, 4, 5\)"),
    "other-format": (lambda p: rewrite(p, lambda m, meta: meta.update(format="kv-other")),
                     r"format 'kv-other' is not 'streamattn-kv': not a streamattn KV state file"),
    "no-meta": (lambda p: np.savez(open(p, "wb"), x=np.zeros(3)), r"no 'meta' member: not a streamattn-kv file"),
    "npy-not-npz": (lambda p: np.save(open(p, "wb"), np.zeros(3)),
                    RUINED + r" \(ValueError: no zip header: the file starts with b'\\x93NUMPY"),
    "garbage": (lambda p: p.write_bytes(b"hello, not a zip"),
                RUINED + r" \(ValueError: no zip header: the file starts with b'hello, n'\)"),
    "inconsistent-but-sealed": (lambda p: rewrite(p, lambda m, meta: (m["layer0.lengths"].__setitem__(0, -4),
                                                                      reseal(m, meta))),
                                r"layer 0: inconsistent contents \(ValueError: lengths \[-4, "),
    "missing-member-sealed": (lambda p: rewrite(p, lambda m, meta: (m.pop("layer0.held_from"), reseal(m, meta))),
                              r"layer 0: inconsistent contents \(KeyError"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_is_refused_by_name_and_nothing_changes(tmp_path, case):
    damage, match = BAD_FILES[case]
    saved, _, _ = filled("sinks", "float16")
    path = tmp_path / "bad.npz"
    snapshot.save(path, saved)
    damage(path)
    target, _, _ = filled("sinks", "float16", seed=4)
    keep = clone(target)
    with pytest.raises(snapshot.StateFileError, match=rf"^{re.escape(str(path))}: {match}"):
        snapshot.restore(target, path)
    assert_same_state(target, keep)
    with pytest.raises(snapshot.StateFileError, match=match):
        snapshot.load(path)
    with pytest.raises(snapshot.StateFileError, match=match):
        snapshot.load_sequence(path, target, 0)
    assert_same_state(target, keep)


def test_spec_mismatch_names_the_fields(tmp_path):
    cache, _, _ = filled("sinks", "float16")
    path = tmp_path / "kv.npz"
    snapshot.save(path, cache)
    want = CacheSpec(batch=3, kv_heads=2, head_dim=16, dtype="bfloat16", window=8, sinks=2, max_chunk=3)
    with pytest.raises(snapshot.StateFileError, match=rf"^{path}: layer 0 was saved with another spec: "
                       r"dtype='float16' in the file, 'bfloat16' requested; window=4 in the file, 8 requested$"):
        snapshot.load(path, spec=want)
    target = KVCache(want)
    keep = clone(target)
    with pytest.raises(snapshot.StateFileError, match=r"another spec: dtype='float16' in the file"):
        snapshot.restore(target, path)
    assert_same_state(target, keep)
    # check_finite is input policy, not state: it may differ
    relaxed = CacheSpec(**{**cache.spec.__dict__, "check_finite": False})
    assert snapshot.load(path, spec=relaxed).spec.check_finite is False


def test_load_sequence_needs_a_sequence_file(tmp_path):
    cache, _, _ = filled("window")
    snapshot.save(tmp_path / "all.npz", cache)
    with pytest.raises(snapshot.StateFileError, match=r"all.npz: layer 0 holds a batch of 3 sequences; load_sequence "
                       r"needs a file from save_sequence"):
        snapshot.load_sequence(tmp_path / "all.npz", cache, 0)
    snapshot.save_sequence(tmp_path / "one.npz", cache, 2)
    other = KVCache(make_spec("sinks"))
    with pytest.raises(snapshot.StateFileError, match=r"one.npz: layer 0 was saved with another spec: window=5 in "
                       r"the file, 4 requested; sinks=0 in the file, 2 requested"):
        snapshot.load_sequence(tmp_path / "one.npz", other, 0)
    with pytest.raises(ValueError, match=r"b must be a sequence index in 0..2 \(got 3\)"):
        snapshot.load_sequence(tmp_path / "one.npz", cache, 3)
    with pytest.raises(FileNotFoundError):
        snapshot.load(tmp_path / "missing.npz")


# -- fork -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
def test_fork_branches_continue_independently(mode):
    cache, hist, rng = filled(mode, "bfloat16")
    state.fork(cache, 0, 2)
    hist.copy(0, 2)
    assert np.array_equal(cache.k[0], cache.k[2]) and cache.lengths[0] == cache.lengths[2]
    # into a new cache (batch 1), then both go on with different tokens
    new, nhist = KVCache(make_spec(mode, "bfloat16", batch=1)), History(1)
    state.fork(cache, 0, 0, into=new)
    hist.copy(0, 0, into=nhist)
    steps = 2 * (cache.spec.slots or 10)   # past a full ring: the branches overwrite their own slots only
    feed(cache, hist, rng, steps, check_backend="cpu")
    feed(new, nhist, rng, steps, check_backend="reference")


def test_fork_into_a_smaller_causal_cache_grows_it():
    rng = np.random.default_rng(2)
    cache, hist = KVCache(make_spec("causal")), History(3)
    feed(cache, hist, rng, 150, ragged=False)                       # 150..450 tokens: 512 slots
    small = KVCache(make_spec("causal", batch=1))
    assert small.slots < cache.lengths.max()
    state.fork(cache, int(cache.lengths.argmax()), 0, into=small)
    h = History(1)
    hist.copy(int(cache.lengths.argmax()), 0, into=h)
    probe(small, h, rng, backend="cpu")


def test_fork_rejects():
    cache = KVCache(make_spec("window"))
    with pytest.raises(ValueError, match=r"dst must be a sequence index in 0..2 \(got 3\)"):
        state.fork(cache, 0, 3)
    with pytest.raises(ValueError, match=r"cannot fork into a cache with another spec: window, max_chunk differ"):
        state.fork(cache, 0, 0, into=KVCache(make_spec("window-1")))


# -- rewind ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_rewind_causal_always_and_equals_the_truncated_history(dtype):
    cache, hist, rng = filled("causal", dtype, steps=30)
    for b, k in [(0, 1), (1, 7), (2, int(cache.lengths[2]))]:
        state.rewind(cache, b, k)
        hist.truncate(b, hist.length(b) - k)
    assert cache.lengths.tolist() == [hist.length(b) for b in range(3)] and cache.lengths[2] == 0
    assert cache.last_counts.tolist() == [0, 0, 0]
    probe(cache, hist, rng, backend="cpu")
    feed(cache, hist, rng, 10, check_backend="cpu")


def closed_form(spec, L, k):
    """The rewind rule for a cache that has only ever appended (see state.rewind)."""
    return L <= spec.slots or k <= spec.max_chunk or L - k <= spec.sinks or spec.window == 1


@pytest.mark.parametrize("window,sinks,C", [(4, 0, 1), (3, 0, 3), (5, 2, 2), (1, 1, 2), (2, 3, 3)])
def test_rewind_window_exactly_when_the_rule_says(window, sinks, C):
    """Every (L, k): allowed exactly as derived; if allowed, the next chunks equal the oracle for the
    truncated history; if refused, nothing changes, and forcing it would give wrong attention (tight)."""
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=16, window=window, sinks=sinks, max_chunk=C)
    rng = np.random.default_rng(window * 100 + sinks * 10 + C)
    cache, hist = KVCache(spec), History(1)
    attend_raw = backends.get("cpu", "cpu")
    while cache.lengths[0] < 2 * spec.slots + C + 1:
        feed(cache, hist, rng, 1, ragged=False)
        L = int(cache.lengths[0])
        for k in range(L + 1):
            allowed = closed_form(spec, L, k)
            assert state.can_rewind(cache, 0, k) == allowed, (L, k)
            c, h = clone(cache), hcopy(hist)
            if allowed:
                state.rewind(c, 0, k)
                h.truncate(0, L - k)
                feed(c, h, rng, 2, check_backend="cpu")
                continue
            with pytest.raises(state.RewindError, match=rf"cannot rewind sequence 0 by {k} \(length {L} -> "
                               rf"{L - k}\) in this window cache: the next query \(position {L - k}\) needs keys "
                               rf"from position {max(sinks, L - k - window + 1)}, but the ring \(R={cache.ring} slots\)"):
                state.rewind(c, 0, k)
            assert_same_state(c, cache)
            c.truncate(0, k)                    # force it: the kernel would now read lost keys
            h.truncate(0, L - k)
            x = rng.standard_normal((2, 1, 1, 1, 16)).astype(np.float32)
            c.append(*x)
            h.append(*x, [1])
            q = rng.standard_normal((1, Q_HEADS, 1, 16)).astype(np.float32)
            with pytest.raises(ValueError, match=r"sequence 0 can attend only its newest 0 tokens exactly"):
                attend(q, c, backend="cpu")         # attend refuses too ...
            out, lse = attend_raw(q, c.k, c.v, c.lengths, c.last_counts, window=window, sinks=sinks,
                                  scale=0.25, kind="float32")
            with pytest.raises(AssertionError, match="relative error"):   # ... because the result is wrong
                check(out, lse, q, h, [1], spec, scale=0.25)


def test_rewinds_add_up_to_C_below_the_high_water_mark():
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=16, window=4, sinks=1, max_chunk=3)   # R = 6
    rng = np.random.default_rng(0)
    cache, hist = KVCache(spec), History(1)
    feed(cache, hist, rng, 10, ragged=False)                    # ring full, H = L
    H = int(cache.lengths[0])
    state.rewind(cache, 0, 2)                                          # H - 2
    hist.truncate(0, H - 2)
    x = rng.standard_normal((2, 1, 1, 1, 16)).astype(np.float32)
    cache.append(*x)                                            # H - 1: refills only its own slot
    hist.append(*x, [1])
    assert not state.can_rewind(cache, 0, 3)                    # would be H - 4: 4 > C below H
    assert state.can_rewind(cache, 0, 2)                        # H - 3 = H - C: allowed
    state.rewind(cache, 0, 2)
    hist.truncate(0, H - 3)
    assert cache.answerable().tolist() == [0]                   # the newest token's own keys are gone
    feed(cache, hist, rng, 12, ragged=False, check_backend="cpu")
    assert cache.held_from[0] == cache.lengths[0] - cache.ring  # refilled: back to the usual state
    assert cache.answerable().tolist() == [spec.max_chunk]


def test_speculative_decoding_rejects_drafts():
    """Draft C tokens, attend them, keep some, rewind the rest, append the correction: oracle-exact."""
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=16, dtype="float16", window=6, sinks=1, max_chunk=4)
    rng = np.random.default_rng(7)
    cache, hist = KVCache(spec), History(2)
    for step in range(25):
        feed(cache, hist, rng, 1, ragged=False, check_backend="cpu")     # a draft of T <= C tokens
        for b in range(2):
            reject = int(rng.integers(0, cache.last_counts[b] + 1))
            state.rewind(cache, b, reject)
            hist.truncate(b, hist.length(b) - reject)
        x = rng.standard_normal((2, 2, 2, 1, 16)).astype(np.float32)    # the corrected token
        cache.append(*x)
        hist.append(*as_stored(x, spec.dtype), [1, 1])
        probe(cache, hist, rng, backend="cpu", counts=[1, 1])


def test_rewind_rejects_bad_arguments():
    cache, _, _ = filled("window")
    keep = clone(cache)
    with pytest.raises(ValueError, match=r"b must be a sequence index in 0..2 \(got -1\)"):
        state.rewind(cache, -1, 1)
    with pytest.raises(ValueError, match=rf"k must be an integer in 0..lengths\[0\]={cache.lengths[0]} \(got -1\)"):
        state.rewind(cache, 0, -1)
    with pytest.raises(ValueError, match=r"k must be an integer"):
        state.rewind(cache, 0, int(cache.lengths[0]) + 1)
    assert_same_state(cache, keep)


# -- the device="gpu" code path, through a strict stand-in for CuPy (no GPU here) -------------------
def test_gpu_code_path_with_a_stand_in_device(tmp_path, monkeypatch):
    """Save on the "GPU", load on the CPU and back, fork and rewind across devices: the same bits as a CPU
    twin fed the same tokens. tests/strict_cupy.py refuses implicit host<->device conversions."""
    import sys
    import strict_cupy
    monkeypatch.setitem(sys.modules, "cupy", strict_cupy)
    spec = make_spec("sinks", "bfloat16", batch=2)
    rng = np.random.default_rng(11)
    cpu, gpu, hist = KVCache(spec), KVCache(spec, device="gpu"), History(2)
    assert isinstance(gpu.k, strict_cupy.ndarray)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(gpu.k)

    def same(c, g):
        assert_same_state(c, _hosted(g))

    for step in range(3 * spec.slots):
        T = 1 + step % spec.max_chunk
        k, v = rng.standard_normal((2, 2, 2, T, 16)).astype(np.float32)
        cpu.append(k, v)
        gpu.append(strict_cupy.asarray(k), strict_cupy.asarray(v))
        hist.append(as_stored(k, spec.dtype), as_stored(v, spec.dtype), [T, T])
    same(cpu, gpu)
    for c in (cpu, gpu):
        state.rewind(c, 1, 2)
        state.fork(c, 1, 0)
    hist.truncate(1, hist.length(1) - 2)
    hist.copy(1, 0)
    same(cpu, gpu)
    q = rng.standard_normal((2, Q_HEADS, 1, 16)).astype(np.float32)
    counts = np.minimum(gpu.answerable(), 1)
    out, lse = attend(strict_cupy.asarray(q), gpu, backend="reference", counts=counts)
    check(out, lse, q, hist, counts, dataclasses.replace(spec, dtype="float32"), what="reference on the stand-in")

    snapshot.save(tmp_path / "g.npz", gpu)                                   # GPU -> file -> CPU
    assert_same_state(cpu, snapshot.load(tmp_path / "g.npz", device="cpu"))
    snapshot.save(tmp_path / "c.npz", cpu)                                   # CPU -> file -> GPU
    same(cpu, snapshot.load(tmp_path / "c.npz", device="gpu"))
    other = KVCache(spec, device="gpu")
    snapshot.restore(other, tmp_path / "c.npz")
    same(cpu, other)
    snapshot.save_sequence(tmp_path / "s.npz", gpu, 0)
    back = KVCache(spec)
    snapshot.load_sequence(tmp_path / "s.npz", back, 1)
    assert np.array_equal(back.k[1], cpu.k[0]) and back.lengths[1] == cpu.lengths[0]
    one = make_spec("sinks", "bfloat16", batch=1)
    one_cpu, one_gpu = KVCache(one), KVCache(one, device="gpu")
    state.fork(gpu, 0, 0, into=one_cpu)                                   # GPU -> CPU
    state.fork(cpu, 0, 0, into=one_gpu)                                   # CPU -> GPU
    assert_same_state(one_cpu, _hosted(one_gpu))
    assert np.array_equal(one_cpu.k[0], cpu.k[0])


def _hosted(cache):
    """A CPU copy of a stand-in-device cache, to compare bits."""
    c = copy.copy(cache)
    c.k, c.v, c.device = cache.k.get(), cache.v.get(), "cpu"
    return c


def test_temporal_view_after_a_rewind_shows_only_held_positions():
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=16, window=3, sinks=2, max_chunk=2)   # R = 4
    rng = np.random.default_rng(1)
    cache, hist = KVCache(spec), History(1)
    feed(cache, hist, rng, 12, ragged=False)
    L = int(cache.lengths[0])
    state.rewind(cache, 0, 2)
    hist.truncate(0, L - 2)
    k, v, pos = cache.temporal_view(0)
    assert pos.tolist() == [0, 1] + list(range(L - 4, L - 2))       # sinks, then held_from .. L' - 1
    full = np.concatenate(hist.k[0], axis=1)
    assert np.array_equal(k, full[:, pos].astype(np.float32))
