"""The benchmark and the stream run end to end on tiny sizes (they are measured by hand, not here)."""

import json

import numba
import numpy as np
import pytest

from _model_util import load, need_smollm2, single_thread, smollm2_path  # noqa: F401 (fixture)
from streamattn.bench import peers, report as benchreport, stream, sweep as bench
from streamattn.bench.sweep import Point


@pytest.fixture
def one_thread():
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


def test_every_impl_mode_and_phase_passes_its_oracle_check(one_thread):
    base = dict(L=96, q_heads=4, kv_heads=2, head_dim=16)
    points = [Point(impl=i, mode=m, dtype=dt, **base) for i in ("cpu", "numpy")
              for m, dt in (("causal", "float32"), ("window", "float16"), ("sinks", "bfloat16"))]
    points += [Point(impl=i, phase="prefill", T=5, mode="sinks", **base) for i in ("cpu", "numpy")]
    points += [Point(impl=i, phase="recompute", T=96, **base) for i in ("cpu", "numpy")]
    rows = bench.run(points, ceiling_bytes=8 << 20, rotate_bytes=1 << 20, min_reps=2, max_reps=2, min_time=0,
                     warmup=1)
    assert [r["status"] for r in rows] == ["ok"] * len(points), [r["oracle_error"] for r in rows]
    assert all(r["gbps"] > 0 and r["ceiling_gbps"] > 0 for r in rows)
    text = benchreport.table(rows)
    assert text.count("full recompute vs cached decode") == 2     # cpu and numpy, beside causal decode
    json.dumps(rows)


def test_bytes_read_counts_each_visible_key_once():
    assert Point(L=1024, kv_heads=8, head_dim=64).bytes_read == 2 * 1024 * 8 * 64 * 4
    assert Point(L=1024, mode="window", T=16, phase="prefill", dtype="float16").bytes_read == \
        2 * (1024 + 15) * 8 * 64 * 2
    spec = Point(L=100, mode="sinks", T=3).spec()
    assert (spec.sinks, spec.window, spec.slots) == (4, 96, 102)


def test_visibility_matches_the_window_rule():
    # ring of sinks 1 + window 3 (+ chunk slack 1): after 9 tokens it holds positions 0, 5, 6, 7, 8
    mask = peers.visibility([9], 2, slots=5, sinks=1, window=3)    # queries at positions 7 and 8
    pos = [0, 5, 6, 7, 8]                                            # slot order: 0 | 5 6 7 8 at slots 0,2,3,4,1
    from streamattn.storage import slot_positions
    held = slot_positions(9, slots=5, sinks=1).tolist()
    assert sorted(held) == pos
    seen = [[held[s] for s in range(5) if mask[0, t, s]] for t in range(2)]
    assert [sorted(x) for x in seen] == [[0, 5, 6, 7], [0, 6, 7, 8]]


def test_stream_summary(one_thread):
    r = stream.stream(stream.StreamConfig(tokens=2000, window=16, sinks=2, check_every=37, block=256))
    assert r["failed_checks"] == [] and r["checks"] >= 2 * 54
    assert r["storage_never_reallocated"] and r["max_oracle_error"] <= r["tolerance"]
    assert len(r["latency_window_medians_us"]) == 2 and np.isfinite(r["latency_ratio"])
    assert "RSS growth" in stream.summary_line(r)


def test_time_step_hook():
    r = bench.time_step(lambda: None, tokens_per_call=8, warmup=1, min_reps=3, min_time=0)
    assert r["reps"] == 3 and r["tokens_per_s"] > 0


def test_end_to_end_hook_times_a_model_engine():
    calls = []

    def make_engine(*, context, batch, cache):
        if cache == "window" and context > 512:
            return None                                  # a combination the model does not allow
        return (lambda: calls.append(("prefill", context)), lambda: calls.append(("decode", batch)))
    rows = bench.end_to_end(make_engine, contexts=(512, 4096), batches=(1, 8))
    assert [(r["cache"], r["context"], r["batch"]) for r in rows] == \
        [("full", 512, 1), ("full", 512, 8), ("full", 4096, 1), ("full", 4096, 8), ("window", 512, 1), ("window", 512, 8)]
    assert all(r["prefill"]["tokens_per_s"] > 0 and r["decode"]["tokens_per_s"] > 0 for r in rows)


@need_smollm2
def test_model_throughput_script_on_smollm2(single_thread):
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "model_throughput.py")
    spec = importlib.util.spec_from_file_location("model_throughput", path)
    mt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mt)
    res = mt.run(load(smollm2_path())[1], contexts=(16,), batches=(1, 2), caches=("full", "window"), window=8,
                 chunk=8)
    assert [(r["cache"], r["batch"]) for r in res["rows"]] == [("full", 1), ("full", 2), ("window", 1), ("window", 2)]
    assert all(r[k]["tokens_per_s"] > 0 for r in res["rows"] for k in ("prefill", "decode"))
    assert "decode ms/step" in mt.table(res["rows"])
    json.dumps(res)


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("n", [1, 7, 1001])
def test_ceiling_probe_reads_every_element_once(streams, n):
    """Both read patterns of the probe sum the whole buffer: a faster pattern must not skip bytes."""
    from streamattn.bench.ceiling import _parallel_sum
    a = np.arange(1, n + 1, dtype=np.float32)
    assert _parallel_sum(a, 3, streams) == n * (n + 1) / 2
