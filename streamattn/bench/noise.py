"""A noisy neighbour: one process that keeps one core busy at a duty cycle, for benchmarks on shared hosts.

    with Noise(duty=0.5):                 # 5 ms busy, 5 ms asleep, in its own process
        run_the_engine()
    python streamattn/bench/noise.py --duty 0.5 --period-ms 10 --lifetime 60     # the process itself

Users run on hosts whose cores are shared (cloud VMs, laptops with other work): a worker thread that
the host deschedules for a time slice stalls every fork/join it takes part in. The neighbour is a
single-threaded busy loop, so it takes at most one core at a time, and the scheduler may move it.

Bounded on every path: the process exits by itself after ``lifetime`` seconds, and as soon as its parent
is gone (it polls its parent pid every period, so a parent killed by SIGKILL leaves nothing behind); the
context manager kills and reaps it on leaving the block, whether by return, exception or Ctrl-C (the
process also shares the terminal's process group, so Ctrl-C reaches it directly).

Standard library only, and runnable as a file: benchmarks/peer_llamacpp.py loads it by path, so that its
own process never imports streamattn's package (whose __init__ loads Numba, see resolve_path there).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _check(duty: float, period_ms: float, lifetime: float) -> None:
    if isinstance(duty, bool) or not isinstance(duty, (int, float)) or not 0.0 <= duty <= 1.0:
        raise ValueError(f"duty must be a fraction in [0, 1] (got {duty!r}); e.g. 0.5 for 5 ms busy of 10")
    if isinstance(period_ms, bool) or not isinstance(period_ms, (int, float)) or not 1.0 <= period_ms <= 1000.0:
        raise ValueError(f"period_ms must be in [1, 1000] milliseconds (got {period_ms!r})")
    if isinstance(lifetime, bool) or not isinstance(lifetime, (int, float)) or not 0.0 < lifetime <= 86400.0:
        raise ValueError(f"lifetime must be in (0, 86400] seconds (got {lifetime!r})")


def spin(duty: float, period_ms: float, lifetime: float, parent: int) -> None:
    """Busy for ``duty`` of every period, asleep for the rest, until ``lifetime`` seconds have passed or
    the process ``parent`` is no longer our parent. Periods are laid on a fixed grid: one lost to a
    descheduling is skipped, not caught up (which would raise the duty above what was asked)."""
    period = period_ms / 1e3
    busy = duty * period
    t0 = time.perf_counter()
    end = t0 + lifetime
    start = t0
    while start < end and os.getppid() == parent:
        stop = start + busy
        while time.perf_counter() < stop:
            pass
        now = time.perf_counter()
        start += period
        if now > start:                                   # whole periods lost: drop them, keep the phase
            start += period * int((now - start) / period)
        elif start > now:
            time.sleep(start - now)


class Noise:
    """The neighbour process over a ``with`` block (nothing at ``duty`` 0).

    Parameters
    ----------
    duty : float
        Fraction of each period spent busy, in [0, 1]; 0 starts no process (a quiet run).
    period_ms : float
        Busy plus asleep, in [1, 1000] ms (default 10: 5 ms busy and 5 asleep at duty 0.5).
    lifetime : float
        Seconds after which the process exits by itself, in (0, 86400]: a bound for a block that hangs.

    Attributes
    ----------
    proc : subprocess.Popen or None
        The running process inside the block.
    cpu_s, wall_s : float
        After the block: the process's user + system CPU seconds (from ``os.wait4``) and its wall time,
        so ``cpu_s / wall_s`` is the duty it achieved.

    Raises
    ------
    ValueError
        A parameter outside its range, naming it, before anything starts.
    """

    def __init__(self, duty: float = 0.5, *, period_ms: float = 10.0, lifetime: float = 600.0):
        _check(duty, period_ms, lifetime)
        self.duty, self.period_ms, self.lifetime = float(duty), float(period_ms), float(lifetime)
        self.proc = None
        self.cpu_s = self.wall_s = 0.0

    def command(self) -> list:
        return [sys.executable, os.path.abspath(__file__), "--duty", repr(self.duty), "--period-ms",
                repr(self.period_ms), "--lifetime", repr(self.lifetime), "--parent", str(os.getpid())]

    def __enter__(self):
        if self.duty > 0:
            self._t0 = time.perf_counter()
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        """Kill and reap the process (idempotent); fills :attr:`cpu_s` and :attr:`wall_s`."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.returncode is None:
            proc.kill()
            _, _, usage = os.wait4(proc.pid, 0)
            proc.returncode = -9
            self.cpu_s = usage.ru_utime + usage.ru_stime
        self.wall_s = time.perf_counter() - self._t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duty", type=float, default=0.5, help="busy fraction of each period, in [0, 1]")
    p.add_argument("--period-ms", type=float, default=10.0, help="busy + asleep, ms")
    p.add_argument("--lifetime", type=float, default=600.0, help="seconds before it exits by itself")
    p.add_argument("--parent", type=int, default=None, help="exit once this pid is no longer the parent "
                                                               "(default: the parent at start)")
    args = p.parse_args(argv)
    try:
        _check(args.duty, args.period_ms, args.lifetime)
    except ValueError as e:
        p.error(str(e))
    try:
        spin(args.duty, args.period_ms, args.lifetime, args.parent if args.parent is not None else os.getppid())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
