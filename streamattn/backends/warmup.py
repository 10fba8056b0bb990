"""Before a timed run: is the CPU attention kernel compiled yet, and compile (or load) it now.

Numba compiles on first use and caches on disk; after a fresh install the first ``generate`` spent ~8.5 s
compiling, which ``--stats`` then reported as prefill time. The CLI says so once and warms the kernels
before the clock starts.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from . import cpu


def kernels_cached() -> bool:
    """Whether Numba's on-disk cache already holds the attention kernel (False: the first call compiles it,
    ~10 s after a fresh install)."""
    try:
        return any(Path(cpu.attend_pages._cache._cache_path).glob("*attend_pages-*.nbi"))
    except (AttributeError, OSError):   # no cache, or numba internals moved: say nothing
        return True


def warm(kind: str) -> float:
    """Compile (or load from the cache) the kernels for storage ``kind`` now, outside any timing; seconds taken."""
    t0 = time.perf_counter()
    store = np.zeros((1, 1, 1, 16), np.float32 if kind == "float32" else np.uint16 if kind == "bfloat16"
                     else np.float16)
    one = np.ones(1, np.int64)
    cpu.attend(np.zeros((1, 1, 1, 16), np.float32), store, store, one, one, window=0, sinks=0, scale=1.0, kind=kind)
    return time.perf_counter() - t0
