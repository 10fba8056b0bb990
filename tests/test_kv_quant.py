"""Quantized K/V storage (q8_0, q4_0): the blocks are gguf-py's, byte for byte, and every backend is exact
(float32 tolerance) against the float64 oracle over the values the cache stores."""

import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize

from streamattn import CacheSpec, KVCache, attend
from streamattn.kv import snapshot, state
from streamattn.kv.storage import dequantize, quantize
from oracle import as_stored, rotation
from test_oracle import stream   # every output against the oracle over the values as stored

GGUF = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
QUANT = ["q8_0", "q4_0"]


def rows(rng, n, d):
    """Rows of mixed magnitudes, with the cases rounding is decided on: zeros, exact halves of the step,
    a repeated largest magnitude of both signs (Q4_0 keeps the first), one huge outlier."""
    x = (rng.standard_normal((n, d)) * rng.uniform(1e-3, 50, (n, 1))).astype(np.float32)
    x[0] = 0
    x[1, :32] = (np.arange(32, dtype=np.float32) * 0.5 - 8)[:d]    # q8_0 and q4_0 land on .5 ties
    x[2, :32] = 1.0
    x[2, 7], x[2, 9] = -3.0, 3.0
    x[3, 5] = 1e4
    return x


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 256])
def test_quantizer_gives_gguf_bytes(dtype, d):
    """The same bytes as gguf.quants.quantize (rows zero-padded to a multiple of 32 where d is not one),
    and dequantize reads them back as gguf.quants.dequantize does."""
    x = rows(np.random.default_rng(d), 40, d)
    padded = np.concatenate([x, np.zeros((40, -d % 32), np.float32)], axis=1)
    ours, bad = quantize(x, dtype)
    want = gguf_quantize(padded, GGUF[dtype])
    assert bad == 0
    assert ours.dtype == np.uint8 and np.array_equal(ours, want)
    assert np.array_equal(dequantize(ours, dtype, d), gguf_dequantize(want, GGUF[dtype])[:, :d])


@pytest.mark.parametrize("dtype", QUANT)
def test_quantizer_marks_non_finite_blocks(dtype):
    """NaN or inf in a block gives it a NaN scale (every value read from it NaN); a q8_0 block past
    float16's range keeps an inf scale; both are counted, and the other blocks are the usual bytes."""
    x = np.ones((3, 64), np.float32)
    x[0, 3], x[1, 40] = np.nan, np.inf
    q, bad = quantize(x, dtype)
    assert bad == 2
    values = dequantize(q, dtype, 64)
    assert np.isnan(values[0, :32]).all() and np.isnan(values[1, 32:]).all()
    assert np.array_equal(q[2], gguf_quantize(x[2:], GGUF[dtype])[0])
    assert np.array_equal(q[0, q.shape[1] // 2:], q[2, q.shape[1] // 2:])
    if dtype == "q8_0":
        assert quantize(np.full((1, 32), 1e7, np.float32), dtype)[1] == 1


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("window,sinks", [(None, 0), (1, 0), (19, 0), (5, 2)])
def test_decode_every_mode(backend, dtype, window, sinks):
    spec = CacheSpec(batch=2, kv_heads=3, head_dim=64, dtype=dtype, window=window, sinks=sinks)
    steps = 3 * (spec.slots or 20) + 7  # >= 3 full wraps of the ring
    stream(spec, 9, steps, backend, seed=zlib.crc32(f"{dtype}/{window}/{sinks}".encode()) % 1000)  # not hash()


@pytest.mark.parametrize("dtype,dtype_v", [("q8_0", "q4_0"), ("float16", "q8_0"), ("q4_0", "float32")])
@pytest.mark.parametrize("window,sinks,C", [(None, 0, 4), (7, 0, 5), (5, 2, 5)])
def test_chunks_and_mixed_k_v_storage(dtype, dtype_v, window, sinks, C):
    """K and V stored apart, each read by its own kind; chunks of every size 1..C, write then attend."""
    spec = CacheSpec(batch=2, kv_heads=1, head_dim=64, dtype=dtype, dtype_v=dtype_v, window=window, sinks=sinks,
                     max_chunk=C)
    chunks = list(range(1, C + 1)) + list(range(C, 0, -1))
    stream(spec, 4, 4 * C + 3, "cpu", chunks=chunks, seed=C)


@pytest.mark.parametrize("dtype", QUANT)
def test_ragged_batch_gqa_mqa(dtype):
    for kv_heads, q_heads in [(3, 9), (1, 4), (2, 2)]:
        spec = CacheSpec(batch=3, kv_heads=kv_heads, head_dim=64, dtype=dtype, window=11, sinks=2, max_chunk=4)
        stream(spec, q_heads, 20, "cpu", chunks=[1, 4, 3, 2], ragged=True, seed=kv_heads)


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256, 40])
def test_head_dims(dtype, head_dim):
    """Vector kernels (head_dim % 16 == 0, a last block half full at 80) and the plain loops (40), over
    more than one page of keys (the split-K merge) in chunks up to 64."""
    spec = CacheSpec(batch=1, kv_heads=2, head_dim=head_dim, dtype=dtype, window=99, max_chunk=64)
    stream(spec, 6, 6, "cpu", chunks=[64, 1, 37], seed=head_dim)


