"""The compiled decoder layer (streamattn.models.compiled) against the same layer as array code.

Both run streamattn.models.layer.decoder_layer on the same packed weights; the compiled one must give the
same bits (logits and caches) in every cache geometry and storage, hand back to the array layer whatever
only that one does (grow a ring, refuse a chunk) with the same results and errors, and stage K/V to
16 bits exactly as numpy does.
"""

import gc
import itertools

import numba
import numpy as np
import pytest

from _model_util import load, need_smollm2, smollm2_path, write_tiny_gguf
from streamattn import CacheSpec, KVCache
from streamattn.models import compiled
from streamattn.quant import matmul as qmatmul
from streamattn.gguf.loader import load_gguf
from streamattn.models.transformer import Transformer
from streamattn.kv.storage import to_storage

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not qmatmul.HAVE_KERNELS, reason="the packed kernels need AVX2")]

QUANT = {n: "Q4_1" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")} | {"ffn_down": "Q8_0"}


def tiny(tmp_path, arch, **kw):
    kw = {"d_model": 64, "seed": 0} | kw
    return Transformer(load_gguf(write_tiny_gguf(tmp_path / f"{arch}{kw['d_model']}-{kw['seed']}.gguf", arch=arch,
                                                 d_ff=96, n_heads=4, n_kv_heads=2, head_dim=32, quant=QUANT, **kw)))


class Spy:
    """Counts the compiled layer's calls that finished (not handed back to the array layer)."""

    def __init__(self, monkeypatch):
        self.done, real = 0, compiled.run_layer

        def call(*a):
            done = real(*a)
            self.done += done
            return done
        monkeypatch.setattr(compiled, "run_layer", call)


#: The compiled layer keeps the sinks inside the ring, so these tests ask for quantized caches without the
#: float16 sinks that are the default (docs/DESIGN.md §6; such a cache runs the array layer:
#: test_default_quantized_caches), and for unrotated keys unless a test says otherwise.
PLAIN = dict(rotate_k=False, sink_dtype=None)


def run(tf, compile_layers, prompt, steps, *, batch=1, **cache_kw):
    """Logits of a prompt chunk then greedy steps, and the caches after, both ways."""
    tf.compile_layers = compile_layers
    caches = tf.new_caches(batch=batch, max_chunk=len(prompt[0]), **{**PLAIN, **cache_kw})
    out = [tf.forward(np.array(prompt), caches)]
    for _ in range(steps):
        out.append(tf.forward(out[-1][:, -1:].argmax(-1), caches))
    return out, caches


def clone(cache):
    c = KVCache(cache.spec)
    for name in ("k", "v", "lengths", "last_counts", "held_from"):
        setattr(c, name, getattr(cache, name).copy())
    return c


def assert_same(a, b):
    (la, ca), (lb, cb) = a, b
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(ca, cb):
        for name in ("k", "v", "lengths", "last_counts", "held_from"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))


def test_a_layer_call_releases_the_gil():
    """run_layer runs without the GIL: the server's event loop (another thread) streams tokens while the
    engine thread is inside a step. Holding it made one client's tokens arrive in bursts (inter-token p50
    0.7 ms, p99 42-60 ms at ~110 tok/s; docs/PERF.md)."""
    assert compiled.run_layer.targetoptions.get("nogil") is True


@pytest.mark.parametrize("arch,dtype,mode", [("llama", "float32", "full"), ("llama", "float16", "window"),
                                             ("llama", "bfloat16", "sinks"), ("gemma3", "float16", "full"),
                                             ("gemma3", "float32", "sinks")])
def test_compiled_layers_give_the_array_layers_bits(tmp_path, monkeypatch, arch, dtype, mode):
    tf = tiny(tmp_path, arch)
    kw = dict(dtype=dtype, mode=mode, window=None if mode == "full" else 5, sinks=2 if mode == "sinks" else 0)
    prompt = [[5, 9, 3, 17, 4, 8], [1, 2, 3, 4, 5, 6]]
    spy = Spy(monkeypatch)
    want = run(tf, False, prompt, 9, batch=2, **kw)
    assert spy.done == 0
    got = run(tf, True, prompt, 9, batch=2, **kw)
    assert spy.done == 10 * tf.config.n_layers                    # every layer of every call compiled
    assert_same(got, want)


