"""kernels/append.cu in the CPU emulation against the CPU cache's own bytes, and a planted bug it must catch.

The kernel writes a step's K and V rows into the ring as stored: float32, float16, bfloat16, and q8_0 / q4_0
blocks of keys rotated by the Hadamard H. Its bytes must equal what the CPU cache (numpy casts, the Numba
quantizer, rotation.rotate_rows) stores for the same stream of appends, ring wraps and sinks included.
"""
from __future__ import annotations

import numpy as np
import pytest

from cuda_emu import emu
from streamattn.kv.backends import gpu_append, gpu_source
from streamattn.kv.cache import KVCache
from streamattn.kv.spec import CacheSpec
from streamattn.kv.storage import bits, quantize, rounding_factor

pytestmark = pytest.mark.skipif(not emu.have_compiler(), reason="g++ (C++20) is needed for the emulation harness")

PAIRS = [("float32", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"), ("q8_0", "q8_0"),
         ("q4_0", "q4_0"), ("q8_0", "float16"), ("float16", "q4_0"), ("q4_0", "q8_0")]
HD = 64
TIE = "if (oa > a || (oa == a && oat < at)) { a = oa; at = oat; }"   # the first of equal magnitudes wins


def _specs(head_dims=(HD,)):
    return [gpu_source.spec_name("append", hd, gpu_append.TAGS[k], v_tag=gpu_append.TAGS[v])
            for hd in head_dims for k, v in PAIRS]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """The append kernels (head_dim 64 for every pair, 128 for one) and a planted variant, in one small build."""
    text = gpu_source.source("append")
    assert text.count(TIE) == 1
    bug = text.replace(TIE, TIE.replace("oat < at", "oat > at"))    # the last of equal magnitudes wins
    names = _specs() + ["append_q4_hd128", "append_q8_q4_hd64"]
    entries = {n: ("append", gpu_source.name_expression(n)) for n in names}
    entries["tie_bug:append_q4_hd64"] = ("append_bug", gpu_source.name_expression("append_q4_hd64"))
    lib = emu.build(tmp_path_factory.mktemp("append_emu"), sources={"append": text, "append_bug": bug},
                    entries=entries)
    return emu.Emulator(lib)


def _rows(rng, shape):
    """float32 rows with what the casts must get right: magnitudes from 2^-30 to 2^11 (float16 subnormals and
    rounding ties), exact zeros, a block of zeros, equal magnitudes of both signs, outlier channels."""
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-30, 12, shape)).astype(np.float32)
    x[..., 3] = 0.0
    x[..., 32:64] = 0.0 if shape[-1] > 64 else x[..., 32:64]
    x[..., 5], x[..., 9] = -7.0, 7.0                              # a tie for the largest |x| of block 0
    x[..., 40] = np.float32(2049.0)                               # float16 rounds it to even (2048)
    x[..., 11], x[..., 12], x[..., 13] = 65519.0, 2.0 ** -25, 3 * 2.0 ** -25   # float16's largest; subnormal ties
    return x


# NaNs of every payload (0x7FFFFFFF: the NaN every CUDA float op produces, whose bfloat16 rounding carry once
# wrapped to -0.0), +-inf, the largest finite float32 values and the largest that bfloat16 keeps finite
SPECIAL = (0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF,
           0x7F7F7FFF)


def _special_rows(rng, shape, pattern, at):
    """:func:`_rows` with the float32 bit pattern ``pattern`` at index ``at``."""
    x = _rows(rng, shape)
    x.view(np.uint32)[at] = pattern
    return x


def _run(emulator, cache, dev, k, v, counts, prefix="", v_fed=None):
    """One append through the kernel on the emulated storage ``dev`` (a dict of arrays); returns the flag."""
    spec = cache.spec
    flag = np.full(1, gpu_append.FLAG_CLEAR, np.int32)
    B, H, T, _ = k.shape
    undo_k = np.empty((B, H, T) + dev["k"].shape[3:], dev["k"].dtype)
    undo_v = np.empty((B, H, T) + dev["v"].shape[3:], dev["v"].dtype)
    old_k, old_v = dev["k"].copy(), dev["v"].copy()
    launch = lambda name, *a: emulator.launch(prefix + name, *a)     # noqa: E731
    windowed = spec.window is not None
    gpu_append.append_with(np, launch, k, v, dev["k"], dev["v"], undo_k, undo_v,
                           dev["lengths"].astype(np.int32), np.asarray(counts, np.int32), flag,
                           kind=spec.dtype, v_kind=spec.v_dtype, sinks=spec.sinks if windowed else 0,
                           ring=cache.ring, rotate_k=spec.rotate_k, code_base=0, sink_k=dev.get("sink_k"),
                           sink_v=dev.get("sink_v"), v_fed=v_fed)
    apart = "sink_k" in dev
    for b in range(B):                       # the undo rows hold the slots' bytes from before the write
        for t in range(int(counts[b])):
            pos = int(dev["lengths"][b]) + t
            if apart and pos < spec.sinks:
                continue                     # a sink row: its undo row holds its quantized bytes
            s = (pos - spec.sinks) % cache.ring if apart else int(cache.slots_of(pos))
            assert np.array_equal(bits(undo_k[b, :, t]), bits(old_k[b, :, s]))
            assert np.array_equal(bits(undo_v[b, :, t]), bits(old_v[b, :, s]))
    dev["lengths"] += np.asarray(counts)
    return int(flag[0])