@pytest.mark.parametrize("dtype", QUANT)
def test_non_finite_input(dtype):
    """A check_finite cache refuses a chunk holding NaN (unchanged); without the check the rows that see
    it come back NaN, as the oracle over the stored (NaN) block answers."""
    x = np.ones((1, 1, 1, 64), np.float32)
    bad = x.copy()
    bad[0, 0, 0, 7] = np.nan
    cache = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=64, dtype=dtype))
    cache.append(x, x)
    before = cache.k.copy(), cache.v.copy(), cache.lengths.copy()
    with pytest.raises(ValueError, match="k holds NaN or inf for sequence 0"):
        cache.append(bad, x)
    with pytest.raises(ValueError, match="v holds NaN or inf for sequence 0"):
        cache.append(x, bad)
    assert all(np.array_equal(a, b) for a, b in zip(before, (cache.k, cache.v, cache.lengths)))
    loose = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=64, dtype=dtype, check_finite=False))
    loose.append(bad, bad)
    out, lse = attend(x, loose, backend="cpu")
    assert np.isnan(out).all() and np.isnan(lse).all()          # a NaN key: the whole row
    loose.reset()
    loose.append(x, bad)
    out, lse = attend(x, loose, backend="cpu")
    assert np.isnan(out[..., :32]).all() and np.isfinite(out[..., 32:]).all()   # a NaN value: its block


def test_cache_bytes_and_temporal_view():
    """q8_0 rows take 34 bytes per 32 values (float16: 64), q4_0 18; temporal_view reads the stored values."""
    x = np.random.default_rng(1).standard_normal((1, 2, 5, 64)).astype(np.float32)
    sizes = {}
    for dtype in ("float16", "q8_0", "q4_0"):
        cache = KVCache(CacheSpec(batch=1, kv_heads=2, head_dim=64, dtype=dtype, window=8, max_chunk=5))
        cache.append(x, x)
        sizes[dtype] = cache.nbytes
        k, v, pos = cache.temporal_view(0)
        kx = x[0] @ rotation(64).astype(np.float32) if cache.spec.rotate_k else x[0]   # keys as stored: k @ H
        assert np.array_equal(k, as_stored(kx, dtype)) and np.array_equal(v, as_stored(x[0], dtype))
        assert pos.tolist() == [0, 1, 2, 3, 4]
    assert sizes["q8_0"] * 64 == sizes["float16"] * 34 and sizes["q4_0"] * 34 == sizes["q8_0"] * 18


def test_spec_names_bad_dtypes():
    with pytest.raises(ValueError, match="dtype_v must be one of"):
        CacheSpec(batch=1, kv_heads=1, head_dim=64, dtype_v="q5_0")
    with pytest.raises(ValueError, match="dtype must be one of"):
        CacheSpec(batch=1, kv_heads=1, head_dim=64, dtype="int8")
    assert CacheSpec(batch=1, kv_heads=1, head_dim=64, dtype="q8_0", dtype_v="q8_0").dtype_v is None


def _fill(cache, rng, steps, T=1):
    for _ in range(steps):
        x = rng.standard_normal((cache.spec.batch, cache.spec.kv_heads, T, cache.spec.head_dim)).astype(np.float32)
        cache.append(x, 2 * x)


def _same_state(a, b):
    """The same storage bytes (float16 sinks included) and counters."""
    if (a.sink_k is None) != (b.sink_k is None):
        return False
    sinks = (lambda c: ()) if a.sink_k is None else (lambda c: (c.sink_k, c.sink_v))
    return all(np.array_equal(x, y) for x, y in zip((a.k, a.v, a.lengths, a.last_counts, a.held_from) + sinks(a),
                                                     (b.k, b.v, b.lengths, b.last_counts, b.held_from) + sinks(b)))


def test_snapshot_round_trip_is_bit_exact(tmp_path):
    """Whole caches (a layer list of mixed storage) and one sequence: the bytes as written, no re-quantizing."""
    rng = np.random.default_rng(3)
    caches = [KVCache(CacheSpec(batch=2, kv_heads=2, head_dim=80, dtype="q8_0", dtype_v="q4_0", window=6,
                                sinks=1, max_chunk=2)),
              KVCache(CacheSpec(batch=2, kv_heads=2, head_dim=80, dtype="q4_0"))]
    for c in caches:
        _fill(c, rng, 11)
    snapshot.save(tmp_path / "kv.npz", caches)
    loaded = snapshot.load(tmp_path / "kv.npz")
    assert [c.spec for c in loaded] == [c.spec for c in caches]
    assert all(_same_state(a, b) for a, b in zip(loaded, caches))
    snapshot.save_sequence(tmp_path / "seq.npz", caches, 1)
    fresh = [KVCache(c.spec) for c in caches]
    snapshot.load_sequence(tmp_path / "seq.npz", fresh, 0)
    for a, b in zip(fresh, caches):
        assert np.array_equal(a.k[0, :, :b.k.shape[2]], b.k[1]) and np.array_equal(a.v[0, :, :b.v.shape[2]], b.v[1])
    with pytest.raises(snapshot.StateFileError, match="dtype_v='q4_0' in the file, None requested"):
        snapshot.restore([KVCache(CacheSpec(batch=2, kv_heads=2, head_dim=80, dtype="q8_0", window=6, sinks=1,
                                            max_chunk=2)), KVCache(caches[1].spec)], tmp_path / "kv.npz")


def test_version_1_file_still_loads():
    """tests/data/kv_v1_sinks_float16.npz was written by the version-1 code (main 962f8fc) from these
    appends; it loads as the same cache, bit for bit."""
    rng = np.random.default_rng(28)
    want = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=16, dtype="float16", window=4, sinks=1, max_chunk=2))
    for t in range(7):
        x = rng.standard_normal((2, 1, 1, 16)).astype(np.float32)
        want.append(x, -x, counts=[1, t % 2])
    got = snapshot.load(Path(__file__).parent / "data" / "kv_v1_sinks_float16.npz")
    assert got.spec == want.spec and _same_state(got, want)


