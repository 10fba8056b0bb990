"""Functional check of kernels/*.cu without a GPU: the CPU emulation harness vs the float64 oracle.

Every kernel variant and storage dtype goes through the oracle (flashinfer #3864 was one variant),
with windows that wrap the ring several times (vLLM #2064), ragged batches, GQA/MQA and chunks.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpu_oracle as go
from gpu_fixtures import runner  # noqa: F401  (fixture)

MODES = {"causal": (0, 0), "window": (5, 0), "sinks": (5, 2)}  # name -> (window n_c, sinks n_s)
DTYPES = ("float32", "float16", "bfloat16")


def check(runner, c, *, splits=None, dtype):
    out, lse = runner.attend(c["q"], c["k"], c["v"], c["lengths"], c["counts"], window=c["window"],
                               sinks=c["sinks"], scale=c["scale"], splits=splits, softcap=c.get("softcap"))
    assert out.dtype == c["q"].dtype and out.shape == c["q"].shape and lse.dtype == np.float32
    assert go.rel_err(out, c["ref_out"]) <= go.TOL[dtype], "out differs from the float64 oracle"
    assert go.lse_err(lse, c["ref_lse"]) <= go.TOL[dtype], "lse differs from the float64 oracle"
    padding = np.arange(c["q"].shape[2])[None, :] >= np.asarray(c["counts"])[:, None]  # [batch, T]
    assert np.all(out[padding.nonzero()[0], :, padding.nonzero()[1]] == 0)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_decode(runner, mode, dtype, head_dim):
    """T == 1, ragged batch (one padding row), GQA 6/2, ring wrapped 5x; split-K with 1 and 3 splits."""
    window, sinks = MODES[mode]
    rng = np.random.default_rng(head_dim + len(mode) + len(dtype))
    c = go.case(rng, batch=4, q_heads=6, kv_heads=2, head_dim=head_dim, lengths=[29, 1, 3, 19],
                counts=[1, 1, 1, 0], T=1, window=window, sinks=sinks, dtype=dtype)
    check(runner, c, splits=1, dtype=dtype)
    assert runner.launches[-1] == f"decode_{dict(float32='f32', float16='f16', bfloat16='bf16')[dtype]}_hd{head_dim}"
    check(runner, c, splits=3, dtype=dtype)
    assert runner.launches[-1] == f"merge_hd{head_dim}"


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_prefill_chunk(runner, mode, dtype, head_dim):
    """T == 4: a first chunk, a wrapped ring, a short chunk with padding rows, a chunk below the sinks."""
    window, sinks = MODES[mode]
    rng = np.random.default_rng(7 * head_dim + len(mode) + len(dtype))
    c = go.case(rng, batch=4, q_heads=4, kv_heads=2, head_dim=head_dim, lengths=[4, 30, 21, 2],
                counts=[4, 4, 2, 2], T=4, window=window, sinks=sinks, dtype=dtype)
    check(runner, c, dtype=dtype)
    assert runner.launches[-1].startswith("prefill_")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_soft_capped_scores(runner, mode, dtype):
    """The _softcap variants (Gemma-2) against the oracle with the cap, decode (1 and 3 splits) and a chunk:
    queries large enough (scores ~ N(0, 8²)) that a cap of 5 changes the answer, by far."""
    window, sinks = MODES[mode]
    for T, lengths, counts in ((1, [29, 1, 3, 19], [1, 1, 1, 0]), (4, [4, 30, 21, 2], [4, 4, 2, 2])):
        shape = dict(batch=4, q_heads=4, kv_heads=2, head_dim=64, lengths=lengths, counts=counts, T=T, window=window,
                     sinks=sinks, dtype=dtype, q_gain=8.0)
        c = go.case(np.random.default_rng(T + len(mode) + len(dtype)), softcap=5.0, **shape)
        plain = go.case(np.random.default_rng(T + len(mode) + len(dtype)), **shape)      # the same draws, no cap
        assert go.rel_err(plain["ref_out"], c["ref_out"]) > 0.05, "the cap changes nothing: the test cannot fail"
        for splits in ((1, 3) if T == 1 else (None,)):
            check(runner, c, splits=splits, dtype=dtype)
            assert runner.launches[-2 if splits == 3 else -1].endswith("_softcap")


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 1), (10, 2), (3, 3)])
@pytest.mark.parametrize("T", (1, 3))
def test_gqa_groups(runner, q_heads, kv_heads, T):
    """MQA, a group larger than one decode block serves (SA_MAX_GROUP = 4), and MHA."""
    rng = np.random.default_rng(q_heads * 10 + T)
    c = go.case(rng, batch=2, q_heads=q_heads, kv_heads=kv_heads, head_dim=64, lengths=[23, 9],
                counts=[T, 1], T=T, window=6, sinks=1, dtype="float16")
    check(runner, c, splits=2, dtype="float16")


def test_float16_queries_and_many_empty_splits(runner):
    """q in float16 gives out in float16; more splits than keys leaves empty splits the merge skips."""
    rng = np.random.default_rng(5)
    c = go.case(rng, batch=3, q_heads=4, kv_heads=1, head_dim=128, lengths=[2, 5, 40], counts=[1, 1, 1],
                T=1, window=0, sinks=0, dtype="bfloat16", q_dtype="float16")
    check(runner, c, splits=7, dtype="float16")


def test_every_padding_row(runner):
    """A batch where no sequence has a real row: zeros and lse = -inf everywhere, no NaN."""
    rng = np.random.default_rng(6)
    for T in (1, 2):
        c = go.case(rng, batch=2, q_heads=2, kv_heads=1, head_dim=64, lengths=[3, 8], counts=[0, 0], T=T,
                    window=4, sinks=1, dtype="float32")
        out, lse = runner.attend(c["q"], c["k"], c["v"], c["lengths"], c["counts"], window=4, sinks=1,
                                   scale=c["scale"], splits=2)
        assert np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("mode", MODES)
def test_streaming_chunks_through_the_ring(runner, mode):
    """Write chunks of 1..C tokens into one ring (C - 1 slack), attend after each, compare every step.

    Three sequences advance by different chunk sizes (ragged counts with padding rows); the ring wraps
    more than three times, so stale slots hold old, finite keys that must stay invisible.
    """
    window, sinks = MODES[mode]
    chunk = 4
    rng = np.random.default_rng(11)
    batch, q_heads, kv_heads, d, total = 3, 4, 2, 64, 48
    k_hist = rng.standard_normal((batch, kv_heads, total, d)).astype(np.float32)
    v_hist = rng.standard_normal((batch, kv_heads, total, d)).astype(np.float32)
    slots = sinks + window + chunk - 1 if window else total
    k = np.zeros((batch, kv_heads, slots, d), np.float32)
    v = np.zeros_like(k)
    lengths = np.zeros(batch, np.int64)
    sizes = [[1, 3, 4, 1], [4, 4, 1, 1], [2, 1, 3, 1]]  # step 3 is all ones: decode
    step = 0
    while lengths.min() <= 27:  # past 3 wraps: sinks + 3 (slots - sinks) <= 26
        counts = np.array([sizes[b][step % 4] for b in range(batch)])
        for b in range(batch):  # write, then attend
            for j in range(lengths[b], lengths[b] + counts[b]):
                s = go.slot_of(j, window=window, sinks=sinks, slots=slots)
                k[b, :, s], v[b, :, s] = k_hist[b, :, j], v_hist[b, :, j]
        lengths += counts
        T = int(counts.max())
        q = rng.standard_normal((batch, q_heads, T, d)).astype(np.float32)
        q_pos = np.full((batch, T), -1)
        for b in range(batch):
            q_pos[b, :counts[b]] = lengths[b] - counts[b] + np.arange(counts[b])
        ref_out, ref_lse = go.attention(q, k_hist, v_hist, q_pos, window=window, sinks=sinks, scale=d ** -0.5)
        out, lse = runner.attend(q, k, v, lengths, counts, window=window, sinks=sinks, scale=d ** -0.5,
                                   splits=2)
        assert go.rel_err(out, ref_out) <= go.TOL["float32"], f"step {step}, lengths {lengths}"
        assert go.lse_err(lse, ref_lse) <= go.TOL["float32"], f"step {step}, lengths {lengths}"
        step += 1
    assert window == 0 or lengths.min() > sinks + 3 * (slots - sinks)  # >= 3 wraps of the ring


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_random_shapes(runner, data):
    """Random modes (window 1.., sinks 0..), sizes, groups, dtypes, chunks and splits against the oracle."""
    draw = data.draw
    batch, kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 5))
    T = draw(st.integers(1, 4))
    window = draw(st.sampled_from([0, 1, 2, 3, 7]))
    sinks = draw(st.integers(0, 3)) if window else 0
    counts = [draw(st.integers(0, T)) for _ in range(batch)]
    lengths = [draw(st.integers(max(c, 1), 41)) for c in counts]
    dtype = draw(st.sampled_from(DTYPES))
    c = go.case(np.random.default_rng(draw(st.integers(0, 2**16))), batch=batch, q_heads=group * kv_heads,
                kv_heads=kv_heads, head_dim=draw(st.sampled_from([64, 128, 256])), lengths=lengths, counts=counts,
                T=T, window=window, sinks=sinks, dtype=dtype)
    check(runner, c, splits=draw(st.integers(1, 4)), dtype=dtype)


@pytest.mark.parametrize("T", (1, 3))
def test_window_one_sees_only_the_current_token(runner, T):
    """window = 1 (n_c counts the current token): out is exactly v at the query's own position."""
    rng = np.random.default_rng(21)
    c = go.case(rng, batch=2, q_heads=2, kv_heads=1, head_dim=64, lengths=[13, 5], counts=[T, T], T=T, window=1,
                sinks=0, dtype="float32")
    out, _ = runner.attend(c["q"], c["k"], c["v"], c["lengths"], c["counts"], window=1, sinks=0, scale=c["scale"],
                           splits=2)
    slots = c["k"].shape[2]
    for b in range(2):
        for t in range(T):
            pos = c["lengths"][b] - T + t
            own = c["v"][b, 0, go.slot_of(pos, window=1, sinks=0, slots=slots)]
            np.testing.assert_allclose(out[b, :, t], np.broadcast_to(own, out[b, :, t].shape), rtol=1e-6, atol=1e-6)


