"""Importing streamattn sets the thread runtimes' wait policy before they load, and it reaches them."""

import json
import os
import subprocess
import sys

import pytest

from streamattn.runtime.threads import REPORTED, RUNTIME_ENV, runtime_report, set_threads

_PROBE = """
import streamattn                                          # first, as the CLI does
import json, numpy as np
from streamattn.bench.ceiling import _parallel_sum       # a cached parallel kernel: no compile here
from streamattn.runtime.threads import runtime_report
_parallel_sum(np.ones(64, np.float32), 2, 1)
print(json.dumps(runtime_report()))
"""


def _run(extra_env: dict) -> tuple:
    env = {k: v for k, v in os.environ.items() if k not in REPORTED}
    env.update(OMP_DISPLAY_ENV="VERBOSE", **extra_env)     # libgomp prints its settings as it loads
    p = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the omp layer and /proc are Linux's")
def test_wait_policy_reaches_the_openmp_runtime():
    report, omp = _run({})
    assert f"GOMP_SPINCOUNT = '{RUNTIME_ENV['GOMP_SPINCOUNT']}'" in omp      # libgomp's own view
    assert report["threading_layer"] == "omp"
    assert report["env"] == {"OMP_WAIT_POLICY": None, **RUNTIME_ENV} and report["user_set"] == {}
    assert report["late"] == {"openblas": False, "libgomp": False}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the omp layer and /proc are Linux's")