def test_version_2_file_still_loads():
    """tests/data/kv_v2_sinks_q4_0.npz was written by the version-2 code (main 785d516), whose sinks caches
    quantized their sinks like every other token: it loads as such a cache (sink_dtype None), bit for bit."""
    rng = np.random.default_rng(28)
    want = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=32, dtype="q4_0", dtype_v="q8_0", window=4, sinks=1,
                             max_chunk=2, sink_dtype=None, rotate_k=False))
    for t in range(7):
        x = rng.standard_normal((2, 1, 1, 32)).astype(np.float32)
        want.append(x, -x, counts=[1, t % 2])
    got = snapshot.load(Path(__file__).parent / "data" / "kv_v2_sinks_q4_0.npz")
    assert got.spec == want.spec and got.spec.sink_dtype is None and _same_state(got, want)


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("sinks", [0, 5])
def test_fork_and_rewind_keep_the_stored_bytes(dtype, sinks):
    """A fork copies the blocks; a rewind then the same appends gives the bytes of a straight run (each
    token quantized once, the same way). With 5 sinks (float16) the rewind from 6 to 4 tokens drops a sink
    row and a ring row."""
    spec = CacheSpec(batch=2, kv_heads=1, head_dim=64, dtype=dtype, window=8, sinks=sinks, max_chunk=3)
    rng = np.random.default_rng(5)
    chunks = [rng.standard_normal((2, 1, 1, 64)).astype(np.float32) for _ in range(6)]
    straight, cache = KVCache(spec), KVCache(spec)
    for x in chunks:
        straight.append(x, x)
    for x in chunks[:4] + [np.zeros_like(x)] * 2:
        cache.append(x, x)
    state.rewind(cache, 0, 2)
    state.rewind(cache, 1, 2)
    for x in chunks[4:]:
        cache.append(x, x)
    assert _same_state(cache, straight)
    state.fork(cache, 0, 1)
    assert np.array_equal(cache.k[1], cache.k[0]) and np.array_equal(cache.v[1], cache.v[0])
    if sinks:
        assert np.array_equal(cache.sink_v[1], cache.sink_v[0]) and cache.sink_k[0].any()


# -- kernels/*.cu over quantized rows: tests/test_gpu_emu.py (the device module imports them with no gguf) --


# -- a model's caches: the engine's prompt cache and the Generator on quantized K/V ----------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from _model_util import write_tiny_gguf
    from streamattn.gguf.loader import load_gguf
    from streamattn.models.transformer import Transformer
    from streamattn.text.tokenizer import Tokenizer
    m = load_gguf(write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", arch="llama", vocab=64))
    return Transformer(m), Tokenizer.from_metadata(m.metadata)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("cache", [dict(cache="full"), dict(cache="sinks", window=6, sinks=2)])
def test_prompt_cache_and_generator_on_quantized_caches(tiny, cache):
    """q8_0 K / q4_0 V through the engine: the second request reuses 30 prompt tokens of the first (fork +
    rewind of the quantized rows), and both generate exactly what a Generator with the same storage does."""
    from streamattn.engine.core import Engine, EngineConfig
    from streamattn.engine.generate import Generator
    from streamattn.engine.sequence import Job, Sequence
    rng = np.random.default_rng(9)
    shared = list(rng.integers(3, 64, 30))
    jobs = [Job(prompt=tuple(int(t) for t in shared + list(rng.integers(3, 64, n))), max_tokens=5, ignore_eos=True)
            for n in (3, 4)]
    kw = dict(window=cache.get("window"), sinks=cache.get("sinks", 0), cache_dtype="q8_0", cache_dtype_v="q4_0")
    eng = Engine(*tiny, EngineConfig(cache=cache["cache"], prefill_chunk=8, prompt_cache_mb=8, **kw))
    assert eng.caches[0].spec.dtype == "q8_0" and eng.caches[0].spec.v_dtype == "q4_0"
    gen = Generator(*tiny, cache=cache["cache"], prefill_chunk=8, **kw)
    for j, reused in zip(jobs, (0, 30)):
        s = Sequence(job=j, emit=lambda ev: None, tok=eng.tok)
        eng.submit(s)
        while not s.finished:
            eng.step()
        assert s.cached == reused
        alone = [ev.token_id for ev in gen.stream(list(j.prompt), max_tokens=5, ignore_eos=True)]
        assert s.generated == alone


@pytest.mark.parametrize("dtype", [*QUANT, "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_a_row_does_not_depend_on_its_group(dtype, head_dim):
    """The 1-, 2-, 3- and 4-row kernels read a block the same way: each query row's bits are the same
    whether its GQA group has 1..5 rows (batch invariance, docs/DESIGN.md §7; three rows take the 3-row
    kernels, for every storage), at 80 through the half-block tail."""
    rng = np.random.default_rng(head_dim)
    cache = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=head_dim, dtype=dtype, max_chunk=64))
    x = rng.standard_normal((1, 1, 600, head_dim)).astype(np.float32)
    cache.append(x[:, :, :599], x[:, :, 1:])
    q = rng.standard_normal((1, 5, 1, head_dim)).astype(np.float32)
    alone = [attend(q[:, r:r + 1], cache, backend="cpu", counts=np.array([1]))[0][0, 0] for r in range(5)]
    for g in range(2, 6):
        group = attend(q[:, :g], cache, backend="cpu", counts=np.array([1]))[0][0]
        for r in range(g):
            assert np.array_equal(group[r], alone[r]), (g, r)


# -- float16 sinks: a sinks cache with quantized K or V keeps its n_s sink tokens in float16 (docs/DESIGN.md §6)

SPLIT = [("q4_0", None), ("q8_0", None), ("q4_0", "float32"), ("float32", "q8_0")]   # K and V apart too


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype,dtype_v", SPLIT)
def test_float16_sinks_every_step(backend, dtype, dtype_v):
    """Sinks apart (float16, or float32 beside a float32 side) and the ring quantized, attended in two parts
    and merged: against the oracle over the stored values (the sink store + the dequantized ring) at every
    step, >= 3 ring wraps, chunks 1..C, GQA 9/3, ragged batches (sequences at 0 queries, chunks that
    straddle the last sink)."""
    C = 4
    spec = CacheSpec(batch=3, kv_heads=3, head_dim=64, dtype=dtype, dtype_v=dtype_v, window=5, sinks=3, max_chunk=C)
    apart = "float32" if "float32" in (dtype, dtype_v) else "float16"
    assert spec.sink_dtype == apart
    chunks = list(range(1, C + 1)) + list(range(C, 0, -1))
    cache = stream(spec, 9, 3 * spec.slots + 5, backend, chunks=chunks, ragged=True, seed=len(dtype + str(dtype_v)))
    assert cache.k.shape[2] == spec.slots - spec.sinks and cache.sink_k.dtype == np.dtype(apart)
    assert cache.lengths.min() > 3 * spec.slots // 2            # each sequence's ring wrapped
    stream(spec, 9, 3 * spec.slots + 5, backend, seed=1)       # decode alone


def _stream_with_q_sink(spec, backend, steps, chunks, seed):
    """Like test_oracle.stream with a second query for the sink keys (positions within the cache, §5),
    checked against reference.attention(q_sink=...) over the stored values."""
    from oracle import TOL, History
    from streamattn.kv.reference import attention
    rng = np.random.default_rng(seed)
    cache, hist = KVCache(spec), History(spec.batch, spec)
    for step in range(steps):
        T = chunks[step % len(chunks)]
        shape = (spec.batch, spec.kv_heads, T, spec.head_dim)
        k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
        counts = rng.integers(0, T + 1, size=spec.batch)
        cache.append(k, v, counts=counts)
        hist.append(k, v, counts)
        q, q_sink = (rng.standard_normal((spec.batch, 6, T, spec.head_dim)).astype(np.float32) for _ in range(2))
        out, lse = attend(q, cache, backend=backend, q_sink=q_sink)
        for b, c in enumerate(counts):
            assert np.all(out[b, :, c:] == 0) and np.all(lse[b, :, c:] == -np.inf)
            if c == 0:
                continue
            hk, hv = (np.concatenate(x[b], axis=1) for x in (hist.k, hist.v))
            L = hk.shape[1]
            H = np.eye(spec.head_dim) if hist.H is None else hist.H          # keys stored rotated: so is q
            ro, rl = attention(q[b, :, :c] @ H, hk, hv, np.arange(L - c, L), window=spec.window, sinks=spec.sinks,
                               q_sink=q_sink[b, :, :c] @ H)
            err = np.abs(out[b, :, :c] - ro).max() / np.abs(ro).max()
            assert err <= TOL["float32"] and np.abs(lse[b, :, :c] - rl).max() <= 1e-4, (step, b, err)
    return cache


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype,dtype_v", [("q4_0", None), ("q8_0", "q4_0")])
def test_float16_sinks_with_queries_at_cache_positions(backend, dtype, dtype_v):
    """The sink part is scored with q_sink, the ring part with q (docs/DESIGN.md §5), ragged, GQA 6/2,
    chunks 1..3 through >= 3 wraps; the keys rotated (the default for a quantized K), sinks included."""
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=64, dtype=dtype, dtype_v=dtype_v, window=4, sinks=2, max_chunk=3)
    _stream_with_q_sink(spec, backend, 3 * spec.slots + 4, [1, 3, 2, 3, 1], seed=11)


