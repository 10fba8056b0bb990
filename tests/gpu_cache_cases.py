"""The GPU cache against the CPU cache: through the fake CuPy (tests/test_gpu_cache.py runs this file with
tests/fake_cupy first on the path) and on a device (tests/test_gpu_device.py imports the cases).

Device appends (kernels/append.cu) against the CPU cache over a stream of appends, a non-finite step rolled
back with the CPU path's error, and the host syncs and uploads of a decode step counted by the fake CuPy.
"""
from __future__ import annotations

import cupy
import numpy as np
import pytest

from streamattn.kv.cache import KVCache
from streamattn.kv.device_step import DeviceStep
from streamattn.kv.dispatch import append_attend
from streamattn.kv.spec import CacheSpec
from streamattn.runtime.arrays import to_host

FAKE = cupy.__version__.endswith("fake")   # tests/fake_cupy: it counts syncs and uploads

MODES = {"causal": dict(window=None), "window": dict(window=5), "sinks": dict(window=5, sinks=2, sink_dtype=None),
         "sinks_apart": dict(window=5, sinks=2, sink_dtype="auto")}   # float16 sinks beside a quantized ring
# every kind and mode (test_gpu_append: all pairs)
CASES = [("float16", None, "causal"), ("q8_0", None, "window"), ("q4_0", None, "sinks"),
         ("q8_0", "float16", "window"), ("float32", None, "sinks"), ("q8_0", None, "sinks_apart")]


def _spec(kind, v_kind, mode, batch=2):
    return CacheSpec(batch=batch, kv_heads=2, head_dim=64, dtype=kind, dtype_v=v_kind, max_chunk=3, **MODES[mode])


def _state(cache):
    return {n: np.array(a) for n, a in cache.export_state().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("kind,v_kind,mode", CASES)
def test_stream_equals_the_cpu_cache(kind, v_kind, mode):
    """Ragged chunks (T 1..3, padding rows) wrapping the ring, a causal cache growing: after every
    append_attend the GPU cache's state (bytes and counters) is the CPU cache's, its device counters hold
    the host's, and its attention answers as the CPU backend does."""
    spec = _spec(kind, v_kind, mode)
    gpu_cache, cpu_cache = KVCache(spec, device="gpu"), KVCache(spec)
    rng = np.random.default_rng(len(kind) + len(mode))
    for step in range(8):
        T = 1 + step % 3
        counts = np.array([T, rng.integers(1, T + 1)])
        q, k, v = (rng.standard_normal((2, h, T, 64)).astype(np.float32) for h in (4, 2, 2))
        ref, _ = append_attend(q, k, v, cpu_cache, backend="cpu", scale=0.125, counts=counts)
        out, _ = append_attend(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), gpu_cache, backend="gpu",
                               scale=0.125, counts=counts)
        assert _same(_state(gpu_cache), _state(cpu_cache)), f"state differs after step {step}"
        assert np.array_equal(to_host(gpu_cache.counters.lengths), cpu_cache.lengths)
        assert (gpu_cache.sink_k is None) == (mode != "sinks_apart")
        real = np.arange(T)[None, :] < counts[:, None]                               # [batch, T]
        err = np.abs(to_host(out) - ref).max(axis=(1, 3))[real]
        assert err.max() < 1e-4, f"attention differs after step {step}: {err.max()}"
    assert mode == "causal" or cpu_cache.lengths.max() > cpu_cache.slots          # the ring wrapped


@pytest.mark.parametrize("kind", ("float16", "q4_0"))
def test_non_finite_step_is_rolled_back(kind):
    """Three layers' caches in one DeviceStep, a NaN in layer 1's V of sequence 1 (and an overflow in layer 2's
    K) after the ring wrapped: the step raises the CPU path's ValueError for layer 1's V, sequence 1, and
    every cache is bit for bit as before the step; the next steps go on equal to a CPU cache fed the same."""
    spec = _spec(kind, None, "window")
    gpu, cpu = [KVCache(spec, device="gpu") for _ in range(3)], [KVCache(spec) for _ in range(3)]
    rng = np.random.default_rng(2)

    def chunk():
        return [rng.standard_normal((2, 2, 1, 64)).astype(np.float32) for _ in range(2)]
    for _ in range(9):
        rows = [chunk() for _ in range(3)]
        with DeviceStep(gpu):
            for g, c, (k, v) in zip(gpu, cpu, rows):
                g.append(cupy.asarray(k), cupy.asarray(v))
                c.append(k, v)
    before = [_state(g) for g in gpu]
    rows = [chunk() for _ in range(3)]
    rows[1][1][1, 0, 0, 5] = np.nan
    rows[2][0][0, 1, 0, 3] = 1e30
    with pytest.raises(ValueError) as cpu_error:       # the CPU path refuses layer 1's chunk
        KVCache(spec).append(*rows[1])
    with pytest.raises(ValueError) as gpu_error:
        with DeviceStep(gpu):
            for g, (k, v) in zip(gpu, rows):
                g.append(cupy.asarray(k), cupy.asarray(v))
    assert str(gpu_error.value) == str(cpu_error.value)
    assert "v holds NaN or inf for sequence 1" in str(gpu_error.value)
    assert all(_same(_state(g), b) for g, b in zip(gpu, before)), "a rolled-back step changed a cache"
    for _ in range(3):
        rows = [chunk() for _ in range(3)]
        with DeviceStep(gpu):
            for g, c, (k, v) in zip(gpu, cpu, rows):
                g.append(cupy.asarray(k), cupy.asarray(v))
                c.append(k, v)
    assert all(_same(_state(g), _state(c)) for g, c in zip(gpu, cpu))