@pytest.mark.parametrize("rotate_k", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("arch,dtype,dtype_v,mode", [("llama", "q8_0", None, "full"), ("llama", "q4_0", None, "window"),
                                                     ("gemma3", "q8_0", None, "sinks"), ("gemma3", "q4_0", None, "full"),
                                                     ("llama", "q8_0", "q4_0", "sinks"),
                                                     ("gemma3", "float16", "q8_0", "window"),
                                                     ("llama", "q4_0", "float32", "full"),
                                                     ("llama", "bfloat16", "float16", "full")])
def test_quantized_and_mixed_caches_run_compiled_with_the_array_layers_bits(tmp_path, monkeypatch, arch, dtype,
                                                                              dtype_v, mode, rotate_k):
    """q8_0 / q4_0 rows (quantized once, as written) and K/V of different storage, keys stored as they
    come or rotated (``k @ H``, queries ``q @ H``): the compiled layer stages the same bytes and attends
    over them with the same kernels, every layer of every call."""
    tf = tiny(tmp_path, arch)
    kw = dict(dtype=dtype, dtype_v=dtype_v, mode=mode, window=None if mode == "full" else 5,
              sinks=2 if mode == "sinks" else 0, rotate_k=rotate_k)
    prompt = [[5, 9, 3, 17, 4, 8], [1, 2, 3, 4, 5, 6]]
    spy = Spy(monkeypatch)
    want = run(tf, False, prompt, 9, batch=2, **kw)
    assert spy.done == 0
    got = run(tf, True, prompt, 9, batch=2, **kw)
    assert got[1][0].spec.rotate_k == rotate_k
    assert spy.done == 10 * tf.config.n_layers
    assert_same(got, want)


def test_another_cache_storage_compiles_only_its_attend_op(tmp_path, monkeypatch):
    """The layer is compiled once whatever its cache stores: a storage, window, sinks or rotation not run
    before adds no specialization of run_layer (whose code holds the matmuls, norms and RoPE), and what
    Numba compiles for it starts at that storage's copy of the attend op (its kernels below it)."""
    from numba.core import event
    layer_fn = compiled.run_layer
    tf = tiny(tmp_path, "llama")
    prompt = [[5, 9, 3, 17]]
    run(tf, True, prompt, 1, dtype="float32")
    layers = list(layer_fn.signatures)
    copies = set(compiled.ATTENDS.values())
    started, depth = [], [0]                         # dispatchers whose compile began outside any other

    class Starts(event.Listener):
        def on_start(self, ev):
            if depth[0] == 0:
                started.append(ev.data["dispatcher"])
            depth[0] += 1

        def on_end(self, ev):
            depth[0] -= 1
    spy = Spy(monkeypatch)
    cases = [dict(dtype="float16"), dict(dtype="q8_0", rotate_k=True), dict(dtype="q4_0", dtype_v="float16"),
             dict(dtype="bfloat16", mode="sinks", window=5, sinks=2)]
    with event.install_listener("numba:compile", Starts()):
        for kw in cases:
            run(tf, True, prompt, 1, **kw)
    assert spy.done == 2 * len(cases) * tf.config.n_layers          # every layer ran compiled
    assert layer_fn.signatures == layers
    assert set(started) <= copies, f"compiled for a new storage: {[d.py_func.__qualname__ for d in started]}"
    assert all(compiled.ATTENDS[pair].signatures for pair in [("16", "16"), ("q", "q"), ("q", "16")])


def test_an_attend_op_bound_for_another_storage_is_never_called(tmp_path, monkeypatch):
    """A Kv whose attend copy was bound for other storages (or argument types) than its own: the layer
    checks the code first and hands it back to be bound again, never calling through the wrong address,
    and every layer still runs compiled with the array layers' bits."""
    tf = tiny(tmp_path, "llama")
    prompt = [[5, 9, 3, 17]]
    want = run(tf, False, prompt, 2, dtype="float16")
    tf.compile_layers = True
    other = tf.new_caches(max_chunk=4, **PLAIN)                    # float32: its copy bound
    tf.forward(np.array(prompt), other)
    fast = tf._compiled
    wrong = fast.kv(other[0])
    caches = tf.new_caches(max_chunk=4, dtype="float16", **PLAIN)
    for i, c in enumerate(caches):
        fast.kv(c, tf.value_rounding(i, c.spec))
        fast.caches[id(c)][2] = fast.caches[id(c)][2]._replace(attend=wrong.attend, code=wrong.code)
    spy = Spy(monkeypatch)
    out = [tf.forward(np.array(prompt), caches)]
    for _ in range(2):
        out.append(tf.forward(out[-1][:, -1:].argmax(-1), caches))
    assert spy.done == 3 * tf.config.n_layers
    bound = [fast.kv(c, tf.value_rounding(i, c.spec)) for i, c in enumerate(caches)]
    assert all(kv.attend and kv.attend != wrong.attend and kv.code != wrong.code for kv in bound)
    assert_same((out, caches), want)


@pytest.mark.parametrize("dtype,mode", [("q4_0", "full"), ("q8_0", "window"), ("q8_0", "sinks")])
def test_default_quantized_caches(tmp_path, monkeypatch, dtype, mode):
    """The defaults for a quantized K: keys rotated, and a sinks cache keeps its sinks in float16 (its k/v
    holding only the ring). Rotated keys run compiled; float16 sinks (attended in two parts) hand every
    layer back. The logits and caches are those of the array layer either way."""
    tf = tiny(tmp_path, "llama")
    kw = dict(dtype=dtype, mode=mode, window=None if mode == "full" else 5, sinks=2 if mode == "sinks" else 0,
              rotate_k=None, sink_dtype="auto")
    spy = Spy(monkeypatch)
    want = run(tf, False, [[5, 9, 3, 17, 4, 8]], 4, **kw)
    got = run(tf, True, [[5, 9, 3, 17, 4, 8]], 4, **kw)
    c = got[1][0]
    assert c.spec.rotate_k and (c.sink_k is not None) == (mode == "sinks")
    assert spy.done == (0 if mode == "sinks" else 5 * tf.config.n_layers)
    assert_same(got, want)


def run_ragged(tf, compile_layers, chunks, *, batch, **cache_kw):
    """Logits of each sequence's real tokens over ragged chunks (tokens [B, T], counts [B]), and the caches
    after (padding positions have no defined logits)."""
    tf.compile_layers = compile_layers
    caches = tf.new_caches(batch=batch, max_chunk=max(len(t[0]) for t, _ in chunks), **{**PLAIN, **cache_kw})
    out = []
    for tokens, counts in chunks:
        logits = tf.forward(np.array(tokens), caches, counts=np.array(counts))
        out += [logits[b, :n] for b, n in enumerate(counts)]
    return out, caches


RAGGED = [([[5, 9, 3, 17, 4, 8], [1, 2, 3, 0, 0, 0], [0] * 6], [6, 3, 0]),    # a prompt beside a shorter one
          ([[7, 0, 0], [11, 12, 13], [4, 5, 6]], [1, 3, 3]),                   # decoding beside prompts
          ([[2], [3], [0]], [1, 1, 0]),                                        # an idle slot
          ([[6, 0], [8, 9], [10, 0]], [1, 2, 1])]                              # a draft being verified


@pytest.mark.parametrize("arch,dtype,mode", [("llama", "float32", "full"), ("llama", "float16", "window"),
                                             ("gemma3", "bfloat16", "sinks"), ("llama", "q8_0", "sinks"),
                                             ("gemma3", "q4_0", "full")])
def test_ragged_steps_run_compiled_with_the_array_layers_bits(tmp_path, monkeypatch, arch, dtype, mode):
    """A step whose rows are partly padding (a server's prompt chunk beside decoding sequences) runs every
    layer compiled, and each real token gets the array layers' bits; so do the caches."""
    tf = tiny(tmp_path, arch)
    kw = dict(dtype=dtype, mode=mode, window=None if mode == "full" else 5, sinks=2 if mode == "sinks" else 0)
    spy = Spy(monkeypatch)
    want = run_ragged(tf, False, RAGGED, batch=3, **kw)
    assert spy.done == 0
    got = run_ragged(tf, True, RAGGED, batch=3, **kw)
    assert spy.done == len(RAGGED) * tf.config.n_layers
    assert_same(got, want)


def test_ragged_steps_leave_the_padding_rows_alone(tmp_path):
    """Only real rows go through a ragged step's matmuls: a padding row's residual stays its embedding
    (the layers add 0 to it), so its logits are the head's on that embedding alone."""
    from streamattn.models.array_ops import embed_rows, norm_linear
    tf = tiny(tmp_path, "llama")
    tokens, counts = RAGGED[0]
    logits = tf.forward(np.array(tokens), tf.new_caches(batch=3, max_chunk=6), counts=np.array(counts))
    pad = norm_linear(np, embed_rows(np, tf.embed, np.array([0])), tf.output_norm, tf.config.norm_eps, tf.output,
                      tf.matmuls)[0]                                     # [vocab]: token 0's embedding alone
    for b, t in ((1, 3), (1, 5), (2, 0), (2, 5)):
        np.testing.assert_array_equal(logits[b, t], pad)
    assert not np.array_equal(logits[1, 0], norm_linear(np, embed_rows(np, tf.embed, np.array([1])), tf.output_norm,
                                                         tf.config.norm_eps, tf.output, tf.matmuls)[0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_two_threads_give_the_same_bits(tmp_path, monkeypatch, dtype):
    """A 40-token prompt: its heads, staging and attention rows go through the parallel builds."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread only in this process (NUMBA_NUM_THREADS=1)")
    from streamattn.runtime.threads import many_threads
    tf = tiny(tmp_path, "gemma3")
    prompt = [list(range(3, 43)), list(range(20, 60))]
    want = run(tf, False, prompt, 4, batch=2, dtype=dtype)
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    spy = Spy(monkeypatch)
    try:
        assert many_threads()
        assert_same(run(tf, True, prompt, 4, batch=2, dtype=dtype), want)
    finally:
        numba.set_num_threads(before)
    assert spy.done == 5 * tf.config.n_layers


def test_post_norms_wider_than_a_pairwise_block(tmp_path, monkeypatch):
    """Gemma's post norms over 160 columns: numpy sums the squares as two pairwise halves (> 128 values),
    and the compiled rms_norm must walk the same tree."""
    tf = tiny(tmp_path, "gemma3", d_model=160)
    spy = Spy(monkeypatch)
    want = run(tf, False, [[5, 9, 3, 17]], 3, dtype="float16")
    assert_same(run(tf, True, [[5, 9, 3, 17]], 3, dtype="float16"), want)
    assert spy.done == 4 * tf.config.n_layers


def test_replaced_weights_are_bound_again(tmp_path, monkeypatch):
    tf, other = tiny(tmp_path, "llama"), tiny(tmp_path, "llama", seed=1)
    run(tf, True, [[5, 9, 3]], 1)                                   # binds tf's weights
    tf.layers[2].wo, tf.layers[3].attn_norm = other.layers[2].wo, other.layers[3].attn_norm
    tf.layers[4].wgu.qs = other.layers[4].wgu.qs                     # a plane of a packed weight
    spy = Spy(monkeypatch)
    want = run(tf, False, [[5, 9, 3]], 2)
    assert_same(run(tf, True, [[5, 9, 3]], 2), want)
    assert spy.done == 3 * tf.config.n_layers


def test_a_ring_that_must_grow_grows_as_the_array_layer_grows_it(tmp_path, monkeypatch):
    tf = tiny(tmp_path, "llama")
    prompt = [list(np.arange(250) % 60 + 3)]                      # 250 + 10 tokens: past the first 256 slots
    spy = Spy(monkeypatch)
    want = run(tf, False, prompt, 10)
    got = run(tf, True, prompt, 10)
    assert got[1][0].slots == want[1][0].slots == 512
    assert spy.done == 11 * tf.config.n_layers                    # the growing step too, once grown here
    assert_same(got, want)


@pytest.mark.parametrize("case,dtype,dtype_v", [("max_len", "float16", None), ("not finite", "float16", None),
                                               ("not finite", "q8_0", None), ("not finite", "float16", "q4_0"),
                                               ("max_len", "q4_0", None)])
def test_refusals_raise_the_array_layers_error_and_leave_the_same_state(tmp_path, case, dtype, dtype_v):
    """max_len: refused at the first layer, nothing written. Not finite: layer 1's norm weight is 1e30
    (its k overflows float16, and a q8_0 block's scale), so layer 0 appends and layer 1 refuses its chunk,
    on both paths alike."""
    tf = tiny(tmp_path, "llama")
    if case == "not finite":
        tf.layers[1].attn_norm = np.full_like(tf.layers[1].attn_norm, 1e30)    # k past float16: inf as stored
    errors, after = [], []
    for compile_layers in (False, True):
        tf.compile_layers = compile_layers
        caches = tf.new_caches(max_chunk=4, max_len=5, dtype=dtype, dtype_v=dtype_v, **PLAIN)
        if case == "max_len":
            tf.forward(np.array([[3, 4, 5, 6]]), caches)
        before = [clone(c) for c in caches]
        with pytest.raises(ValueError) as e:
            tf.forward(np.array([[7, 8]]), caches)
        errors.append(str(e.value))
        after.append(caches)
        if case == "max_len":
            assert_same(([], caches), ([], before))
    assert_same(([], after[0]), ([], after[1]))
    assert errors[0] == errors[1] and ("max_len" if case == "max_len" else "NaN") in errors[0]
    if case == "not finite":
        assert after[1][0].lengths[0] == 2 and after[1][1].lengths[0] == 0


def test_handing_back_frees_what_the_layer_made(tmp_path):
    """A layer that hands back (a ring to grow, a chunk refused as not finite) frees every array it made."""
    from numba.core.runtime import _nrt_python as nrt, rtsys
    tf = tiny(tmp_path, "llama")
    nrt.memsys_enable_stats()
    try:
        caches = tf.new_caches(max_chunk=300)
        tf.forward(np.ones((1, 250), np.int64), caches)             # warm
        gc.collect()
        before = rtsys.get_allocation_stats()
        tf.layers[0].wo = tf.layers[0].wo.dequantize()              # layer 0 stays array code: 260 > 256 slots
        tf.forward(np.ones((1, 10), np.int64), caches)              # makes layer 1 the first to hand back
        tf.layers[1].attn_norm = np.full_like(tf.layers[1].attn_norm, 1e30)
        with pytest.raises(ValueError, match="NaN or inf"):
            tf.forward(np.ones((1, 3), np.int64), tf.new_caches(max_chunk=4, dtype="float16"))
        after = rtsys.get_allocation_stats()
    finally:
        nrt.memsys_disable_stats()
    made, freed = after.alloc - before.alloc, after.free - before.free
    assert made > 0 and freed >= made       # (older arrays that die meanwhile add frees, never allocations)


def test_a_ring_grown_for_a_refused_chunk_is_put_back(tmp_path):
    """The compiled layer grows a causal ring before it knows the chunk is finite; when the chunk is
    refused the ring goes back to its old arrays, as the array layer (which checks first) leaves it."""
    tf = tiny(tmp_path, "llama")
    tf.layers[1].attn_norm = np.full_like(tf.layers[1].attn_norm, 1e30)    # layer 1's k past float16
    tf.layers[0].wo = tf.layers[0].wo.dequantize()                          # layer 0: array code, grows
    states = []
    for compile_layers in (False, True):
        tf.compile_layers = compile_layers
        caches = tf.new_caches(max_chunk=16, dtype="float16")
        for c in caches:
            c.append(np.zeros((1, 2, 250, 32)), np.zeros((1, 2, 250, 32)))  # 250 of 256 slots, finite
        with pytest.raises(ValueError, match="NaN or inf"):
            tf.forward(np.ones((1, 10), np.int64), caches)
        states.append(caches)
    assert [c.slots for c in states[1]] == [c.slots for c in states[0]] == [512] + [256] * 5
    assert_same(([], states[1]), ([], states[0]))


@pytest.mark.parametrize("window,sinks,max_chunk", [(None, 0, 1), (4, 0, 3), (4, 2, 3), (3, 1, 1)])
def test_refuses_exactly_where_the_cache_would(window, sinks, max_chunk):
    """compiled._refuses against the cache itself: growth (causal), max_len, max_chunk, and what a ring
    can answer after the write (window, after a rewind lowered its length)."""
    rng = np.random.default_rng(0)
    cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=4, dtype="float16", window=window, sinks=sinks,
                              max_chunk=max_chunk, max_len=40 if window is None else None))
    seen = set()
    for _ in range(36):
        cache.append(np.ones((2, 1, 1, 4)), np.ones((2, 1, 1, 4)), counts=rng.integers(0, 2, 2))
        if window and rng.random() < 0.3 and cache.lengths.min() > 1:
            cache.truncate(0, 1)
        for T in (1, 2, 3, 5, 40):
            for counts in (np.array([T, T]), rng.integers(0, T + 1, 2)):     # every row real; ragged
                trial = clone(cache)
                try:
                    trial.append_trusted(np.ones((2, 1, T, 4)), np.ones((2, 1, T, 4)), counts)
                    grew = trial.slots != cache.slots
                    refused = grew or bool((counts > trial.answerable()).any())
                except ValueError:
                    refused = True
                assert compiled._refuses(compiled.bind_cache(cache), counts) == refused, \
                    (counts, cache.lengths, cache.held_from)
                seen.add(refused)
    assert seen == {True, False}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_staging_is_numpys(dtype):
    rng = np.random.default_rng(1)
    special = np.array([0x7F800001, 0x7FC00000, 0xFF800001, 0x7F802000, 0x7FFFFFFF, 0x7F800000, 0xFF800000, 0,
                        0x80000000, 0x33000000, 0x33000001, 0x387FC000, 0x477FF000, 0x477FEFFF, 0x7F7FFFFF,
                        0x00000001, 0x3F808000, 0x3F818000, 0xFFFF8001], np.uint32).view(np.float32)
    x = np.concatenate([special, (rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 9, 20000)).astype(np.float32),
                        rng.integers(0, 2**32, 20000, dtype=np.uint32).view(np.float32)])
    x = x[:2 * 3000 * 6].reshape(2, 1, 3000, 6)
    with np.errstate(over="ignore", invalid="ignore"):
        want = to_storage(x, dtype, np).view(np.uint16)
    for stage in (compiled.stored_16, compiled.stored_16_parallel):
        got = stage(np.ascontiguousarray(x), 1 if dtype == "float16" else 2)
        nan = np.isnan(x)             # float16: numpy's scalar remainder keeps a NaN's payload unquieted
        if dtype == "float16":
            assert np.isnan(got.view(np.float16)[nan]).all()
            got, ok = got[~nan], want[~nan]
        else:
            ok = want
        np.testing.assert_array_equal(got, ok)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_quantized_staging_is_the_caches(dtype):
    """stored_quantized gives the bytes storage.to_storage gives on every real row (ragged counts, a head_dim
    that is no multiple of 32, a NaN and an overflow among them; rounded to nearest, with V's rounding
    factors, or with K's searched scales), and first_not_finite finds the sequence
    whose real rows hold a block that quantized_bad_rows calls bad, skipping padding rows."""
    from streamattn.kv.storage import first_not_finite, quantized_bad_rows, rounding_factor
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 2, 5, 80)) * 10.0 ** rng.integers(-3, 4, (3, 2, 5, 1))).astype(np.float32)
    x[0, 1, 2, 7], x[0, 0, 3, 40] = 0.5, -0.5                         # a tie of the largest magnitudes
    x[2, 1, 4, 70] = np.nan                                             # padding of sequence 2 (counts 3)
    counts = np.array([5, 0, 3], np.int64)
    want = to_storage(x, dtype, np)
    width = want.shape[-1]
    got = compiled.stored_quantized(x, width, dtype == "q4_0", counts, compiled._NO_ROUNDING, False)
    for b, n in enumerate(counts):
        np.testing.assert_array_equal(got[b, :, :n], want[b, :, :n])
    a = rng.standard_normal((2, 80, 80))                                # V's rounding factors, one per head
    factors = np.stack([rounding_factor(m @ m.T) for m in a])
    fed = to_storage(x, dtype, np, rounding=factors)
    assert (fed[0] != want[0]).any()                                    # another rounding, the same layout
    got = compiled.stored_quantized(x, width, dtype == "q4_0", counts, factors, False)
    for b, n in enumerate(counts):
        np.testing.assert_array_equal(got[b, :, :n], fed[b, :, :n])
    searched = to_storage(x, dtype, np, search=True)
    assert (searched[0] != want[0]).any() == (dtype == "q4_0")          # q8_0 keeps gguf's scales
    got = compiled.stored_quantized(x, width, dtype == "q4_0", counts, compiled._NO_ROUNDING, True)
    for b, n in enumerate(counts):
        np.testing.assert_array_equal(got[b, :, :n], searched[b, :, :n])
    kind = 3 if dtype == "q8_0" else 4
    assert first_not_finite(got, counts, kind, 0) == -1
    x[1, 0, 0, 3] = 1e30 if dtype == "q8_0" else np.inf                 # sequence 1: real only with counts 1
    x[2, 1, 1, 79] = np.nan
    got = compiled.stored_quantized(x, width, dtype == "q4_0", np.array([5, 1, 3]), compiled._NO_ROUNDING, False)
    assert first_not_finite(got, np.array([5, 0, 3]), kind, 0) == 2
    assert first_not_finite(got, np.array([5, 1, 3]), kind, 0) == 1
    assert quantized_bad_rows(got[1, 0, :1], dtype).all() and quantized_bad_rows(got[2, 1, 1:2], dtype).all()


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_quantized_staging_over_threads_gives_the_serial_bytes(dtype):
    """A prompt chunk's K/V rows are quantized in pieces of STAGE_ROWS, serially or over the threads: every
    real row the bytes the cache's own staging gives the whole chunk (ragged counts across a piece
    boundary; rounded to nearest, with V's rounding factors, and q4_0 keys with searched scales recoded
    for their queries), with 1 and 2 threads."""
    from streamattn.kv.cache import _recode_keys
    from streamattn.kv.storage import rounding_factor
    rng = np.random.default_rng(3)
    B, H, T, D, G = 2, 3, 2 * compiled.STAGE_ROWS + 5, 64, 3
    x = rng.standard_normal((B, H, T, D)).astype(np.float32)
    q = rng.standard_normal((B, H * G, T, D)).astype(np.float32)
    counts = np.array([T, compiled.STAGE_ROWS + 3], np.int64)
    a = rng.standard_normal((H, D, D))
    factors = np.stack([rounding_factor(m @ m.T) for m in a])
    width = to_storage(x[:1, :1, :1], dtype, np).shape[-1]
    q4 = dtype == "q4_0"
    before = numba.get_num_threads()
    try:
        for rounding, search, queries in ((compiled._NO_ROUNDING, False, None), (factors, False, None),
                                          (compiled._NO_ROUNDING, True, q)):
            want = to_storage(x, dtype, np, rounding=rounding if rounding.shape[0] else None, search=search)
            if queries is not None and q4:
                want = _recode_keys(x, want, queries, np)
            runs = [compiled.stored_quantized(x, width, q4, counts, rounding, search, queries)]
            for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
                numba.set_num_threads(n)
                runs.append(compiled.stored_quantized_parallel(x, width, q4, counts, rounding, search, queries))
            for got in runs:
                for b, c in enumerate(counts):
                    np.testing.assert_array_equal(got[b, :, :c], want[b, :, :c])
    finally:
        numba.set_num_threads(before)


def test_tags_name_every_driver_spec():
    specs = list(itertools.product(compiled._KINDS, (32, 16), (16, 8), (1, 2, 4, 8), (False, True), (False, True)))
    types_ = {numba.typeof(compiled._tag(*s)) for s in specs}
    assert len(types_) == len(specs)
    for s in specs:
        kind, group, lanes, R, vnni, amx = s
        assert compiled._untag(numba.typeof(compiled._tag(*s))) == (kind, group, R, lanes, vnni, amx)


@need_smollm2
def test_smollm2_compiled_layers_give_the_array_layers_bits():
    _, tf, tok = load(smollm2_path(), "quant")
    ids = [tok.encode("The history of Rome begins")]
    try:
        want = run(tf, False, ids, 4, dtype="float16")
        assert_same(run(tf, True, ids, 4, dtype="float16"), want)
    finally:
        tf.compile_layers = True


WAVE_CASES = [("llama", "float16", "full"), ("llama", "q8_0", "window"), ("gemma3", "float16", "sinks"),
              ("gemma3", "q4_0", "full"), ("llama", "bfloat16", "window")]


def wavefront_on(monkeypatch, lanes):
    """The thread count the wavefront reads set to ``lanes`` (its blocks are Python threads, so any count
    runs on any host; Numba itself stays on one thread); returns the list each wavefront call appends
    its block count to."""
    from streamattn.models import transformer
    calls, real = [], Transformer._wavefront

    def spy(self, *a):
        calls.append(a[-1])
        return real(self, *a)
    monkeypatch.setattr(transformer, "thread_count", lambda: lanes)
    monkeypatch.setattr(transformer, "WAVEFRONT_MAX_LANES", max(lanes, 2))
    monkeypatch.setattr(Transformer, "_wavefront", spy)
    return calls


def wave_run(tf, monkeypatch, lanes, prompt, steps, **cache_kw):
    """``run`` under :func:`wavefront_on`; returns the result and how many blocks each wavefront had."""
    calls = wavefront_on(monkeypatch, lanes)
    try:
        return run(tf, True, prompt, steps, **cache_kw), calls
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("lanes", [2, 3])
@pytest.mark.parametrize("arch,dtype,mode", WAVE_CASES)
def test_a_wavefront_chunk_gives_the_one_call_bits(tmp_path, monkeypatch, arch, dtype, mode, lanes):
    """A 100-token prompt in row blocks on 2 or 3 threads (block k entering a layer after block k - 1
    left it): the logits and every cache's bytes, lengths and bookkeeping equal one call's, then decode
    steps (one row: no wavefront) continue from the same state."""
    tf = tiny(tmp_path, arch)
    kw = dict(dtype=dtype, mode=mode, window=None if mode == "full" else 37, sinks=3 if mode == "sinks" else 0)
    prompt = [list(np.arange(100) * 7 % 60 + 3)]
    for steps in (0, 3):                                          # the caches right after the chunk, and later
        want = run(tf, True, prompt, steps, **kw)
        got, calls = wave_run(tf, monkeypatch, lanes, prompt, steps, **kw)
        assert calls == [lanes]
        assert_same(got, want)


def test_a_layer_handed_back_inside_a_wavefront_runs_as_array_code(tmp_path, monkeypatch):
    """Layer 2 handed back to the array layer in every block: each block runs it as array code on its
    own rows, with the one-call bits."""
    tf = tiny(tmp_path, "llama")
    real = compiled.CompiledLayers.run
    monkeypatch.setattr(compiled.CompiledLayers, "run", lambda self, i, *a: i != 2 and real(self, i, *a))
    prompt = [list(np.arange(80) % 50 + 3)]
    want = run(tf, True, prompt, 2, dtype="float16")
    got, calls = wave_run(tf, monkeypatch, 2, prompt, 2, dtype="float16")
    assert calls == [2]
    assert_same(got, want)


def test_a_refused_chunk_starts_no_wavefront_and_a_small_ring_grows_first(tmp_path, monkeypatch):
    """max_len: refused before anything is written (state unchanged, the one-call error), no block run;
    a causal ring too small for the chunk grows first, to what one call grows it to, and the chunk then
    runs in blocks with the one-call bits (a 705-token prompt in chunks of 256 grows at chunks 2 and 3)."""
    tf = tiny(tmp_path, "llama")
    tf.compile_layers = True
    caches = tf.new_caches(max_chunk=80, max_len=100, dtype="float16", **PLAIN)
    tf.forward(np.arange(30)[None] + 3, caches)
    before = [clone(c) for c in caches]
    calls = wavefront_on(monkeypatch, 2)
    with pytest.raises(ValueError, match="max_len"):
        tf.forward(np.arange(80)[None] % 50 + 3, caches)
    assert_same(([], caches), ([], before))
    assert calls == []
    monkeypatch.undo()
    prompt = [list(np.arange(300) % 50 + 3)]                       # 300 tokens: past the first 256 slots
    want = run(tf, True, prompt, 1)
    got, calls = wave_run(tf, monkeypatch, 2, prompt, 1)
    assert calls == [2] and got[1][0].slots == want[1][0].slots == 512
    assert_same(got, want)


def test_an_error_in_a_later_block_reaches_the_caller_after_every_block_stopped(tmp_path, monkeypatch):
    import threading
    tf = tiny(tmp_path, "llama")
    real = compiled.CompiledLayers.run

    def run_or_fail(self, i, *a):
        if i == 3 and threading.current_thread().name == "streamattn-lane-1":
            raise RuntimeError("block 1 failed")
        return real(self, i, *a)
    calls = wavefront_on(monkeypatch, 2)
    monkeypatch.setattr(compiled.CompiledLayers, "run", run_or_fail)
    tf.compile_layers = True
    with pytest.raises(RuntimeError, match="block 1 failed"):
        tf.forward(np.arange(70)[None] % 50 + 3, tf.new_caches(max_chunk=70, dtype="float16", **PLAIN))
    assert calls == [2]
    assert not [t for t in threading.enumerate() if t.name.startswith("streamattn-lane")]
    assert numba.get_num_threads() == 1