def test_float16_sinks_hold_float16_values():
    """The sinks read back as float16 rounds the input, the ring as the quantizer stores it; with
    sink_dtype=None every row is quantized, as before. The sink store is counted in nbytes."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 2, 7, 64)).astype(np.float32)
    split = KVCache(CacheSpec(batch=1, kv_heads=2, head_dim=64, dtype="q4_0", window=4, sinks=3, max_chunk=7,
                              rotate_k=False))                       # keys as given (rotation: test_kv_rotation)
    same = KVCache(CacheSpec(batch=1, kv_heads=2, head_dim=64, dtype="q4_0", window=4, sinks=3, max_chunk=7,
                             sink_dtype=None, rotate_k=False))
    for c in (split, same):
        c.append(x, -x)
    k, v, pos = split.temporal_view(0)
    assert pos.tolist() == list(range(7))
    assert np.array_equal(k[:, :3], as_stored(x[0, :, :3], "float16")) and np.array_equal(v[:, :3], -k[:, :3])
    assert np.array_equal(k[:, 3:], as_stored(x[0, :, 3:], "q4_0"))
    k2, _, _ = same.temporal_view(0)
    assert np.array_equal(k2, as_stored(x[0], "q4_0")) and not np.array_equal(k2[:, :3], k[:, :3])
    assert split.nbytes == same.nbytes - 2 * 2 * 3 * 36 + 2 * 2 * 3 * 128      # 3 slots: 36 q4_0 bytes -> 128
    assert same.sink_k is None and np.shares_memory(split.head(1).sink_k, split.sink_k)


def test_float16_sinks_spec():
    """auto: where a sinks cache quantizes K or V, its sinks apart in float32 if the other side is float32
    (never coarser than that side's ring), else float16; None elsewhere; a sink store elsewhere is refused."""
    kw = dict(batch=1, kv_heads=1, head_dim=64, window=4)
    assert CacheSpec(dtype="q8_0", sinks=1, **kw).sink_dtype == "float16"
    assert CacheSpec(dtype="float16", dtype_v="q4_0", sinks=1, **kw).sink_dtype == "float16"
    assert CacheSpec(dtype="bfloat16", dtype_v="q8_0", sinks=1, **kw).sink_dtype == "float16"
    assert CacheSpec(dtype="float32", dtype_v="q8_0", sinks=1, **kw).sink_dtype == "float32"
    assert CacheSpec(dtype="q4_0", dtype_v="float32", sinks=1, **kw).sink_dtype == "float32"
    assert CacheSpec(dtype="float32", dtype_v="q8_0", sinks=1, sink_dtype="float16", **kw).sink_dtype == "float16"
    assert CacheSpec(dtype="q8_0", sinks=1, sink_dtype="float32", **kw).sink_dtype == "float32"
    assert CacheSpec(dtype="q8_0", **kw).sink_dtype is None                  # no sinks
    assert CacheSpec(dtype="float16", sinks=1, **kw).sink_dtype is None      # float storage
    for apart in ("float16", "float32"):
        with pytest.raises(ValueError, match=f"sink_dtype='{apart}' needs sinks and a quantized K or V"):
            CacheSpec(dtype="float32", sinks=1, sink_dtype=apart, **kw)
    with pytest.raises(ValueError, match="sink_dtype must be 'auto', 'float16', 'float32' or None"):
        CacheSpec(dtype="q8_0", sinks=1, sink_dtype="bfloat16", **kw)


def test_float16_sinks_rows_do_not_depend_on_the_chunk():
    """Batch invariance (docs/DESIGN.md §7) through the two parts: a query's bits are the same whether it
    is decoded alone or arrives in a chunk, and whatever the other sequence of the call does."""
    rng = np.random.default_rng(8)
    spec = CacheSpec(batch=2, kv_heads=1, head_dim=64, dtype="q4_0", window=6, sinks=2, max_chunk=4)
    k, v = (np.repeat(rng.standard_normal((1, 1, 20, 64)).astype(np.float32), 2, 0) for _ in range(2))
    q = np.repeat(rng.standard_normal((1, 3, 20, 64)).astype(np.float32), 2, 0)      # [2, 3, 20, 64]
    alone, chunked = KVCache(spec), KVCache(spec)
    rows_alone, rows_chunked = [], []
    for t in range(20):                          # sequence 1 decodes every other token beside it
        counts = np.array([1, t % 2])
        alone.append(k[:, :, t:t + 1], v[:, :, t:t + 1], counts=counts)
        rows_alone.append(attend(q[:, :, t:t + 1], alone, backend="cpu", counts=counts)[0][0, :, 0])
    for t0 in range(0, 20, 4):                   # the first chunk straddles the sinks (rows 0, 1 | 2, 3)
        chunked.append(k[:, :, t0:t0 + 4], v[:, :, t0:t0 + 4])
        out = attend(q[:, :, t0:t0 + 4], chunked, backend="cpu")[0][0]                 # [3, 4, 64]
        rows_chunked.extend(out[:, i] for i in range(4))
    assert all(np.array_equal(a, b) for a, b in zip(rows_alone, rows_chunked))


def test_float16_sinks_snapshot(tmp_path):
    """Snapshots (version 3 on) and save/load of one sequence move the float16 sinks and the ring bytes as
    stored: bit for bit, never re-quantized (fork and rewind: test_fork_and_rewind_keep_the_stored_bytes)."""
    rng = np.random.default_rng(6)
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=80, dtype="q8_0", dtype_v="q4_0", window=5, sinks=3, max_chunk=3)
    cache = KVCache(spec)
    _fill(cache, rng, 13, T=1)
    snapshot.save(tmp_path / "kv.npz", [cache])
    loaded = snapshot.load(tmp_path / "kv.npz")[0]
    assert loaded.spec == spec and _same_state(loaded, cache)
    restored = KVCache(spec)
    snapshot.restore([restored], tmp_path / "kv.npz")
    assert _same_state(restored, cache)
    snapshot.save_sequence(tmp_path / "seq.npz", [cache], 1)
    one = KVCache(spec)
    snapshot.load_sequence(tmp_path / "seq.npz", [one], 0)
    assert np.array_equal(one.sink_k[0], cache.sink_k[1]) and np.array_equal(one.k[0], cache.k[1])
    with pytest.raises(snapshot.StateFileError, match="sink_dtype='float16' in the file, None requested"):
        snapshot.load(tmp_path / "kv.npz", spec=[CacheSpec(**{**spec.__dict__, "sink_dtype": None})])