@pytest.mark.parametrize("kind,v_kind", PAIRS)
@pytest.mark.parametrize("mode", ("causal", "window", "sinks"))
def test_bytes_equal_the_cpu_cache(emulator, kind, v_kind, mode):
    """A ragged stream of chunks (batch 2, T up to 3, padding rows) wrapping a ring several times: after every
    append the emulated storage equals the CPU cache's, byte for byte."""
    window = dict(causal=None, window=5, sinks=5)[mode]
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=HD, dtype=kind, dtype_v=v_kind, window=window,
                     sinks=2 if mode == "sinks" else 0, max_chunk=3, sink_dtype=None,
                     max_len=40 if mode == "causal" else None)
    cache = KVCache(spec)
    if mode == "causal":
        cache.reserve(40)
    dev = {"k": np.zeros_like(cache.k), "v": np.zeros_like(cache.v), "lengths": np.zeros(2, np.int64)}
    rng = np.random.default_rng(len(kind) * 7 + len(v_kind) + len(mode))
    for step in range(9):
        T = 1 + step % 3
        counts = np.array([T, rng.integers(0, T + 1)])
        k, v = _rows(rng, (2, 2, T, HD)), _rows(rng, (2, 2, T, HD))
        cache.append(k, v, counts)
        assert _run(emulator, cache, dev, k, v, counts) == gpu_append.FLAG_CLEAR
        assert np.array_equal(dev["lengths"], cache.lengths)
        assert np.array_equal(bits(dev["k"]), bits(cache.k)), f"K differs after step {step}"
        assert np.array_equal(bits(dev["v"]), bits(cache.v)), f"V differs after step {step}"
    assert mode == "causal" or cache.lengths.max() > cache.slots      # the ring wrapped


@pytest.mark.parametrize("kind,v_kind,sink_dtype", [("q8_0", "q8_0", "auto"), ("q4_0", "q4_0", "float32"),
                                                     ("float16", "q4_0", "auto"), ("q4_0", "q8_0", "auto")])
def test_sinks_apart_equal_the_cpu_cache(emulator, kind, v_kind, sink_dtype):
    """A quantized cache that keeps its sinks apart (float16 or float32 sink store): rows below n_s go there,
    keys rotated as the ring's, the rest to ring slot (j - n_s) mod R; both stores equal the CPU's."""
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=HD, dtype=kind, dtype_v=v_kind, window=4, sinks=3, max_chunk=3,
                     sink_dtype=sink_dtype)
    cache = KVCache(spec)
    assert cache.sink_k is not None
    dev = {n: np.zeros_like(getattr(cache, n)) for n in ("k", "v", "sink_k", "sink_v")}
    dev["lengths"] = np.zeros(2, np.int64)
    rng = np.random.default_rng(len(kind) + len(sink_dtype))
    for step in range(8):
        T = 1 + (step + 1) % 3
        counts = np.array([T, rng.integers(0, T + 1)])
        k, v = _rows(rng, (2, 2, T, HD)), _rows(rng, (2, 2, T, HD))
        cache.append(k, v, counts)
        assert _run(emulator, cache, dev, k, v, counts) == gpu_append.FLAG_CLEAR
        for n in ("k", "v", "sink_k", "sink_v"):
            assert np.array_equal(bits(dev[n]), bits(getattr(cache, n))), f"{n} differs after step {step}"
    assert cache.lengths.max() > cache.slots


