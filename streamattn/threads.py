"""CPU thread counts of the two pools a decode step uses: OpenBLAS (weight matmuls) and Numba (attention).

Why this exists: a decode step alternates ~120 small BLAS calls with 30 Numba parallel launches. Both
pools spin-wait between calls, so with 2 threads each on a 2-core host they steal each other's cores.
Measured on SmolLM2-135M (scripts/bench_decode.py), one decode step at L=259:

    load avg ~3: 2+2 threads 468 ms (matmuls alone 17 ms, attention alone 1 ms: the pools thrash);
                 1+1 threads 20-22 ms; BLAS 2 + Numba 1 25-32 ms; 2+2 with OMP_WAIT_POLICY=passive 21-24 ms
    load avg ~25: 2+2 threads 0.5-1.4 tok/s; 1+1 threads 41 tok/s

One sequence's decode is latency-bound, so ``set_threads(1)`` is the CLI default; try more threads only
for big batches or long prefills, on a quiet machine, and measure.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os

import numpy as np

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")


def _openblas(names=_SETTERS):
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
    setter = _openblas()
    if setter is not None:
        setter(n)
    return {"blas": setter is not None, "numba": n_numba}


@contextlib.contextmanager
def threads(n: int):
    """Context manager: :func:`set_threads` ``(n)`` inside, the previous counts restored after."""
    import numba
    getter = _openblas(tuple(s.replace("set_", "get_") for s in _SETTERS))
    old_blas = int(getter()) if getter is not None else None
    old_numba = numba.get_num_threads()
    set_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(old_numba)
        if old_blas is not None:
            _openblas()(old_blas)