def _as_version(path, out, version, spec=None, dtypes=None):
    """A copy of the file at ``path`` rewritten as format ``version``, its first layer's spec updated with
    ``spec`` and members cast to ``dtypes``, resealed: what an older streamattn wrote, or a file that claims so."""
    from test_state import reseal, rewrite

    def change(members, meta):
        meta["version"] = version
        meta["layers"][0]["spec"].update(spec or {})
        members.update({n: members[n].astype(dt) for n, dt in (dtypes or {}).items()})
        reseal(members, meta)
    shutil.copy(path, out)
    rewrite(out, change)
    return out


def test_float32_sinks_beside_a_float32_side(tmp_path):
    """K float32 beside a quantized V keeps its sinks in float32 (version 5 files, bit for bit); a version 4
    file of that spec (float16 sinks, as written then) still loads as it was written, and a version 4 file
    that claims float32 sinks is refused by name."""
    rng = np.random.default_rng(7)
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=64, dtype="float32", dtype_v="q8_0", window=5, sinks=3,
                     max_chunk=3)
    assert spec.sink_dtype == "float32"
    cache = KVCache(spec)
    k = rng.standard_normal((2, 2, 1, 64)).astype(np.float32)
    cache.append(k, k)
    assert cache.sink_k.dtype == np.float32 and np.array_equal(cache.sink_k[:, :, 0], k[:, :, 0])  # not rounded
    _fill(cache, rng, 12, T=1)
    snapshot.save(tmp_path / "kv.npz", [cache])
    loaded = snapshot.load(tmp_path / "kv.npz")[0]
    assert loaded.spec == spec and _same_state(loaded, cache)
    old = CacheSpec(**{**spec.__dict__, "sink_dtype": "float16"})
    v4 = _as_version(tmp_path / "kv.npz", tmp_path / "v4.npz", 4, {"sink_dtype": "float16"},
                     {"layer0.sink_k": np.float16, "layer0.sink_v": np.float16})
    got = snapshot.load(v4)[0]
    assert got.spec == old and got.sink_k.dtype == np.float16
    assert np.array_equal(got.sink_k, cache.sink_k.astype(np.float16)) and np.array_equal(got.k, cache.k)
    bad = _as_version(tmp_path / "kv.npz", tmp_path / "bad.npz", 4)
    with pytest.raises(snapshot.StateFileError, match="a version 4 spec keeps its sinks in float16 or not apart"):
        snapshot.load(bad)