@pytest.mark.parametrize("kind,head_dim", [("q4_0", 64), ("q8_0", 64), ("q4_0", 128)])
def test_fed_q4_values_equal_the_cpu_cache(emulator, kind, head_dim):
    """A q4_0 V rounded through U (storage.quantize_rows_fed, the model's V rounding): the kernel's sequential
    pass over each row gives the CPU's bytes; and its codes differ from gguf's rounding to nearest, so the
    check can fail."""
    rng = np.random.default_rng(head_dim)
    spec = CacheSpec(batch=2, kv_heads=2, head_dim=head_dim, dtype=kind, dtype_v="q4_0", window=4, max_chunk=2)
    a = rng.standard_normal((2, head_dim, head_dim))
    U = np.stack([rounding_factor(m @ m.T) for m in a])                  # [kv_heads, D, D]
    cache, plain = KVCache(spec), KVCache(spec)
    dev = {"k": np.zeros_like(cache.k), "v": np.zeros_like(cache.v), "lengths": np.zeros(2, np.int64)}
    for step in range(5):
        k, v = (rng.standard_normal((2, 2, 2, head_dim)).astype(np.float32) for _ in range(2))
        counts = np.array([2, step % 3])
        cache.append_trusted(k, v, counts, v_rounding=U)
        plain.append(k, v, counts)
        _run(emulator, cache, dev, k, v, counts, v_fed=U)
        assert np.array_equal(dev["k"], cache.k) and np.array_equal(dev["v"], cache.v), f"step {step}"
    assert not np.array_equal(cache.v, plain.v)


def test_head_dim_128_quantized_rotated(emulator):
    """q4_0 at head_dim 128: four rotated blocks per row, equal to the CPU's bytes."""
    spec = CacheSpec(batch=1, kv_heads=3, head_dim=128, dtype="q4_0", window=4, max_chunk=2)
    cache = KVCache(spec)
    dev = {"k": np.zeros_like(cache.k), "v": np.zeros_like(cache.v), "lengths": np.zeros(1, np.int64)}
    rng = np.random.default_rng(5)
    for _ in range(7):
        k, v = _rows(rng, (1, 3, 2, 128)), _rows(rng, (1, 3, 2, 128))
        cache.append(k, v)
        _run(emulator, cache, dev, k, v, np.array([2]))
    assert np.array_equal(dev["k"], cache.k) and np.array_equal(dev["v"], cache.v)


@pytest.mark.parametrize("kind", ("float16", "q8_0", "q4_0"))
def test_non_finite_rows_raise_the_flag(emulator, kind):
    """NaN in sequence 1's V and an overflow in sequence 0's K: the flag names K of sequence 0 (the CPU
    check reports K first); NaN in V alone names V of its sequence (batch + b); a quantized row gets the
    CPU quantizer's NaN marker (scale 0x7E00) or its inf scale."""
    spec = CacheSpec(batch=2, kv_heads=1, head_dim=HD, dtype=kind, window=4)
    cache = KVCache(spec)
    rng = np.random.default_rng(1)
    k, v = _rows(rng, (2, 1, 1, HD)), _rows(rng, (2, 1, 1, HD))
    v[1, 0, 0, 7] = np.nan
    dev = {"k": np.zeros_like(cache.k), "v": np.zeros_like(cache.v), "lengths": np.zeros(2, np.int64)}
    assert _run(emulator, cache, dev, k, v, [1, 1]) == 2 + 1
    k[0, 0, 0, 2] = 7e4 if kind == "float16" else 1e30       # past float16 as a value or as a scale
    dev["lengths"][:] = 0
    assert _run(emulator, cache, dev, k, v, [1, 1]) == 0
    if kind in ("q8_0", "q4_0"):
        from streamattn.kv.rotation import rotate
        assert np.array_equal(dev["k"][:, 0, 0], quantize(rotate(k[:, 0, 0]), kind)[0])
        assert np.array_equal(dev["v"][:, 0, 0], quantize(v[:, 0, 0], kind)[0])
        assert dev["v"][1, 0, 0, 1] == 0x7E and dev["v"][1, 0, 0, 0] == 0