# -- kernels/*.cu over quantized rows: the CPU emulation of the same text, against the oracle ---------------

@pytest.mark.parametrize("dtype", ("q8_0", "q4_0"))
@pytest.mark.parametrize("T,window,sinks", [(1, 0, 0), (1, 5, 2), (3, 5, 2)])
def test_cuda_kernels_emulated(runner, dtype, T, window, sinks):
    """decode (split-K 1 and 3 + merge) and prefill over q8_0 / q4_0 rows, ragged, GQA 6/2, a wrapped ring:
    within float32 tolerance of the oracle over gguf-py's dequantized values."""
    rng = np.random.default_rng(T + window)
    c = go.case(rng, batch=3, q_heads=6, kv_heads=2, head_dim=64, lengths=[29, 3, 19], counts=[T, 1, 0], T=T,
                window=window, sinks=sinks, dtype=dtype)
    for splits in ((1, 3) if T == 1 else (None,)):
        out, lse = runner.attend(c["q"], c["k"], c["v"], c["lengths"], c["counts"], window=window, sinks=sinks,
                                 scale=c["scale"], splits=splits)
        assert runner.launches[-1 if splits in (1, None) else -2] == \
            f"{'decode' if T == 1 else 'prefill'}_{dtype[:2]}_hd64"
        assert go.rel_err(out, c["ref_out"]) <= go.TOL["float32"] and go.lse_err(lse, c["ref_lse"]) <= 1e-4