def test_float16_sinks_refuse_non_finite_as_stored():
    """A sink row is checked as float16 stores it (1e5 overflows), a ring row as quantized: refused by
    name, the cache unchanged."""
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=64, dtype="q8_0", window=4, sinks=2)
    cache = KVCache(spec)
    big = np.full((1, 1, 1, 64), 1e5, np.float32)
    with pytest.raises(ValueError, match="k holds NaN or inf for sequence 0"):
        cache.append(big, np.ones_like(big))
    assert cache.lengths[0] == 0 and not cache.sink_k.any()
    for _ in range(2):
        cache.append(np.ones_like(big), np.ones_like(big))
    cache.append(big, big)                                       # a ring row: q8_0 holds 1e5
    assert cache.lengths[0] == 3


def test_quantized_sinks_flag():
    """--quantized-sinks turns float16 sinks off through the options, the engine and the server config."""
    import argparse
    from streamattn.engine.core import EngineConfig
    from streamattn.engine.options import ModelOptions, add_arguments
    from streamattn.serve.config import ServeConfig
    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--cache", "sinks", "--cache-dtype", "q4_0"]
    assert ModelOptions.from_args(p.parse_args(base)).quantized_sinks is False
    opts = ModelOptions.from_args(p.parse_args(base + ["--quantized-sinks"]))
    assert opts.quantized_sinks is True
    assert EngineConfig(cache="sinks", window=4, sinks=2, cache_dtype="q4_0").cache_kwargs["sink_dtype"] == "auto"
    assert EngineConfig(cache="sinks", window=4, sinks=2, cache_dtype="q4_0",
                        quantized_sinks=True).cache_kwargs["sink_dtype"] is None
    assert ServeConfig(cache="sinks", cache_dtype="q4_0", quantized_sinks=True).engine_config.quantized_sinks
    with pytest.raises(ValueError, match="quantized_sinks must be True or False"):
        EngineConfig(quantized_sinks="yes")


@pytest.mark.usefixtures("one_thread")
def test_generator_float16_sinks_by_default(tiny):
    """A model's sinks caches keep float16 sinks by default and quantized ones with quantized_sinks; the
    two generate from the same prompt (and differ in what they store)."""
    from streamattn.engine.generate import Generator
    prompt = list(np.random.default_rng(2).integers(3, 64, 20))
    runs = {}
    for flag in (False, True):
        gen = Generator(*tiny, cache="sinks", window=6, sinks=2, prefill_chunk=4, cache_dtype="q4_0",
                        quantized_sinks=flag)
        runs[flag] = [ev.token_id for ev in gen.stream(prompt, max_tokens=6, ignore_eos=True)]
        c = gen.caches[0]
        assert c.spec.sink_dtype == (None if flag else "float16") and (c.sink_k is None) == flag
    assert len(runs[False]) == len(runs[True]) == 6


# -- V rounded for the output projection (storage.quantize_rows_fed, Transformer.value_rounding) -----------