def test_non_finite_sink_row_is_rolled_back():
    """Sinks apart: a chunk whose first row (a sink, position 1) overflows the float16 sink store though its
    q8_0 row is finite, its second row (a ring row) fine: refused with the CPU's error (naming the sink store's
    dtype), the sink store zero again and the counters as before; then the same positions append equal to
    the CPU cache."""
    spec = _spec("q8_0", None, "sinks_apart", batch=1)
    g, c = KVCache(spec, device="gpu"), KVCache(spec)
    rng = np.random.default_rng(6)
    k, v = (rng.standard_normal((1, 2, 1, 64)).astype(np.float32) for _ in range(2))
    g.append(cupy.asarray(k), cupy.asarray(v))
    c.append(k, v)
    before = _state(g)
    k, v = (rng.standard_normal((1, 2, 2, 64)).astype(np.float32) for _ in range(2))
    bad = v.copy()
    bad[0, 1, 0, 9] = 7e4                                   # past float16, not past q8_0's scale
    with pytest.raises(ValueError) as cpu_error:
        c.append(k, bad)
    with pytest.raises(ValueError) as gpu_error:
        g.append(cupy.asarray(k), cupy.asarray(bad))
    assert str(gpu_error.value) == str(cpu_error.value) and "stored in float16" in str(gpu_error.value)
    assert _same(_state(g), before) and _same(before, _state(c))
    g.append(cupy.asarray(k), cupy.asarray(v))
    c.append(k, v)
    assert _same(_state(g), _state(c))


def test_append_outside_a_step_checks_at_once():
    """A lone append is its own step: a non-finite chunk raises at once, as on the CPU, and the wrapped ring's
    overwritten slot gets its old bytes back."""
    spec = _spec("q8_0", None, "window", batch=1)
    g, c = KVCache(spec, device="gpu"), KVCache(spec)
    rng = np.random.default_rng(4)
    for _ in range(9):
        k, v = (rng.standard_normal((1, 2, 2, 64)).astype(np.float32) for _ in range(2))
        g.append(cupy.asarray(k), cupy.asarray(v))
        c.append(k, v)
    before = _state(g)
    k[0, 0, 1, 0] = np.inf
    with pytest.raises(ValueError, match="k holds NaN or inf for sequence 0; the cache is unchanged"):
        g.append(cupy.asarray(k), cupy.asarray(v))
    assert _same(_state(g), before) and _same(before, _state(c))


def test_exception_inside_a_step_rolls_back():
    """An exception raised inside a DeviceStep after two layers' appends (an out-of-memory growth, an
    interrupt): the step rolls both back, newest first, and every cache is bit for bit as before the step."""
    spec = _spec("q8_0", None, "window")
    gpu = [KVCache(spec, device="gpu") for _ in range(3)]
    rng = np.random.default_rng(8)
    draw = lambda: cupy.asarray(rng.standard_normal((2, 2, 1, 64)).astype(np.float32))   # noqa: E731
    for _ in range(7):                                      # the ring wrapped: the undo bytes matter
        with DeviceStep(gpu):
            for g in gpu:
                g.append(draw(), draw())
    before = [_state(g) for g in gpu]
    with pytest.raises(KeyboardInterrupt):
        with DeviceStep(gpu):
            gpu[0].append(draw(), draw())
            gpu[1].append(draw(), draw())
            raise KeyboardInterrupt
    assert all(_same(_state(g), b) for g, b in zip(gpu, before)), "a step that raised changed a cache"


