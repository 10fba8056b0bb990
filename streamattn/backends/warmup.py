"""Before a timed run: is the CPU attention kernel compiled yet, and compile (or load) it now.

Numba compiles on first use and caches on disk; after a fresh install the first ``generate`` spent ~8.5 s
compiling, which ``--stats`` then reported as prefill time. The CLI says so once and warms the kernels
before the clock starts.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..spec import STORAGE, row_width
from . import cpu


def kernels_cached() -> bool:
    """Whether Numba's on-disk cache already holds the attention kernel (False: the first call compiles it,
    ~10 s after a fresh install)."""
    try:
        return Path(cpu.attend_pages._cache._cache_file._index_path).exists()
    except (AttributeError, OSError):   # no cache, or numba internals moved: say nothing
        return True


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
