"""Batch invariance of the CPU kernel: a query's output is bit-identical however the call is cut.

The same query at the same position over the same keys must give the same bits whether it is decoded
alone (T = 1), sits anywhere inside a prefill chunk, shares the call with other sequences of other
lengths and chunk sizes, or runs on 1 or 2 threads. Packed weights quantize activations to 8 bits per
matmul, so a last-bit difference in attention can flip a rounding and change greedy text; the server's
prompt cache and continuous batching rely on this (docs/DESIGN.md §7). Head dims that are multiples of
16 (the vector kernels); keys past a page boundary (PAGE = 2048) and around ring wraps.
"""

import numpy as np
import pytest

from streamattn import CacheSpec, KVCache, attend
from streamattn.kv.backends import cpu
from streamattn.runtime.threads import threads

H, HK = 6, 2           # a GQA group of 3 rows per kv head: the 2-row and 1-row kernels both run


def data(n, D, seed):
    """q, k, v of one sequence: [H, n, D], [HK, n, D], [HK, n, D] float32 (scores spread out, so the
    running max changes between pages and the rescaling matters)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0.0, 2.0, n, dtype=np.float32)[None, :, None]
    return (rng.standard_normal((H, n, D)).astype(np.float32),
            (rng.standard_normal((HK, n, D)) + ramp).astype(np.float32),
            rng.standard_normal((HK, n, D)).astype(np.float32))


def run(spec, seqs, cuts, n_threads=1):
    """Feed every sequence through one cache batch, row b in chunks ``cuts[b]`` (ragged calls: a row
    whose chunks ran out idles with count 0); return each row's outputs per position: [H, n, D]."""
    B = spec.batch
    cache = KVCache(spec)
    outs = [np.zeros_like(q) for q, _, _ in seqs]
    done = [0] * B
    step = 0
    with threads(n_threads):
        while any(step < len(c) for c in cuts):
            counts = np.array([cuts[b][step] if step < len(cuts[b]) else 0 for b in range(B)], np.int64)
            T = int(counts.max())
            q = np.zeros((B, H, T, spec.head_dim), np.float32)
            k = np.zeros((B, HK, T, spec.head_dim), np.float32)
            v = np.zeros_like(k)
            for b, (qs, ks, vs) in enumerate(seqs):
                n, a = int(counts[b]), done[b]
                q[b, :, :n], k[b, :, :n], v[b, :, :n] = qs[:, a:a + n], ks[:, a:a + n], vs[:, a:a + n]
            cache.append(k, v, counts=counts)
            o, _ = attend(q, cache, backend="cpu", counts=counts)
            for b in range(B):
                n = int(counts[b])
                outs[b][:, done[b]:done[b] + n] = o[b, :, :n]
                done[b] += n
            step += 1
    return outs


def chunks(n, sizes, seed):
    """Cut n tokens into chunks drawn from ``sizes``."""
    rng = np.random.default_rng(seed)
    out = []
    while sum(out) < n:
        out.append(min(int(rng.choice(sizes)), n - sum(out)))
    return out


CASES = {  # name -> (window, sinks, max_chunk, tokens): past a page boundary, rings wrapped several times
    "causal": (None, 0, 300, cpu.PAGE + 700),
    "window": (700, 0, 300, cpu.PAGE + 900),
    "sinks": (600, 4, 300, cpu.PAGE + 900),
}


@pytest.mark.parametrize("case,dtype", [("causal", "float32"), ("window", "float32"), ("sinks", "float32"),
                                        ("sinks", "float16")])
def test_query_bits_do_not_depend_on_chunking_batch_or_threads(case, dtype):
    window, sinks, C, n = CASES[case]
    D = 64
    seq = data(n, D, seed=len(case))
    spec1 = CacheSpec(batch=1, kv_heads=HK, head_dim=D, dtype=dtype, window=window, sinks=sinks, max_chunk=C)
    alone = run(spec1, [seq], [[1] * n])[0]                        # decoded one token at a time
    chunked = run(spec1, [seq], [chunks(n, [C, 37, 1, 256, 5], seed=1)])[0]
    np.testing.assert_array_equal(chunked, alone)
    # row 1 of a ragged batch: neighbours of other lengths, their own chunk sizes, 2 threads
    others = [data(m, D, seed=m) for m in (n // 3, n + 150)]
    spec3 = CacheSpec(batch=3, kv_heads=HK, head_dim=D, dtype=dtype, window=window, sinks=sinks, max_chunk=C)
    cuts = [chunks(n // 3, [C, 3], seed=2), chunks(n, [1, 64, C], seed=3), chunks(n + 150, [1, 17], seed=4)]
    batched = run(spec3, [others[0], seq, others[1]], cuts, n_threads=2)[1]
    np.testing.assert_array_equal(batched, alone)


def test_head_dim_128_and_group_of_four():
    """Four query rows per kv head take the 4-row kernels (and head_dim 128 their two column groups)."""
    global H
    D, n = 128, cpu.PAGE + 100
    saved, H = H, 8
    try:
        seq = data(n, D, seed=5)
        spec = CacheSpec(batch=1, kv_heads=HK, head_dim=D, window=None, max_chunk=512)
        alone = run(spec, [seq], [[1] * n])[0]
        chunked = run(spec, [seq], [chunks(n, [512, 7, 1], seed=6)], n_threads=2)[0]
        np.testing.assert_array_equal(chunked, alone)
    finally:
        H = saved


@pytest.mark.parametrize("dtype", ["float32", "float16", "q8_0"])
def test_one_kv_head_decoded_on_two_threads_splits_its_rows_with_the_same_bits(dtype):
    """A decode step of one sequence with one kv head is one work item; on two threads its four query
    rows go to two items of two rows (Gemma-3 270M's shape: head_dim 256), the bits those of one thread."""
    global H, HK
    import numba
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread only in this process (NUMBA_NUM_THREADS=1)")
    D, n = 256, 300
    saved, (H, HK) = (H, HK), (4, 1)
    try:
        seq = data(n, D, seed=7)
        spec = CacheSpec(batch=1, kv_heads=HK, head_dim=D, window=None, max_chunk=64, dtype=dtype)
        one = run(spec, [seq], [[1] * n])[0]
        two = run(spec, [seq], [[1] * n], n_threads=2)[0]
        np.testing.assert_array_equal(two, one)
        assert np.abs(one).max() > 0
    finally:
        H, HK = saved