def test_a_failed_launch_leaves_no_step_entry(monkeypatch):
    """A lone append whose launch raises keeps no entry in its step (its undo rows were never written), so a
    later non-finite lone append restores only what it wrote; a flag code no append owns is a RuntimeError."""
    from streamattn.kv.backends import gpu_append
    spec = _spec("q8_0", None, "window", batch=1)
    g = KVCache(spec, device="gpu")
    rng = np.random.default_rng(9)
    for _ in range(6):
        k, v = (rng.standard_normal((1, 2, 1, 64)).astype(np.float32) for _ in range(2))
        g.append(cupy.asarray(k), cupy.asarray(v))
    before = _state(g)
    launch = gpu_append.append_with

    def fail(*a, **kw):
        raise MemoryError("planted")
    monkeypatch.setattr(gpu_append, "append_with", fail)
    with pytest.raises(MemoryError):
        g.append(cupy.asarray(k), cupy.asarray(v))
    assert g._lone.entries == [] and _same(_state(g), before)
    monkeypatch.setattr(gpu_append, "append_with", launch)
    k[0, 1, 0, 2] = np.nan
    with pytest.raises(ValueError, match="k holds NaN or inf for sequence 0"):
        g.append(cupy.asarray(k), cupy.asarray(v))
    assert _same(_state(g), before)
    step = DeviceStep(xp=cupy)
    step.record(g, np.array([1]), *g._undo[1])
    step.flag[...] = 99
    with pytest.raises(RuntimeError, match="code 99"):
        step.finish()


def test_counters_past_int32_are_refused():
    """Host lengths + counts reaching 2**31 raise ValueError naming the position, device counters unchanged."""
    from streamattn.kv.device_step import DeviceCounters
    counters = DeviceCounters(cupy, 2)
    counters.match(np.array([5, 7]), np.array([1, 1]))
    with pytest.raises(ValueError, match="positions up to 2147483648"):
        counters.match(np.array([2 ** 31 - 1, 3]), np.array([1, 0]))
    assert np.array_equal(to_host(counters.lengths), [5, 7]) and np.array_equal(counters.mirror, [[5, 7], [1, 1]])


def _decode_counts(layers, steps, device_append=True, spec=None, warm=1):
    """(syncs, uploads) of ``steps`` decode steps over ``layers`` caches of ``spec`` (default q8_0, window 8),
    after ``warm`` warm-up steps; with ``device_append`` False, the host path the cache took before the append
    kernel."""
    spec = spec or CacheSpec(batch=2, kv_heads=2, head_dim=64, dtype="q8_0", window=8)
    caches = [KVCache(spec, device="gpu") for _ in range(layers)]
    if not device_append:
        for c in caches:
            c._device_append = lambda *a: False
    draw = lambda h: cupy.random.standard_normal((2, h, 1, 64))            # noqa: E731  (on the device)
    for step in range(steps + warm):
        if step == warm:
            cupy.counts.update(sync=0, upload=0)
        with DeviceStep(caches):
            for c in caches:
                append_attend(draw(4), draw(2), draw(2), c, backend="gpu", scale=0.125)
    return cupy.counts["sync"], cupy.counts["upload"]


@pytest.mark.skipif(not FAKE, reason="the counts are the fake CuPy's (tests/test_gpu_cache.py runs it)")
def test_one_sync_a_step_and_no_uploads():
    """Three decode steps over four layers: one host sync a step (the finite flag) and nothing uploaded
    (lengths, counts and the mask of real rows live on the device); the host path before it synced at
    least twice a layer (the finite checks of K and V) and uploaded every layer."""
    assert _decode_counts(4, 3) == (3, 0)
    syncs, uploads = _decode_counts(4, 3, device_append=False)
    assert syncs >= 2 * 4 * 3 and uploads >= 4 * 3


@pytest.mark.skipif(not FAKE, reason="the counts are the fake CuPy's (tests/test_gpu_cache.py runs it)")
def test_sinks_apart_decode_uploads_nothing():
    """Float16 sinks kept apart beside a q8_0 ring: once every new row is past the sinks, the two parts read
    the cache's device counters and every row is real (no mask): one sync a step, nothing uploaded. Before
    that (rows landing among the sinks) the parts' lengths are the host's."""
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=64, dtype="q8_0", window=8, sinks=2, sink_dtype="auto")
    assert _decode_counts(2, 3, spec=spec, warm=3) == (3, 0)
    syncs, uploads = _decode_counts(2, 2, spec=spec, warm=0)          # the sink rows' steps: uploads
    assert syncs == 2 and uploads > 0


