"""Before a timed run: is the CPU attention kernel compiled yet, and compile (or load) it now.

Numba compiles on first use and caches on disk; after a fresh install the first ``generate`` spent ~8.5 s
compiling, which ``--stats`` then reported as prefill time. The CLI says so once and warms the kernels
before the clock starts.
"""

from __future__ import annotations

import contextlib
import sys
import time

import numpy as np

from ..spec import STORAGE, row_width
from . import cpu


ATTENTION = "compiling attention kernels (once after an install; Numba caches them) ..."


@contextlib.contextmanager
def notices(lines: dict, out=None):
    """Context manager: while inside, the first time Numba starts compiling one of the dispatchers in
    ``lines`` (``{dispatcher: line}``; a compile, not a load from its disk cache, which fires no event),
    write its line to ``out`` (default: stderr) and flush; each distinct line once. What the CLI says
    before a long first compile: guessing from the cache's files missed a model's other weight kinds and
    thread ceilings, and one kernel's index file existed, empty, before anything was compiled."""
    from numba.core import event
    pending, said = {id(d): line for d, line in lines.items()}, set()

    class _Notice(event.Listener):
        def on_start(self, ev):
            d = ev.data.get("dispatcher") if isinstance(ev.data, dict) else None
            line = pending.get(id(d))
            if line is not None and line not in said:
                said.add(line)
                print(line, file=sys.stderr if out is None else out, flush=True)

        def on_end(self, ev):
            pass
    with event.install_listener("numba:compile", _Notice()):
        yield


def warm(kind: str, kind_v: str | None = None) -> float:
    """Compile (or load from the cache) the kernels for K storage ``kind`` and V storage ``kind_v`` (default
    ``kind``) now, outside any timing; seconds taken."""
    t0 = time.perf_counter()
    kind_v = kind if kind_v is None else kind_v
    k, v = (np.zeros((1, 1, 1, row_width(kd, 16)), STORAGE[kd]) for kd in (kind, kind_v))
    one = np.ones(1, np.int64)
    cpu.attend(np.zeros((1, 1, 1, 16), np.float32), k, v, one, one, window=0, sinks=0, scale=1.0, kind=kind,
               kind_v=kind_v)
    return time.perf_counter() - t0
