"""pytest-benchmark suite: decode at L in {1k, 4k, 16k, 64k}, MHA 8/8 and GQA 32/8, head_dim 64 and 128,
float32 and float16, batch 1 (issue 2), for every available implementation (cpu, gpu, numpy, torch).

    python -m pytest benchmarks --benchmark-json=out/bench.json            # ~3 minutes on 2 cores
    python -m pytest benchmarks -k "cpu and L16384" --benchmark-json=out/bench.json

Not part of ``pytest tests`` (pyproject's testpaths). Each case first checks the output against the
float64 oracle (it fails, untimed, if wrong), then times calls rotating through >= 2 caches larger than
the L3 together; ``extra_info`` in the JSON carries the bytes read, GB/s at the median, and the read
ceiling probed right before and after the case, with the ratio. Numba threads: NUMBA_NUM_THREADS.
"""

import itertools

import numpy as np
import pytest

from streamattn.bench import sweep as bench

POINTS = bench.suite("decode", bench.available_impls())


def _id(p):
    return f"{p.impl}-{p.q_heads}x{p.kv_heads}-d{p.head_dim}-{p.dtype}-L{p.L}"


@pytest.fixture(scope="module")
def ceilings():
    """Per device, made on first use: the host read ceiling (1 GiB sum) or a GPU device copy."""
    made = {}

    def get(device):
        if device not in made:
            made[device] = bench.make_ceiling(device, 1 << 30)
        return made[device]
    return get


@pytest.mark.parametrize("point", POINTS, ids=_id)
def test_decode(benchmark, point, ceilings):
    device = "gpu" if point.impl == "gpu" else "cpu"
    ceiling = ceilings(device)
    caches, q = bench.build(point, np.random.default_rng(0), device)
    fn = bench.runner(point, caches, q)
    err = bench.oracle_error(point, fn(0), caches[0], q)
    assert err <= bench.TOL[point.dtype], f"{_id(point)}: oracle error {err:.3g} > {bench.TOL[point.dtype]}"
    one, _ = bench.time_calls(fn, warmup=2, min_reps=3, max_reps=3, min_time=0)
    calls = itertools.count()
    before = ceiling.probe(2)
    benchmark.pedantic(lambda: fn(next(calls)), rounds=int(np.clip(0.3 / one, 10, 300)), warmup_rounds=3,
                       iterations=1)
    after = ceiling.probe(2)
    gbps = point.bytes_read / benchmark.stats.stats.median / 1e9
    benchmark.extra_info.update(bytes_read=point.bytes_read, oracle_error=err, gbps=gbps,
                                ceiling_before=before, ceiling_after=after,
                                pct_ceiling=100 * gbps / max(before, after), caches=len(caches))