@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_fed_rounding_keeps_the_scales_and_lowers_the_weighted_error(dtype, d):
    """With an identity factor the fed quantizer gives gguf's bytes; with the factor of a random H it keeps
    every block's scale (the same q8_0 / q4_0 layout, read by the same kernels) and lowers eᵀ H e against
    rounding to nearest, over 64 rows, by more than a fifth."""
    from streamattn.kv.storage import quantize_rows_fed, rounding_factor
    rng = np.random.default_rng(d)
    x = rows(rng, 64, d)
    nearest = quantize(x, dtype)[0]
    out = np.empty_like(nearest)
    quantize_rows_fed(x, out, dtype == "q4_0", np.eye(d))
    np.testing.assert_array_equal(out, nearest)
    a = rng.standard_normal((d, d // 4))
    h = a @ a.T + 0.05 * np.eye(d)                      # correlated directions, as an output projection has
    quantize_rows_fed(x, out, dtype == "q4_0", rounding_factor(h))
    bb = 18 if dtype == "q4_0" else 34
    blocks = lambda q: q.reshape(64, -1, bb)  # noqa: E731
    np.testing.assert_array_equal(blocks(out)[..., :2], blocks(nearest)[..., :2])
    err = lambda q: dequantize(q, dtype, d) - x  # noqa: E731
    weighted = lambda e: float(np.einsum("ni,ij,nj->", e, h, e))  # noqa: E731
    assert weighted(err(out)) < 0.8 * weighted(err(nearest))


def test_fed_rounding_leaves_non_finite_rows_marked():
    """A row holding NaN or inf keeps the quantizer's marker (NaN scale) under fed rounding, and the count
    of bad blocks is the same."""
    from streamattn.kv.storage import quantize_rows_fed, rounding_factor
    rng = np.random.default_rng(5)
    x = rows(rng, 4, 64)
    x[1, 3], x[2, 40] = np.nan, np.inf
    nearest = np.empty((4, 36), np.uint8)
    fed = np.empty_like(nearest)
    from streamattn.kv.storage import quantize_rows
    assert quantize_rows(x, nearest, True) == quantize_rows_fed(x, fed, True, rounding_factor(np.eye(64) + 1.0)) == 2
    np.testing.assert_array_equal(fed[1:3], nearest[1:3])
    assert (fed[[0, 3]] != nearest[[0, 3]]).any()


# -- q4_0 key block scales searched for the least error (storage.quantize_rows, search=True) ---------------

def _block_errors(q, x, dtype):
    """Squared error of each block of 32 of the stored rows q against x [n, d], float64 [n, blocks]."""
    d = x.shape[1]
    e = np.zeros((x.shape[0], -(-d // 32) * 32))
    e[:, :d] = (dequantize(q, dtype, d).astype(np.float64) - x) ** 2
    return e.reshape(x.shape[0], -1, 32).sum(axis=2)


@pytest.mark.parametrize("d", [64, 80, 256])
def test_searched_q4_0_scales_never_lose_to_gguf_on_a_block(d):
    """Each q4_0 block's searched scale is one of SCALE_STEPS times gguf's (in float16), its codes are the
    nearest ones under that scale, and its squared error is at most gguf's; on rows whose blocks hold a
    few large values (as keys do) a row's error falls by more than 3% on average. Zero rows keep gguf's
    bytes, q8_0 ignores the search."""
    from streamattn.kv.storage import SCALE_STEPS
    rng = np.random.default_rng(d)
    x = rows(rng, 64, d)
    x[4:] *= np.where(rng.random((60, d)) < 0.05, 6.0, 1.0).astype(np.float32)     # a few channels stand out
    gguf, bad = quantize(x, "q4_0")
    got, bad_s = quantize(x, "q4_0", search=True)
    assert bad == bad_s == 0
    eg, es = _block_errors(gguf, x, "q4_0"), _block_errors(got, x, "q4_0")
    assert (es <= eg * (1 + 1e-6) + 1e-30).all()                      # (the search sums in float32)
    assert np.mean(es[4:].sum(axis=1) / eg[4:].sum(axis=1)) < 0.97    # measured 0.94-0.95 a row
    np.testing.assert_array_equal(got[0], gguf[0])                                 # the zero row
    nb = got.shape[1] // 18
    scale = lambda q: q.reshape(64, nb, 18)[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)  # noqa: E731
    ss = scale(got)
    blocks = np.concatenate([x, np.zeros((64, nb * 32 - d), np.float32)], axis=1).reshape(64, nb, 32)
    signed_max = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=2)[..., None], axis=2)[..., 0]
    allowed = (signed_max / np.float32(-8))[..., None] * SCALE_STEPS               # float32, as the quantizer
    assert (ss[..., None] == allowed.astype(np.float16)).any(axis=-1).all()
    step = np.repeat(ss, 32, axis=1)[4:, :d]                           # rows 4.. have no zero block
    codes = dequantize(got, "q4_0", d)[4:] / step + 8                  # exact: a float16 scale times -8..7
    inv = (1.0 / step).astype(np.float32)                               # the quantizer's float32 arithmetic
    np.testing.assert_array_equal(codes, np.clip(np.floor(x[4:] * inv + np.float32(8.5)), 0, 15))
    np.testing.assert_array_equal(quantize(x, "q8_0", search=True)[0], quantize(x, "q8_0")[0])


def test_searched_scales_leave_non_finite_rows_marked():
    """A row holding NaN or inf keeps the quantizer's marker under the search, with the same bad count."""
    rng = np.random.default_rng(6)
    x = rows(rng, 4, 64)
    x[1, 3], x[2, 40] = np.nan, np.inf
    gguf, bad = quantize(x, "q4_0")
    got, bad_s = quantize(x, "q4_0", search=True)
    assert bad == bad_s == 2
    np.testing.assert_array_equal(got[1, :18], gguf[1, :18])
    np.testing.assert_array_equal(got[2, 18:], gguf[2, 18:])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("rotate_k", [False, True])
def test_model_rounds_q4_0_keys_for_their_queries(tiny, rotate_k):
    """A model stores q4_0 keys with searched block scales (storage.quantize(..., search=True) of the keys
    as the cache holds them: rotated for a rotate_k cache) and codes rounded for each token's own query group
    (storage.recode_for_queries, queries in the same frame); other key storages with gguf's rule."""
    from streamattn.models.transformer import Transformer
    from streamattn.kv.storage import recode_for_queries
    tf, _ = tiny
    c = tf.config
    mk = lambda dt, dv: CacheSpec(batch=1, kv_heads=c.n_kv_heads, head_dim=c.head_dim, dtype=dt, dtype_v=dv,  # noqa: E731
                                  rotate_k=rotate_k)
    assert Transformer.key_search(mk("q4_0", "q8_0")) and Transformer.key_search(mk("q4_0", None))
    assert not Transformer.key_search(mk("q8_0", "q4_0")) and not Transformer.key_search(mk("float16", None))
    spec = mk("q4_0", "q8_0")
    seen = {}
    caches = [KVCache(spec) for _ in range(c.n_layers)]
    tf.forward(np.array([[3, 9, 17, 4, 30, 8, 2, 11]]), caches,          # a hook: the array layers
               attn_hook=lambda i, q, k, v, o: seen.setdefault(i, (np.array(q), np.array(k))))
    from streamattn.kv.rotation import rotate                           # (checked against scipy's elsewhere)
    G = c.n_heads // c.n_kv_heads
    for i, cache in enumerate(caches):
        q, k = (rotate(a, np) if rotate_k else a for a in seen[i])
        searched = quantize(k, "q4_0", search=True)[0]                # [1, Hk, 8, row bytes]
        want = searched.copy()
        for h in range(c.n_kv_heads):
            recode_for_queries(np.ascontiguousarray(k[0, h]), np.ascontiguousarray(q[0, h * G:(h + 1) * G]),
                               want[0, h])
        np.testing.assert_array_equal(cache.k[:, :, :8], want)
        assert (want[..., 0::18] == searched[..., 0::18]).all()        # the scales stay the searched ones
    assert any((cache.k[:, :, :8] != quantize(rotate(seen[i][1], np) if rotate_k else seen[i][1], "q4_0",
                                              search=True)[0]).any() for i, cache in enumerate(caches))


def _gptq_reference(x, qg, d, damping):
    """float64 GPTQ codes (0..15) of one row x [D] for the queries qg [G, D], block scales d [D // 32]: the
    Cholesky form (Frantar et al.): H = qg^T qg + damping * mean diag, U = chol(H^-1) upper, then per
    element nearest code and w[j>i] -= (w_i - code) / U_ii * U_ij."""
    D = x.shape[0]
    H = qg.astype(np.float64).T @ qg.astype(np.float64)
    H += np.eye(D) * damping * np.trace(H) / D
    U = np.linalg.cholesky(np.linalg.inv(H)).T
    w = x.astype(np.float64).copy()
    codes = np.empty(D, np.int64)
    for i in range(D):
        s = d[i // 32]
        codes[i] = 8 if s == 0 else min(15, max(0, int(np.round(w[i] / s)) + 8))
        e = (w[i] - (codes[i] - 8) * s) / U[i, i]
        w[i + 1:] -= e * U[i, i + 1:]
    return codes


@pytest.mark.parametrize("D,G", [(64, 3), (128, 1), (256, 4), (16, 4), (80, 3)])
def test_keys_recoded_for_queries_match_gptq_and_lower_the_score_error(D, G):
    """storage.recode_for_queries (the Woodbury form, O(D^2 G) a row) gives the codes of the textbook GPTQ
    in float64 (Cholesky of H^-1) under the same block scales, keeps the scales, and lowers the queries'
    mean squared score error below rounding to nearest on average (measured ~0.3x on random rows). A
    head_dim with a last block padded with zeros (16, 80) reads that block's scale (it read past the
    scales' array, and the codes of a tiny model's keys changed from run to run) and keeps its padding."""
    from streamattn.kv.storage import QUERY_DAMPING, recode_for_queries
    rng = np.random.default_rng(D + G)
    n = 24
    x = rows(rng, n, D)
    qs = (rng.standard_normal((G, n, D)) * np.where(rng.random(D) < 0.1, 5.0, 1.0)).astype(np.float32)
    nearest = quantize(x, "q4_0", search=True)[0]
    got = nearest.copy()
    recode_for_queries(x, qs, got)
    nb = (D + 31) // 32
    assert (got.reshape(n, nb, 18)[..., :2] == nearest.reshape(n, nb, 18)[..., :2]).all()
    blocks = got.reshape(n, nb, 18)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    codes = np.concatenate([blocks[..., 2:] & 15, blocks[..., 2:] >> 4], axis=2).reshape(n, nb * 32).astype(np.int64)
    assert (codes[:, D:] == 8).all()                               # padding: zeros, as quantized
    codes = codes[:, :D]
    for r in range(n):
        np.testing.assert_array_equal(codes[r], _gptq_reference(x[r], qs[:, r], scales[r], QUERY_DAMPING))
    err = lambda q: ((np.einsum("gnd,nd->gn", qs.astype(np.float64),  # noqa: E731
                                dequantize(q, "q4_0", D).astype(np.float64) - x)) ** 2).mean()
    assert err(got) < 0.7 * err(nearest)


def test_keys_recoded_for_queries_leave_what_they_cannot_weigh():
    """Rows with a non-finite block (the quantizer's marker), rows whose queries are all zero or not finite
    keep their bytes; the others change."""
    from streamattn.kv.storage import recode_for_queries
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    x[1, 3] = np.nan
    qs = rng.standard_normal((3, 5, 64)).astype(np.float32)
    qs[:, 2] = 0.0
    qs[1, 3, 7] = np.inf
    nearest = quantize(x, "q4_0", search=True)[0]
    got = nearest.copy()
    recode_for_queries(x, qs, got)
    np.testing.assert_array_equal(got[1:4], nearest[1:4])
    assert (got[0] != nearest[0]).any() and (got[4] != nearest[4]).any()


@pytest.mark.usefixtures("one_thread")
def test_model_rounds_q4_0_values_for_its_output_projection(tiny):
    """A model's q4_0 V rows are stored as storage.quantize_fed rounds them with the layer's factors, which
    are the upper Cholesky factor of (H + 1% mean diag) ^ -1 with H = W_oᵀ W_o over each kv head's query
    heads; keys, and V of other storages, are rounded to nearest (value_rounding None)."""
    from streamattn.kv.storage import quantize_fed
    tf, _ = tiny
    c = tf.config
    spec = CacheSpec(batch=1, kv_heads=c.n_kv_heads, head_dim=c.head_dim, dtype="q8_0", dtype_v="q4_0")
    assert tf.value_rounding(0, CacheSpec(batch=1, kv_heads=c.n_kv_heads, head_dim=c.head_dim, dtype="q4_0",
                                          dtype_v="q8_0")) is None
    u = tf.value_rounding(1, spec)
    wo = tf.layers[1].wo
    wo = np.asarray(wo.dequantize() if hasattr(wo, "dequantize") else wo, np.float64)
    g, hd = c.n_heads // c.n_kv_heads, c.head_dim
    for h in range(c.n_kv_heads):
        cols = wo[:, h * g * hd:(h + 1) * g * hd]
        hh = sum(cols[:, j * hd:(j + 1) * hd].T @ cols[:, j * hd:(j + 1) * hd] for j in range(g))
        hh = hh + 0.01 * np.mean(np.diag(hh)) * np.eye(hd)
        np.testing.assert_allclose(u[h].T @ u[h] @ hh, np.eye(hd), atol=1e-8)
        assert np.allclose(u[h], np.triu(u[h]))
    assert tf.value_rounding(1, spec) is u                              # made once
    seen = {}
    caches = [KVCache(spec) for _ in range(c.n_layers)]
    tf.forward(np.array([[3, 9, 17, 4, 30, 8, 2, 11]]), caches,          # a hook: the array layers
               attn_hook=lambda i, q, k, v, o: seen.setdefault(i, np.array(v)))
    for i, cache in enumerate(caches):
        want = quantize_fed(seen[i], "q4_0", tf.value_rounding(i, spec))[0]
        np.testing.assert_array_equal(cache.v[:, :, :8], want)
    assert any((cache.v[:, :, :8] != quantize(seen[i], "q4_0")[0]).any() for i, cache in enumerate(caches))