@pytest.mark.parametrize("dtype,dtype_v", [("float16", "q8_0"), ("float16", "q4_0"), ("q8_0", "float16"),
                                           ("q4_0", "float16"), ("q8_0", "q4_0"), ("q4_0", "q8_0")])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("T,window,sinks", [(1, 0, 0), (1, 5, 2), (3, 5, 2)])
def test_cuda_kernels_emulated_k_and_v_apart(runner, dtype, dtype_v, head_dim, T, window, sinks):
    """K and V of different storage (each GPU thread reads V at K's positions: V's vectors wider than K's,
    float16 K beside q8_0 V, and narrower, the reverse): decode with 1 and 3 splits and a chunk, against the
    oracle over each side's stored values; the launch names both kinds."""
    rng = np.random.default_rng(head_dim + T + window + len(dtype) * 7 + len(dtype_v))
    c = go.case(rng, batch=3, q_heads=6, kv_heads=2, head_dim=head_dim, lengths=[29, 3, 19], counts=[T, 1, 0],
                T=T, window=window, sinks=sinks, dtype=dtype, dtype_v=dtype_v)
    assert c["k"].dtype != c["v"].dtype or c["k"].shape != c["v"].shape
    tag = {"float16": "f16", "q8_0": "q8", "q4_0": "q4"}
    for splits in ((1, 3) if T == 1 else (None,)):
        out, lse = runner.attend(c["q"], c["k"], c["v"], c["lengths"], c["counts"], window=window, sinks=sinks,
                                 scale=c["scale"], splits=splits)
        assert runner.launches[-1 if splits in (1, None) else -2] == \
            f"{'decode' if T == 1 else 'prefill'}_{tag[dtype]}_{tag[dtype_v]}_hd{head_dim}"
        assert go.rel_err(out, c["ref_out"]) <= go.TOL["float32"] and go.lse_err(lse, c["ref_lse"]) <= 1e-4


def test_cuda_plan_refuses_pairs_without_kernels(runner):
    """bfloat16 or float32 beside another kind has no kernel: a TypeError names both sides and the pairs."""
    c = go.case(np.random.default_rng(0), batch=1, q_heads=2, kv_heads=1, head_dim=64, lengths=[5], counts=[1], T=1,
                window=0, sinks=0, dtype="bfloat16", dtype_v="q8_0")
    with pytest.raises(TypeError, match=r"stored as uint16 \(bf16\) and uint8 \(q8\).*f16/q8"):
        runner.attend(c["q"], c["k"], c["v"], c["lengths"], c["counts"], window=0, sinks=0, scale=c["scale"])
