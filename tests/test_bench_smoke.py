"""The benchmark and the stream run end to end on tiny sizes (they are measured by hand, not here)."""

import json

import numpy as np
import pytest

from _model_util import load, need_smollm2, smollm2_path
from streamattn.bench import peers, report as benchreport, stream, sweep as bench
from streamattn.bench.suites import Point


def test_every_impl_mode_and_phase_passes_its_oracle_check(one_thread):
    base = dict(L=96, q_heads=4, kv_heads=2, head_dim=16)
    points = [Point(impl=i, mode=m, dtype=dt, **base) for i in ("cpu", "numpy")
              for m, dt in (("causal", "float32"), ("window", "float16"), ("sinks", "bfloat16"))]
    points += [Point(impl=i, phase="prefill", T=5, mode="sinks", **base) for i in ("cpu", "numpy")]
    points += [Point(impl=i, phase="recompute", T=96, **base) for i in ("cpu", "numpy")]
    rows = bench.run(points, ceiling_bytes=8 << 20, rotate_bytes=1 << 20, min_reps=2, max_reps=2, min_time=0,
                     warmup=1)
    assert [r["status"] for r in rows] == ["ok"] * len(points), [r["oracle_error"] for r in rows]
    for r in rows:  # the figures are what their names say, from the timings the row records
        assert r["gbps"] == pytest.approx(r["bytes_read"] / r["median_s"] / 1e9, rel=1e-12)
        assert r["ceiling_gbps"] == max(r["ceiling_before"], r["ceiling_after"]) > 0
        assert r["pct_ceiling"] == pytest.approx(100 * r["gbps"] / r["ceiling_gbps"], rel=1e-12)
        assert r["p10_s"] <= r["median_s"] <= r["p90_s"] and r["reps"] == 2
    text = benchreport.table(rows)
    assert text.count("full recompute vs cached decode") == 2     # cpu and numpy, beside causal decode
    json.dumps(rows)


def test_quantized_points_pass_their_oracle_check(one_thread):
    """q8_0 / q4_0 points store keys rotated (the default): the oracle scores q @ H against them, as
    attend does (an unrotated oracle read 1.35 here, and kv_quant_decode.py refused to run)."""
    points = [Point(impl="cpu", mode=m, dtype=dt, L=96, q_heads=9, kv_heads=3, head_dim=64)
              for dt in ("q8_0", "q4_0") for m in ("causal", "window")]
    assert all(p.spec().rotate_k for p in points)
    rows = bench.run(points, ceiling_bytes=8 << 20, rotate_bytes=1 << 20, min_reps=2, max_reps=2, min_time=0,
                     warmup=1)
    assert [r["status"] for r in rows] == ["ok"] * len(points), [r["oracle_error"] for r in rows]


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
    from streamattn.kv.storage import slot_positions
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


class FakeClock:
    """Stands in for time.perf_counter: advances only when a step says how long it took."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def step(self, seconds):
        return lambda: setattr(self, "now", self.now + seconds)


def test_time_step_hook(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    r = bench.time_step(clock.step(0.25), tokens_per_call=8, warmup=1, min_reps=3, min_time=0)
    assert r == {"median_s": 0.25, "tokens_per_s": 32.0, "reps": 3}


def test_end_to_end_hook_times_a_model_engine(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    calls = []

    def make_engine(*, context, batch, cache):
        if cache == "window" and context > 512:
            return None                                  # a combination the model does not allow
        prefill, decode = clock.step(context / 1024), clock.step(0.5)   # "seconds" per call
        return (lambda: (calls.append(("prefill", context)), prefill()),
                lambda: (calls.append(("decode", batch)), decode()))
    rows = bench.end_to_end(make_engine, contexts=(512, 4096), batches=(1, 8))
    assert [(r["cache"], r["context"], r["batch"]) for r in rows] == \
        [("full", 512, 1), ("full", 512, 8), ("full", 4096, 1), ("full", 4096, 8), ("window", 512, 1), ("window", 512, 8)]
    for r in rows:   # prefill: batch * context tokens in context/1024 s; decode: batch tokens in 0.5 s
        assert r["prefill"]["tokens_per_s"] == pytest.approx(r["batch"] * 1024)
        assert r["decode"]["tokens_per_s"] == pytest.approx(2 * r["batch"])
    assert calls.count(("prefill", 4096)) == 2 * (1 + 3)   # two batches, warm-up + 3 timed prefills each


@need_smollm2
def test_model_throughput_script_on_smollm2(one_thread):
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "model_throughput.py")
    spec = importlib.util.spec_from_file_location("model_throughput", path)
    mt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mt)
    res = mt.run(load(smollm2_path())[1], contexts=(16,), batches=(1, 2), caches=("full", "window"), window=8,
                 chunk=8)
    assert [(r["cache"], r["batch"]) for r in res["rows"]] == [("full", 1), ("full", 2), ("window", 1), ("window", 2)]
    for r in res["rows"]:   # tokens per second of what each step processed: prompt tokens, one per sequence
        assert r["prefill"]["tokens_per_s"] * r["prefill"]["median_s"] == pytest.approx(16 * r["batch"])
        assert r["decode"]["tokens_per_s"] * r["decode"]["median_s"] == pytest.approx(r["batch"])
    assert "decode ms/step" in mt.table(res["rows"])
    json.dumps(res)


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("n", [1, 7, 1001])
def test_ceiling_probe_reads_every_element_once(streams, n):
    """Both read patterns of the probe sum the whole buffer: a faster pattern must not skip bytes."""
    from streamattn.bench.ceiling import _parallel_sum
    a = np.arange(1, n + 1, dtype=np.float32)
    assert _parallel_sum(a, 3, streams) == n * (n + 1) / 2