@pytest.mark.skipif(not FAKE, reason="the counts are the fake CuPy's (tests/test_gpu_cache.py runs it)")
def test_model_decode_step_syncs_once(tmp_path):
    """A 4-layer model's decode steps on q8_0 GPU caches (Transformer.forward): one host sync a step, the
    finite flag read at the step's end, whatever the layer count."""
    import sys
    sys.path.insert(0, "tests")
    from _model_util import write_tiny_gguf
    from streamattn.gguf.loader import load_gguf
    from streamattn.models.transformer import Transformer
    path = write_tiny_gguf(tmp_path / "t.gguf", arch="llama", n_layers=4, d_model=32, n_heads=2, n_kv_heads=1,
                           head_dim=64, d_ff=32, vocab=40, window=4)
    model = Transformer(load_gguf(path)).to(cupy)
    caches = model.new_caches(batch=1, max_chunk=1, dtype="q8_0")
    allocs = []
    for step in range(6):
        if step == 1:
            cupy.counts.update(sync=0, upload=0)
        if step == 5:
            model.device_step = None     # a fresh DeviceStep, as each step made before: its flag allocated again
        before = cupy.counts["alloc"]
        model.forward(np.array([[step + 1]]), caches, backend="gpu", last_only=True)
        allocs.append(cupy.counts["alloc"] - before)
        if step == 4:
            assert cupy.counts["sync"] == 4
    first = model.device_step
    model.forward(np.array([[7]]), model.new_caches(batch=1, max_chunk=1, dtype="q8_0"), backend="gpu")
    assert model.device_step is first                # other caches, the same step object and flag
    # the model's DeviceStep allocates its flag at the first step only: later steps allocate the same (the
    # layers' temporaries), and the step after it was dropped one more (the flag again)
    assert allocs[2] == allocs[3] == allocs[4] and allocs[5] == allocs[4] + 1, allocs
    with cupy.cuda.Device(1):                         # caches on a second GPU: a step (and flag) of their own
        other = model.new_caches(batch=1, max_chunk=1, dtype="q8_0")
    model.forward(np.array([[7]]), other, backend="gpu")
    assert model.device_step is not first and model.device_step.flag.device.id == 1
    assert first.flag.device.id == 0


@pytest.mark.skipif(not FAKE, reason="the fake CuPy's counters (tests/test_gpu_cache.py runs it)")
def test_model_counts_of_the_wrong_shape_get_the_named_error(tmp_path):
    """A GPU forward whose counts are not [B] in 0..T raises the named counts error before the device
    counters are touched, the caches as before; the next good step runs."""
    import sys
    sys.path.insert(0, "tests")
    from _model_util import write_tiny_gguf
    from streamattn.gguf.loader import load_gguf
    from streamattn.models.transformer import Transformer
    path = write_tiny_gguf(tmp_path / "t.gguf", arch="llama", n_layers=2, d_model=32, n_heads=2, n_kv_heads=1,
                           head_dim=64, d_ff=32, vocab=40)
    model = Transformer(load_gguf(path)).to(cupy)
    caches = model.new_caches(batch=2, max_chunk=1, dtype="q8_0")
    model.forward(np.array([[1], [2]]), caches, backend="gpu")
    held = [_state(c) for c in caches]
    for counts in (np.array([1, 1, 1]), np.array([1, 2]), np.array([-1, 1])):
        with pytest.raises(ValueError, match="counts must"):
            model.forward(np.array([[3], [4]]), caches, counts=counts, backend="gpu")
        assert all(_same(_state(c), h) for c, h in zip(caches, held))
    model.forward(np.array([[3], [4]]), caches, backend="gpu")
    assert [int(c.lengths[0]) for c in caches] == [2, 2]


def test_a_device_step_is_one_step_at_a_time():
    """A DeviceStep entered while open, or pointed at other caches with appends held, raises and changes
    nothing; after its step it serves the next."""
    spec = CacheSpec(batch=1, kv_heads=2, head_dim=64, dtype="q8_0", window=8)
    caches = [KVCache(spec, device="gpu") for _ in range(2)]
    step = DeviceStep(caches)
    with step:
        with pytest.raises(RuntimeError, match="while its step is open"):
            step.__enter__()
        caches[0].append(cupy.random.standard_normal((1, 2, 1, 64)), cupy.random.standard_normal((1, 2, 1, 64)))
        with pytest.raises(RuntimeError, match="is open"):
            step.over(caches[1:])
        assert step.caches == caches and caches[1].step is step
    assert step.over(caches[1:]) is step and not step.entries and caches[0].step is None
    with step:
        caches[1].append(cupy.random.standard_normal((1, 2, 1, 64)), cupy.full((1, 2, 1, 64), np.nan, np.float32))
        with pytest.raises(ValueError, match="holds NaN or inf"):
            step.finish()
    assert [int(c.lengths[0]) for c in caches] == [1, 0]
    step.record(caches[0], np.array([1]), None, None)       # appends held by a closed step (no finish yet)
    with pytest.raises(RuntimeError, match="holds 1 unfinished appends: call finish"):
        step.over(caches)
    step.finish()
    assert step.over(caches) is step
    with pytest.raises(ValueError, match="caches on array module cupy, this step's flag on numpy"):
        DeviceStep(xp=np).over(caches)
