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
        return any(Path(cpu._attend_pages._cache._cache_path).glob("*_attend_pages-*.nbi"))
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


def warm_model(model, kind: str) -> float:
    """Run ``model`` (a CPU :class:`~streamattn.models.transformer.Transformer`) once on throwaway caches:
    a chunk of :data:`~streamattn.models.qmatmul.ROWS` tokens, then one token, so that every kernel a
    prefill and a decode step call (the packed matmul drivers of each weight kind, the fused norm and
    activation quantizers, attention for storage ``kind``) is compiled or loaded from Numba's cache now,
    outside any timing, as llama.cpp's warm-up decode does. Seconds taken.

    Loading the matmul drivers of one weight kind took 0.3-1.3 s in a fresh process (docs/PERF.md), which
    a timed prefill had counted."""
    from streamattn.models.qmatmul import ROWS
    t0 = time.perf_counter()
    caches = model.new_caches(batch=1, max_chunk=ROWS, dtype=kind)
    model.forward(np.zeros((1, ROWS), np.int64), caches, last_only=True)
    model.forward(np.zeros((1, 1), np.int64), caches, last_only=True)
    return time.perf_counter() - t0