def test_an_exported_value_wins():
    """The same check tells the policies apart: a user's ACTIVE keeps libgomp's own (long) spin, not ours,
    and a user's GOMP_SPINCOUNT replaces ours."""
    report, omp = _run({"OMP_WAIT_POLICY": "ACTIVE"})
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in omp and "GOMP_SPINCOUNT = '30000000000'" in omp
    assert report["user_set"] == {"OMP_WAIT_POLICY": "ACTIVE"} and report["env"]["OMP_WAIT_POLICY"] == "ACTIVE"
    assert report["env"]["GOMP_SPINCOUNT"] is None
    report, omp = _run({"GOMP_SPINCOUNT": "0"})
    assert "GOMP_SPINCOUNT = '0'" in omp and report["user_set"] == {"GOMP_SPINCOUNT": "0"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")
def test_numpy_imported_first_is_reported_late():
    p = subprocess.run([sys.executable, "-c", "import numpy, json, streamattn.runtime.threads as t; "
                        "print(json.dumps(t.runtime_report()['late']))"], capture_output=True, text=True, timeout=300)
    assert json.loads(p.stdout) == {"openblas": True, "libgomp": False}, p.stderr[-2000:]


def test_set_threads_validates():
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        set_threads(0)
    assert runtime_report()["env"]["OPENBLAS_THREAD_TIMEOUT"] == os.environ.get("OPENBLAS_THREAD_TIMEOUT")


class Host:
    """A host whose steps take ``cost[count]`` seconds on ``count`` threads (changed at will)."""

    def __init__(self, cost):
        self.cost = dict(cost)

    def run(self, chooser, kind, ceiling):
        count = chooser.choose(kind, ceiling)
        chooser.record(kind, ceiling, count, self.cost[count])
        return count


def test_the_chooser_alternates_then_keeps_the_faster_count_and_probes_the_other():
    from streamattn.runtime.threads import ThreadChooser
    chooser, host = ThreadChooser(first=3, keep=5, probe_every=8, idle=None), Host({1: 5e-3, 2: 8e-3})   # 2 threads slower
    ran = [host.run(chooser, "decode", 2) for _ in range(6 + 200)]
    assert ran[:6] == [1, 2, 1, 2, 1, 2]                                  # warm-up: alternated, one thread first
    assert chooser.chosen("decode", 2) == 1
    probes = [i for i, n in enumerate(ran[6:]) if n == 2]                 # after 4 (settle), 8, 16, 32, 64, 64
    assert probes == [4, 4 + 1 + 8, 13 + 1 + 16, 30 + 1 + 32, 63 + 1 + 64, 128 + 1 + 64]
    assert chooser.chosen("prefill", 2) == 2                               # kinds are learnt apart
    assert [host.run(chooser, "x", 1) for _ in range(5)] == [1] * 5        # a ceiling of 1: nothing to choose


def test_the_chooser_follows_a_host_that_changes_within_a_few_steps():
    """Once the other count wins a probe it is probed again at once: three wins of five samples flip the
    choice, whatever the wait before that probe had grown to."""
    from streamattn.runtime.threads import ThreadChooser
    chooser, host = ThreadChooser(first=3, keep=5, probe_every=8, idle=None), Host({1: 5e-3, 2: 8e-3})
    for _ in range(100):
        host.run(chooser, 1, 2)
    assert chooser.chosen(1, 2) == 1
    for cost, other in (({1: 5e-3, 2: 3e-3}, 2), ({1: 5e-3, 2: 9e-3}, 1)):    # a neighbour leaves, comes back
        host.cost = cost
        ran = [host.run(chooser, 1, 2) for _ in range(8 * 8 + 4)]
        first = ran.index(other)                                  # the first probe after the change
        assert ran[first:first + 3] == [other] * 3 and chooser.chosen(1, 2) == other


def test_a_host_that_slows_both_counts_alike_moves_no_choice():
    """Only probes switch: when a busy spell makes every step slower, the chosen count's new times are not
    set against the other count's older (quieter) ones, which would put the steps on the slower count."""
    from streamattn.runtime.threads import ThreadChooser
    chooser, host = ThreadChooser(first=2, keep=5, probe_every=8, idle=None), Host({1: 5e-3, 2: 4e-3})
    for _ in range(20):
        host.run(chooser, 1, 2)
    assert chooser.chosen(1, 2) == 2
    host.cost = {1: 10e-3, 2: 8e-3}                    # the host at half speed: 2 threads still faster
    ran = [host.run(chooser, 1, 2) for _ in range(200)]
    assert chooser.chosen(1, 2) == 2 and ran.count(1) <= 5      # a few lost probes, never a switch


def test_a_probe_that_wins_once_by_chance_switches_nothing():
    from streamattn.runtime.threads import ThreadChooser
    chooser = ThreadChooser(first=2, keep=5, probe_every=4, switch=3, idle=None)
    ran, times = [], iter([5e-3, 4e-3, 5e-3, 4e-3] + [4e-3] * 4 + [3e-3, 6e-3] + [4e-3] * 40)
    for _ in range(50):
        count = chooser.choose(1, 2)
        ran.append(count)
        chooser.record(1, 2, count, next(times))
    assert ran[8:10] == [1, 1] and chooser.chosen(1, 2) == 2    # one win, then a loss: no switch


def test_a_wrong_warm_up_choice_is_undone_within_a_few_steps():
    """Beside a noisy neighbour two warm-up steps of each count can favour the count that is slower from
    then on: the first probe comes after ``settle`` steps, so the choice turns after settle + switch
    steps (at probe_every = 32 it took 35)."""
    from streamattn.runtime.threads import ThreadChooser
    chooser = ThreadChooser(first=2, keep=5, probe_every=32, switch=3, settle=4, idle=None)
    warm = iter([9e-3, 4e-3, 9e-3, 4e-3])              # 1, 2, 1, 2 threads: two threads look faster
    ran = []
    for i in range(40):
        count = chooser.choose(1, 2)
        ran.append(count)
        chooser.record(1, 2, count, next(warm) if i < 4 else {1: 5e-3, 2: 8e-3}[count])   # then 1 is faster
    assert ran[4:8] == [2] * 4 and ran[8:11] == [1] * 3                # 4 steps on two, then 3 winning probes
    assert chooser.chosen(1, 2) == 1 and ran[11:].count(2) <= 1


class Neighbour:
    """Idle CPUs of a 2-CPU host read after each one-thread step: one (the other CPU free) or, while
    ``busy``, every other reading none (a neighbour that takes that CPU half the time)."""

    def __init__(self):
        self.busy, self.reads = False, 0

    def __call__(self):
        self.reads += 1
        return 0 if self.busy and self.reads % 2 else 1


def test_the_gate_keeps_steps_off_the_ceiling_while_the_host_has_no_cpu_to_spare():
    """Two threads are faster by their times here, yet while the other CPU is busy half the time no step
    goes to two threads (not the warm-up's, not a probe); once it is free, twelve readings later, the
    warm-up takes two threads and keeps them."""
    from streamattn.runtime.threads import ThreadChooser
    idle = Neighbour()
    chooser, host = ThreadChooser(first=2, keep=5, probe_every=8, idle=idle), Host({1: 5e-3, 2: 3e-3})
    idle.busy = True
    assert [host.run(chooser, 1, 2) for _ in range(100)] == [1] * 100
    assert idle.reads == 100                                     # one reading after every one-thread step
    idle.busy = False
    ran = [host.run(chooser, 1, 2) for _ in range(40)]
    first = ran.index(2)
    assert 9 <= first <= 11                                      # the last 12 readings: at most one short
    assert chooser.chosen(1, 2) == 2 and ran[first:].count(1) <= 3


def test_the_gate_holds_probes_back_not_a_choice_already_made():
    """On a quiet host the choice goes to two threads; a neighbour then makes them slower and one-thread
    probes turn the choice (the gate never stops a step from going to one thread); from then on no probe
    goes to two threads while the neighbour stays, and the first comes once it has left."""
    from streamattn.runtime.threads import ThreadChooser
    idle = Neighbour()
    chooser, host = ThreadChooser(first=2, keep=5, probe_every=8, idle=idle), Host({1: 5e-3, 2: 3e-3})
    ran = [host.run(chooser, 1, 2) for _ in range(30)]
    assert ran[:5] == [1, 1, 1, 2, 2] and chooser.chosen(1, 2) == 2    # three readings, then the warm-up
    idle.busy, host.cost = True, {1: 5e-3, 2: 9e-3}
    ran = [host.run(chooser, 1, 2) for _ in range(20)]
    assert chooser.chosen(1, 2) == 1
    ran = [host.run(chooser, 1, 2) for _ in range(300)]
    assert ran == [1] * 300
    idle.busy = False
    ran = [host.run(chooser, 1, 2) for _ in range(20)]
    assert 8 <= ran.index(2) <= 10                               # the probe that was due, once the gate opens


def test_an_unreadable_host_leaves_the_times_to_decide():
    from streamattn.runtime.threads import ThreadChooser
    chooser, host = ThreadChooser(first=2, keep=5, probe_every=8, idle=lambda: None), Host({1: 5e-3, 2: 3e-3})
    assert [host.run(chooser, 1, 2) for _ in range(6)] == [1, 2, 1, 2, 2, 2]


def test_idle_cpus_reads_the_host():
    from streamattn.runtime.threads import idle_cpus
    n = idle_cpus()
    if not os.path.exists("/proc/loadavg"):
        assert n is None
    else:
        assert isinstance(n, int) and n <= (os.cpu_count() or 1) - 1      # the caller itself is running


def test_the_chooser_sets_the_count_for_its_block_and_puts_the_callers_back():
    import numba
    from streamattn.runtime.threads import ThreadChooser
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread only in this process (NUMBA_NUM_THREADS=1)")
    chooser, before = ThreadChooser(first=1, keep=1, idle=None), numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        seen = []
        for _ in range(4):
            with chooser.step("k") as n:
                seen.append((n, numba.get_num_threads()))
            assert numba.get_num_threads() == 2
        assert seen[:2] == [(1, 1), (2, 2)]
        with pytest.raises(ZeroDivisionError):
            with chooser.step("k"):
                1 / 0
        assert numba.get_num_threads() == 2
    finally:
        numba.set_num_threads(before)


def test_a_step_inside_another_runs_on_its_own_count_and_puts_the_outer_one_back():
    """The engine's output head: a step of its own kind inside a decode step, under the outer ceiling,
    decided by its times alone (``gate=False``) while the gate keeps the outer step on one thread."""
    import numba
    from streamattn.runtime.threads import ThreadChooser
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread only in this process (NUMBA_NUM_THREADS=1)")
    reads = []
    chooser = ThreadChooser(first=1, keep=1, idle=lambda: reads.append(0) or 0)          # no CPU idle
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        seen = []
        for _ in range(3):
            with chooser.step("step") as n:
                with chooser.step("head", ceiling=2, gate=False) as h:
                    seen.append((n, h, numba.get_num_threads()))
                assert numba.get_num_threads() == n
            assert numba.get_num_threads() == 2
        assert seen[:2] == [(1, 1, 1), (1, 2, 2)]          # the outer gated on one; the head alternates
        assert len(reads) == 3                             # one reading per outer step, none for the head
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("kw,msg", [({"first": 0}, "first must be an integer >= 1"),
                                    ({"keep": 2, "first": 3}, "first must be at most keep=2"),
                                    ({"probe_every": True}, "probe_every must be an integer >= 1"),
                                    ({"switch": 0}, "switch must be an integer >= 1"),
                                    ({"settle": 0}, "settle must be an integer >= 1"),
                                    ({"idle": 3}, "idle must be a callable returning idle CPUs, or None")])
def test_the_chooser_validates(kw, msg):
    from streamattn.runtime.threads import ThreadChooser
    with pytest.raises(ValueError, match=msg):
        ThreadChooser(**kw)


def test_warm_model_loads_the_one_thread_decode_step_too():
    """With 2 threads set, warm_model runs the decode step and the padded (array-layer) call on 2 threads and
    on 1, the count the ThreadChooser may pick (whose serial drivers the first such step loaded: a 74 ms
    first step where later ones took 16); with 1 set, once; the caller's count is back after, also when a
    call raises."""
    import numba
    from types import SimpleNamespace
    from streamattn.engine.generate import warm_model
    from streamattn.runtime.threads import serial_kernels, threads
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("Numba has one thread on this host")

    class Recorder:
        plan = SimpleNamespace(rows=4)

        def __init__(self, fail_at=None):
            self.calls, self.serial, self.fail_at = [], [], fail_at

        def new_caches(self, **kw):
            return []

        def forward(self, tokens, caches, **kw):
            self.calls.append((tokens.shape[1], numba.get_num_threads(), "attn_hook" in kw))
            self.serial.append(serial_kernels())
            if len(self.calls) == self.fail_at:
                raise RuntimeError("boom")

    with threads(2):
        m = Recorder()
        warm_model(m, "float32")
        assert m.calls == [(4, 2, False), (1, 2, False), (1, 1, False), (2, 2, True), (2, 1, True)]
        assert m.serial == [False, False, True, False, True]   # one thread under the ceiling of 2: not None
        assert numba.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"):
            warm_model(Recorder(fail_at=3), "float32")          # raises on the one-thread decode step
        assert numba.get_num_threads() == 2
    with threads(1):
        m = Recorder()
        warm_model(m, "float32")
        assert m.calls == [(4, 1, False), (1, 1, False), (2, 1, True)] and m.serial == [None] * 3


def test_serial_kernels_follow_the_ceiling_not_the_count():
    """None (typed ``none``: serial kernels chosen when compiled) only under a ceiling of 1; a step down
    to one thread under a higher ceiling (ThreadChooser, warm_model) says True, so a 2-thread run
    compiles one specialization, not a second serial-only one."""
    import numba
    from streamattn.runtime.threads import ceiling, serial_kernels, threads
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("Numba has one thread on this host")
    with threads(2):
        assert ceiling() == 2 and serial_kernels() is False
        with threads(1, step_down=True):
            assert ceiling() == 2 and serial_kernels() is True
        with threads(1):
            assert ceiling() == 1 and serial_kernels() is None
        assert ceiling() == 2 and serial_kernels() is False


_ONE_THREAD_PROBE = """
import json, numpy as np
from streamattn.kv.backends import cpu
from streamattn.models import compiled, heads_kernel
from streamattn.runtime.threads import serial_kernels, set_threads
set_threads(1)
assert serial_kernels() is None
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 2, 40, 16)).astype(np.float32)        # 40 rows: a bool would choose at run time
k, v = (rng.standard_normal((1, 1, 64, 16)).astype(np.float32) for _ in range(2))
out, lse = cpu.attend(q, k, v, [40], [40], window=0, sinks=0, scale=0.25, kind="float32")
compiled._stage_16(k[:, :, :40], 1, 16, np.array([40]), None, None, False, q)
compiled._rows(out, lse, None)
M, hd = 40, 16
h = rng.standard_normal((M, 4 * hd)).astype(np.float32)
cos, sin = (np.ones((M, hd), np.float32) for _ in range(2))
compiled._heads(h, cos, sin, True, heads_kernel.NO_NORM, np.float32(1e-6), 1, 2, 1, None)
fns = {"attend_pages": cpu.attend_pages, "merge_splits": cpu._merge_splits,
       "stored_16_parallel": compiled.stored_16_parallel, "heads_to_rows_parallel": compiled.heads_to_rows_parallel,
       "heads_rope_rows_parallel": compiled.heads_rope_rows_parallel,
       "attend_pages_serial": cpu._attend_pages_serial, "stored_16": compiled.stored_16,
       "heads_to_rows": compiled.heads_to_rows, "heads_rope_alloc": compiled.heads_rope_alloc}
print(json.dumps({name: len(f.signatures) for name, f in fns.items()}))
"""


def test_one_thread_compiles_no_parallel_kernel(tmp_path):
    """Under a ceiling of 1 the attention and the compiled layer's staging, heads and rows kernels are
    compiled without their parallel variants (a fresh interpreter and an empty Numba cache, so nothing is
    loaded instead of compiled): the parallel dispatchers have no signature, the serial ones do."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": root}
    p = subprocess.run([sys.executable, "-c", _ONE_THREAD_PROBE], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    sigs = json.loads(p.stdout.strip().splitlines()[-1])
    assert {n: c for n, c in sigs.items() if "parallel" in n or n in ("attend_pages", "merge_splits")} == {
        "attend_pages": 0, "merge_splits": 0, "stored_16_parallel": 0, "heads_to_rows_parallel": 0,
        "heads_rope_rows_parallel": 0}
    assert all(sigs[n] > 0 for n in ("attend_pages_serial", "stored_16", "heads_to_rows", "heads_rope_alloc"))


def test_warm_model_leaves_the_array_layers_out_when_told():
    """``array_layers=False``: the chunk and the decode step, never the padded call through the array layers."""
    from types import SimpleNamespace
    from streamattn.engine.generate import warm_model
    from streamattn.runtime.threads import threads

    class Recorder:
        plan = SimpleNamespace(rows=4)
        calls: list = []

        def new_caches(self, **kw):
            return []

        def forward(self, tokens, caches, **kw):
            self.calls.append((tokens.shape[1], "attn_hook" in kw))
    with threads(1):
        m = Recorder()
        warm_model(m, "float32", array_layers=False)
        assert m.calls == [(4, False), (1, False)]
        m.calls = []
        warm_model(m, "float32")
        assert m.calls == [(4, False), (1, False), (2, True)]
