"""The read-ceiling probe: its vector readers read every element, and it reports the best of all readers."""

import numba
import numpy as np
import pytest

from streamattn.bench.ceiling import READERS, ROW, Ceiling, _parallel_sum, _vector_read


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("rows,nparts", [(1, 1), (7, 3), (1001, 8), (3, 5)])
@pytest.mark.parametrize("threads", [1, 2])
def test_vector_reader_sums_every_row_once(prefetch, rows, nparts, threads):
    """Small integers sum exactly in float32: a reader that skips or repeats a row or a chunk fails."""
    x = np.random.default_rng(rows).integers(0, 4, (rows, ROW)).astype(np.float32)    # [rows, 64]
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        assert _vector_read(x, nparts, prefetch) == x.sum(dtype=np.float64)
    finally:
        numba.set_num_threads(before)


def test_probe_is_the_best_of_every_reader_and_thread_count():
    """The old probe (one- and two-stream sums) is among the readers, so the ceiling is never below it on the
    same buffer; the result is the best entry, and the thread count is restored."""
    c = Ceiling(4 << 20)
    before = numba.get_num_threads()
    best = c.probe(1)
    assert numba.get_num_threads() == before
    assert set(c.last) == {(r, t) for r in READERS for t in c.threads}
    assert {"sum", "sum2"} < set(READERS) and 1 in c.threads
    assert best == max(c.last.values()) > 0
    assert c.buf.size % ROW == 0 and c.rows.base is c.buf                  # the views share one buffer
    assert _parallel_sum(c.buf, 4, 1) == _vector_read(c.rows, 4, True) == c.buf.size


@pytest.mark.parametrize("cold", [False, True])
def test_bracket_evicts_before_each_timed_call_when_cold(cold, monkeypatch):
    """A cold bracket reads the probe buffer before every call (and only then), each call gets its own
    index, and the ceiling filed is the better of the probes around the calls."""
    c = Ceiling(4 << 20)
    events = []
    evict = c.evict
    monkeypatch.setattr(c, "evict", lambda: (events.append("evict"), evict()))
    monkeypatch.setattr(c, "probe", lambda repeats=3: (events.append("probe"), [5.0, 7.0][events.count("probe") - 1])[1])
    med, ceiling = c.bracket(lambda i: events.append(i), 3, start=10, cold=cold)
    calls = ["evict", 10, "evict", 11, "evict", 12] if cold else [10, 11, 12]
    assert events == ["probe", *calls, "probe"]
    assert ceiling == 7.0 and med >= 0
