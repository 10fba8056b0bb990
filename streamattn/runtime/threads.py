"""CPU threads: how idle pool workers wait (set once, at import), the thread counts of the two pools, and
:class:`ThreadChooser`, which runs each kind of engine step on one thread or on the caller's count,
whichever it measured faster lately (so that a second thread never makes decoding slower).

Importing streamattn applies :data:`RUNTIME_ENV` as defaults, before numpy loads OpenBLAS and before
Numba's first parallel launch loads GNU libgomp (Numba's 'omp' threading layer on Linux; both runtimes
read these variables once, when they load): a short libgomp spin for idle workers, OpenBLAS's shortest
sleep timeout, and Numba's threading layer named explicitly. A value the user exported wins (an exported
OMP_WAIT_POLICY also keeps libgomp's own spin count for that policy). The settings cannot reach a runtime
loaded before streamattn was imported (e.g. numpy imported first: OpenBLAS keeps spinning);
:func:`runtime_report` says what took effect. :func:`set_threads` sets one count for both pools,
:func:`threads` does so inside a ``with`` block.

Why a short spin rather than a long one or none: docs/DESIGN.md §11; the measurements: docs/PERF.md
(figures once in module docstrings) and docs/END_TO_END.md.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import glob
import os
import sys
import threading
import time

#: Environment defaults applied at import (``os.environ.setdefault``: an exported value wins).
RUNTIME_ENV = {
    "GOMP_SPINCOUNT": "3000",            # libgomp: idle workers spin 3,000 turns, then block
    "OPENBLAS_THREAD_TIMEOUT": "4",      # OpenBLAS: idle workers sleep after 2^4 cycles (its minimum), not 2^28
}
if sys.platform.startswith("linux"):      # numba's Linux wheels ship the omp layer (GNU libgomp)
    RUNTIME_ENV["NUMBA_THREADING_LAYER"] = "omp"   # explicit, not "whichever of tbb/omp/workqueue loads first"


def _loaded(fragment: str) -> bool:
    """Whether a shared library whose path contains ``fragment`` is mapped into this process (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            return any(fragment in line for line in f)
    except OSError:
        return False


def _configure_runtime() -> dict:
    """Apply :data:`RUNTIME_ENV` as defaults; returns which runtimes were already loaded (too late)."""
    late = {"openblas": "numpy" in sys.modules, "libgomp": _loaded("libgomp")}
    for key, value in RUNTIME_ENV.items():
        if key == "GOMP_SPINCOUNT" and "OMP_WAIT_POLICY" in os.environ:
            continue                              # the user's policy keeps its own spin count
        os.environ.setdefault(key, value)
    if "numba" in sys.modules:                    # numba read NUMBA_THREADING_LAYER at its import
        import numba
        if (numba.config.THREADING_LAYER == "default" and "NUMBA_THREADING_LAYER" in RUNTIME_ENV
                and "NUMBA_THREADING_LAYER" not in _USER_SET):
            numba.config.THREADING_LAYER = RUNTIME_ENV["NUMBA_THREADING_LAYER"]
    return late


#: What :func:`runtime_report` reads back: our defaults, and the policy a user may export instead.
REPORTED = ("OMP_WAIT_POLICY", *RUNTIME_ENV)
_USER_SET = {k: os.environ[k] for k in REPORTED if k in os.environ}
_LATE = _configure_runtime()


def runtime_report() -> dict:
    """What the thread runtimes of this process were told, and whether it reached them.

    Returns
    -------
    dict
        ``env``: each :data:`REPORTED` key with the value the C runtime sees (``getenv``, None: unset);
        ``user_set``: the keys the user had exported (their values won); ``late``: runtimes already
        loaded before streamattn was imported (``{"openblas": bool, "libgomp": bool}``: True means the
        default could not apply); ``threading_layer``: Numba's layer once a parallel kernel has run,
        else None.

    Examples
    --------
    >>> runtime_report()["env"]["OPENBLAS_THREAD_TIMEOUT"] is not None
    True
    """
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    env = {k: (libc.getenv(k.encode()) or b"").decode() or None for k in REPORTED}
    layer = None
    if "numba" in sys.modules:
        import numba
        try:
            layer = numba.threading_layer()
        except ValueError:                        # no parallel kernel has run yet
            layer = None
    return {"env": env, "user_set": dict(_USER_SET), "late": dict(_LATE), "threading_layer": layer}


_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")


def _openblas(names=_SETTERS):
    import numpy as np
    here = os.path.dirname(np.__file__)
    for path in glob.glob(os.path.join(here, "..", "numpy.libs", "*openblas*")) + \
            glob.glob(os.path.join(here, ".dylibs", "*openblas*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in names:
            if hasattr(lib, name):
                return getattr(lib, name)
    return None


def set_threads(n: int) -> dict:
    """Use ``n`` threads for numpy's OpenBLAS (when found) and for Numba parallel kernels.

    Returns what was set: ``{"blas": bool, "numba": int}``.

    Examples
    --------
    >>> set_threads(1)["numba"]
    1
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be an integer >= 1 (got {n!r})")
    import numba
    n_numba = min(n, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n_numba)
    _local.ceiling = n_numba
    setter = _openblas()
    if setter is not None:
        setter(n)
    return {"blas": setter is not None, "numba": n_numba}


def thread_count() -> int:
    """Numba's thread count for this Python thread. After the first call it reads Numba's own ctypes
    getter, which does not check the pool as ``numba.get_num_threads()`` does (docs/DESIGN.md §23)."""
    global _thread_count
    if _thread_count is None:
        import numba
        numba.get_num_threads()                          # launches the pool once: the getter is valid after
        try:
            from numba.np.ufunc.parallel import _get_num_threads
            _thread_count = _get_num_threads
        except ImportError:                              # numba internals moved: the public call
            _thread_count = numba.get_num_threads
    return _thread_count()


def _kernel_thread_count():
    """The getter behind :data:`kernel_thread_count`: Numba's intrinsic that the parfors' own code calls,
    which names Numba's C getter by symbol (the public ``numba.get_num_threads`` holds a ctypes pointer,
    and a function holding one is not cached on disk); where that internal moved, the public one."""
    try:
        from numba.np.ufunc.parallel import _iget_num_threads
        return _iget_num_threads
    except ImportError:                                  # numba internals moved: works, but uncached
        import numba
        return numba.get_num_threads


def __getattr__(name):
    """``kernel_thread_count``: the thread count inside a compiled function, valid only within a
    ``parallel=True`` function (which launches the pool before it runs). Imported on first use, so that
    importing this module loads no Numba (:data:`RUNTIME_ENV` must come first)."""
    if name == "kernel_thread_count":
        globals()[name] = value = _kernel_thread_count()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def many_threads() -> bool:
    """Whether Numba runs more than one thread for this Python thread: what the kernels' drivers ask before
    each call (:func:`thread_count`)."""
    return thread_count() > 1


def ceiling() -> int:
    """The most Numba threads this Python thread runs on: the count :func:`set_threads` set last (inside
    :func:`threads`, its ``n``), or Numba's pool size where it was never called. A
    :class:`ThreadChooser` step on one thread runs under it, and so does :func:`threads` with
    ``step_down``."""
    c = getattr(_local, "ceiling", None)
    if c is None:
        import numba
        c = numba.config.NUMBA_NUM_THREADS
    return c


def serial_kernels():
    """The ``serial`` argument of the kernels that have a serial and a parallel variant
    (:func:`streamattn.kv.backends.cpu.attend_all`, the compiled layer's ``Step``): None where this thread's
    :func:`ceiling` is 1, a value Numba types ``none``, so the choice is made when the caller is compiled
    and the parallel variants are never compiled (measured: docs/perf/2026-12-05.md); else whether it
    runs on one thread now (True: a ThreadChooser's step down, which must
    not compile a second, serial-only specialization beside the one with both), and a call with False
    still keeps a small step on one thread."""
    if thread_count() > 1:
        return False
    return None if ceiling() <= 1 else True


_thread_count = None
_local = threading.local()                  # .ceiling: set_threads' count for this Python thread


@contextlib.contextmanager
def threads(n: int, *, step_down: bool = False):
    """Context manager: :func:`set_threads` ``(n)`` inside, the previous counts (and :func:`ceiling`)
    restored after. ``step_down``: the calling thread's ceiling stays what it was (a run set to more
    threads stepping down, as a :class:`ThreadChooser` step does)."""
    import numba
    getter = _openblas(tuple(s.replace("set_", "get_") for s in _SETTERS))
    old_blas = int(getter()) if getter is not None else None
    old_numba = numba.get_num_threads()
    old_ceiling = getattr(_local, "ceiling", None)
    set_threads(n)
    if step_down:
        _local.ceiling = old_ceiling
    try:
        yield
    finally:
        numba.set_num_threads(old_numba)
        _local.ceiling = old_ceiling
        if old_blas is not None:
            _openblas()(old_blas)


def idle_cpus() -> int | None:
    """How many of the host's CPUs run nothing at this instant: ``os.cpu_count()`` less the tasks running
    now (the fourth field of ``/proc/loadavg``, which counts the caller's own thread), or None where that
    file cannot be read. One read of a file kept open."""
    global _loadavg
    try:
        if _loadavg is None:
            _loadavg = os.open("/proc/loadavg", os.O_RDONLY)
        running = int(os.pread(_loadavg, 128, 0).split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None
    return (os.cpu_count() or 1) - running


_loadavg = None


def _spread(times) -> float:
    """What the chooser compares: the mean of a count's recent step times less their largest, when there
    are three or more (one stray slow step, e.g. a page fault, moves nothing). A mean, not a median: beside
    a neighbour, steps on two threads are either about as fast as on one or two to three times slower
    (a worker descheduled at a join), and a median of such steps hides the slow ones the throughput pays."""
    xs = sorted(times)
    if len(xs) >= 3:
        xs = xs[:-1]
    return sum(xs) / len(xs)


class ThreadChooser:
    """Runs each kind of step on one thread or on the caller's Numba thread count (the ceiling), whichever
    its recent steps of that kind took less time on, and tries the ceiling only while the host has CPUs to
    spare for it.

    Why: every parallel region of a step is a fork/join, ~30 layers x several a decode step, and on a host
    whose vCPUs are shared a descheduled worker costs a time slice at each join: there two threads decoded
    slower than one (docs/DESIGN.md §12; docs/PERF.md). Results do not depend on the thread count (the
    kernels split work, never a reduction), so the choice changes speed only, never a token.

    How: the first ``first`` steps of a kind alternate the two counts (one thread first), and the count
    with the lower mean time over them is chosen (:func:`_spread`); afterwards each step runs on the chosen
    count, and after ``settle`` steps on it (later ``probe_every``) one step runs on the other count (a
    probe), timed against the chosen count's last ``keep`` steps. A probe that beats them is followed by
    another at once, and ``switch`` such wins in a row switch the choice, so a change of the host (a
    neighbour starting or stopping) is followed within a few steps; a probe that loses doubles the wait
    before the next (at least ``probe_every``, at most 8 x ``probe_every``). Only probes switch: each is
    compared with steps of the moment, never with the other count's older times, so a host that slows
    (or speeds up) both counts alike, as a busy neighbour does to whole spells of steps, moves no choice.

    The gate: a step on the ceiling from one thread (a warm-up step or a probe) costs one to three steps
    of time beside a busy neighbour, which at one probe per 32 steps and two warm-up steps left two threads
    a few % behind one. So after every step on one thread the chooser reads how many CPUs are idle
    (``idle``, default :func:`idle_cpus`), and such a step is taken only when at least three such readings
    were made and, of the last twelve, at most one in twelve found fewer than ceiling - 1 CPUs idle; until
    then the step runs on one thread (a probe waits for the gate; a warm-up stays on one thread). Beside
    a neighbour busy 5 ms of every 10 about half the readings find the other CPU taken: three clean ones
    in a row have odds 1/8, one in twelve 1/300; on a quiet host 295 of 300 readings were clean. Where the
    count of idle CPUs cannot be read (``idle`` returns None, or ``idle=None``), only the times decide.
    A kind is whatever the caller names (the engine: its step's real rows, by powers of two); the
    counts are tracked per ceiling. With a ceiling of 1 there is nothing to choose.

    Examples
    --------
    >>> chooser = ThreadChooser()
    >>> with chooser.step(kind=1) as n:          # runs the block on n threads, timed
    ...     pass
    """

    def __init__(self, *, first: int = 2, keep: int = 5, probe_every: int = 32, switch: int = 3, settle: int = 4,
                 clock=time.perf_counter, idle=idle_cpus):
        for name, v, least in (("first", first, 1), ("keep", keep, 1), ("probe_every", probe_every, 1),
                               ("switch", switch, 1), ("settle", settle, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name} must be an integer >= {least} (got {v!r})")
        if first > keep:
            raise ValueError(f"first must be at most keep={keep} (got {first!r})")
        if idle is not None and not callable(idle):
            raise ValueError(f"idle must be a callable returning idle CPUs, or None (got {idle!r})")
        self.first, self.keep, self.probe_every, self.switch, self.clock = first, keep, probe_every, switch, clock
        self.settle, self.idle = settle, idle
        self._kinds = {}                 # (kind, ceiling) -> _Kind
        self._idle = collections.deque(maxlen=self.READINGS)    # idle CPUs after recent one-thread steps

    #: Readings of idle CPUs the gate looks at (the last ones), and how many it needs before opening.
    READINGS, LEAST_READINGS = 12, 3

    def choose(self, kind, ceiling: int, *, gate: bool = True) -> int:
        """The thread count the next step of ``kind`` runs on under ``ceiling`` (1 or ``ceiling``);
        ``gate=False``: the times alone decide (the class docstring's gate is not asked)."""
        if ceiling <= 1:
            return 1
        return self._kind(kind, ceiling).next((lambda: self.spare(ceiling)) if gate else (lambda: True))

    def record(self, kind, ceiling: int, count: int, seconds: float, *, read: bool = True) -> None:
        """A step of ``kind`` under ``ceiling`` took ``seconds`` on ``count`` threads (after one on one
        thread, the idle CPUs are read, unless ``read`` is False: a block inside a step, whose step reads)."""
        if ceiling > 1 and count in (1, ceiling):
            self._kind(kind, ceiling).record(count, seconds)
            if count == 1 and read and self.idle is not None:
                n = self.idle()
                if n is not None:
                    self._idle.append(n)

    def spare(self, ceiling: int) -> bool:
        """Whether the host looks able to run ``ceiling`` threads now: the gate (class docstring)."""
        if self.idle is None:
            return True
        readings = list(self._idle)
        if not readings:
            return self.idle() is None       # nothing read yet: unreadable means ungated
        short = sum(n < ceiling - 1 for n in readings)
        return len(readings) >= self.LEAST_READINGS and short <= len(readings) // self.READINGS

    def seconds(self, kind, ceiling: int, count: int) -> float | None:
        """What recent steps of ``kind`` on ``count`` threads took (the mean the chooser compares), or
        None before one was timed."""
        k = self._kinds.get((kind, ceiling))
        times = None if k is None else k.times.get(count)
        return _spread(times) if times else None

    def chosen(self, kind, ceiling: int) -> int:
        """The count steps of ``kind`` run on between probes now (``ceiling`` before any is measured)."""
        k = self._kinds.get((kind, ceiling))
        return ceiling if k is None else k.best

    @contextlib.contextmanager
    def step(self, kind, *, ceiling: int | None = None, gate: bool = True):
        """Context manager: the block runs on :meth:`choose`'s count (yielded) and is timed into
        :meth:`record`; the caller's thread count is back after it (an exception records nothing).
        ``ceiling``: default the caller's count; a block inside another step passes the outer one's, and
        reads no idle CPUs (one reading a step, at its end); ``gate``: as for :meth:`choose`."""
        import numba
        before = thread_count()
        inner, ceiling = ceiling is not None, before if ceiling is None else ceiling
        count = self.choose(kind, ceiling, gate=gate)
        if count != before:
            numba.set_num_threads(count)
        t0 = self.clock()
        try:
            yield count
        finally:
            if count != before:
                numba.set_num_threads(before)
        self.record(kind, ceiling, count, self.clock() - t0, read=not inner)

    def _kind(self, kind, ceiling):
        k = self._kinds.get((kind, ceiling))
        if k is None:
            k = self._kinds[kind, ceiling] = _Kind(ceiling, self.first, self.keep, self.probe_every, self.switch,
                                                   self.settle)
        return k


class _Kind:
    """One kind of step's recent times on 1 thread and on the ceiling, and the count chosen from them."""

    def __init__(self, ceiling, first, keep, probe_every, switch, settle):
        self.counts = (ceiling, 1)
        self.first, self.keep, self.probe_every, self.switch = first, keep, probe_every, switch
        self.times = {c: collections.deque(maxlen=keep) for c in self.counts}    # count -> recent seconds
        self.best = ceiling
        self.since = 0                   # steps on the chosen count since the last probe
        self.wait = min(settle, probe_every)   # chosen steps before the next probe (the first: soon)
        self.wins = []                   # the times of the probes in a row that beat the chosen count

    def _warm(self) -> bool:
        return all(len(t) >= self.first for t in self.times.values())

    def next(self, spare) -> int:
        """The next step's count; ``spare()``: whether the gate lets a step go from one thread to the
        ceiling (asked only for a warm-up step or a probe on the ceiling)."""
        warm = self._warm()
        if not warm:                     # alternate, one thread first
            count = min(reversed(self.counts), key=lambda c: len(self.times[c]))
        elif self.wins or self.since >= self.wait:
            count = self.counts[1] if self.best == self.counts[0] else self.counts[0]
        else:
            return self.best
        if count > 1 and (not warm or self.best == 1) and not spare():
            return 1                     # the gate: no CPU to spare now; one thread, and ask again next step
        return count

    def record(self, count, seconds):
        if not self._warm():             # warm-up: the two counts alternated, so timed in the same spell
            self.times[count].append(seconds)
            if self._warm():
                self.best = min(reversed(self.counts), key=lambda c: _spread(self.times[c]))
            return
        if count == self.best:
            self.times[count].append(seconds)
            self.since += 1
            return
        self.since = 0                   # a probe, against the chosen count's steps of the moment
        if seconds < _spread(self.times[self.best]):
            self.wins.append(seconds)
            if len(self.wins) >= self.switch:
                self.times[count] = collections.deque(self.wins, maxlen=self.keep)
                self.best, self.wins, self.wait = count, [], self.probe_every
        else:
            self.wins = []               # after the first (settle) probe, at least probe_every
            self.wait = min(max(2 * self.wait, self.probe_every), 8 * self.probe_every)