@pytest.mark.parametrize("kind", ("float32", "bfloat16"))
def test_special_values_stored_and_flagged_as_the_cpu(emulator, kind):
    """Each of SPECIAL in sequence 1's K, then in sequence 0's V: the kernel stores the CPU cache's bytes (a
    NaN stays NaN) and raises the flag (K: b, V: batch + b) exactly when the CPU cache refuses the chunk."""
    rng = np.random.default_rng(11)
    fired = set()
    for pattern in SPECIAL:
        for which, at, flagged in (("k", (1, 0, 0, 20), 1), ("v", (0, 0, 0, 33), 2 + 0)):
            spec = CacheSpec(batch=2, kv_heads=1, head_dim=HD, dtype=kind, window=4)
            stored = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=HD, dtype=kind, window=4, check_finite=False))
            k = _special_rows(rng, (2, 1, 1, HD), pattern, at) if which == "k" else _rows(rng, (2, 1, 1, HD))
            v = _special_rows(rng, (2, 1, 1, HD), pattern, at) if which == "v" else _rows(rng, (2, 1, 1, HD))
            try:
                KVCache(spec).append(k, v)
                refused = False
            except ValueError:
                refused = True
            stored.append(k, v)
            dev = {"k": np.zeros_like(stored.k), "v": np.zeros_like(stored.v), "lengths": np.zeros(2, np.int64)}
            flag = _run(emulator, stored, dev, k, v, [1, 1])
            assert flag == (flagged if refused else gpu_append.FLAG_CLEAR), (hex(pattern), which, flag)
            assert np.array_equal(bits(dev["k"]), bits(stored.k)), (hex(pattern), which)
            assert np.array_equal(bits(dev["v"]), bits(stored.v)), (hex(pattern), which)
            fired.add((pattern, refused))
    nans = {p for p in SPECIAL if (p & 0x7FFFFFFF) > 0x7F800000}
    assert all(refused for p, refused in fired if p in nans or (p & 0x7FFFFFFF) == 0x7F800000)
    assert (0x7F7F7FFF, False) in fired                        # the largest finite that stays finite passes


def test_planted_tie_bug_is_caught(emulator):
    """The kernel with the last (not the first) of equal magnitudes as a q4_0 block's signed max: its bytes
    differ from the CPU's on a row with a tie, while the real kernel's match (the check can fail)."""
    spec = CacheSpec(batch=1, kv_heads=1, head_dim=HD, dtype="q4_0", window=4, rotate_k=False)
    x = np.zeros((1, 1, 1, HD), np.float32)
    x[..., 0], x[..., 1], x[..., 2] = -3.0, 3.0, 1.0                # signed max -3 (first), not +3
    outs = []
    for prefix in ("", "tie_bug:"):
        cache = KVCache(spec)
        dev = {"k": np.zeros_like(cache.k), "v": np.zeros_like(cache.v), "lengths": np.zeros(1, np.int64)}
        cache.append(x, x)
        _run(emulator, cache, dev, x, x, [1], prefix=prefix)
        outs.append(np.array_equal(dev["k"], cache.k))
    assert outs == [True, False]


def _good_args(B=2, H=2, T=3, slots=8):
    """append_with's arguments for q8_0 K, float16 V, head_dim 64, as numpy arrays (nothing launches)."""
    k, v = (np.zeros((B, H, T, HD), np.float32) for _ in range(2))
    k_store, v_store = np.zeros((B, H, slots, 68), np.uint8), np.zeros((B, H, slots, HD), np.float16)
    undo_k, undo_v = np.zeros((B, H, T, 68), np.uint8), np.zeros((B, H, T, HD), np.float16)
    lengths, counts, flag = np.zeros(B, np.int32), np.full(B, T, np.int32), np.zeros(1, np.int32)
    return dict(k=k, v=v, k_store=k_store, v_store=v_store, undo_k=undo_k, undo_v=undo_v, lengths=lengths,
                counts=counts, flag=flag)


@pytest.mark.parametrize("name,bad,expected", [
    ("v", np.zeros((2, 2, 2, HD), np.float32), "v must have k's shape (2, 2, 3, 64) (got (2, 2, 2, 64))"),
    ("k_store", np.zeros((2, 2, 8, 64), np.uint8), "k_store must be [2, 2, slots, 68] for q8_0 rows"),
    ("v_store", np.zeros((2, 2, 8, 128), np.float16), "v_store must be [2, 2, slots, 64] for float16 rows"),
    ("k_store", np.zeros((1, 2, 8, 68), np.uint8), "(got (1, 2, 8, 68))"),
    ("lengths", np.zeros(2, np.int64), "lengths must be int32 [2] (got int64 (2,))"),
    ("counts", np.zeros(3, np.int32), "counts must be int32 [2] (got int32 (3,))"),
    ("flag", np.zeros((1, 1), np.int32), "flag must be int32 [1] (got int32 (1, 1))"),
])
def test_bad_arguments_are_refused_before_any_launch(name, bad, expected):
    """Each argument of the wrong shape or dtype raises ValueError naming it, what was expected and what
    was given, and nothing launches; the good arguments launch once."""
    launched = []
    args = _good_args()
    gpu_append.append_with(np, lambda *a: launched.append(a), **args, kind="q8_0", v_kind="float16", sinks=0,
                           ring=8, rotate_k=False, code_base=0)
    assert len(launched) == 1
    args[name] = bad
    with pytest.raises(ValueError) as error:
        gpu_append.append_with(np, lambda *a: launched.append(a), **args, kind="q8_0", v_kind="float16", sinks=0,
                               ring=8, rotate_k=False, code_base=0)
    assert expected in str(error.value) and len(launched) == 1
