"""The machine's read-bandwidth ceiling, measured the way a decode kernel reads: a Numba parallel sum."""

from __future__ import annotations

import time

import numpy as np
from numba import njit, prange, get_num_threads


@njit(parallel=True, fastmath=True, cache=True)
def _parallel_sum(a, nparts):
    """a: [n] float32. Each part sums a slice (a loop over a slice vectorises; over a range of a it did not)."""
    per = (a.shape[0] + nparts - 1) // nparts
    partial = np.zeros(nparts, np.float64)
    for p in prange(nparts):
        b = a[p * per:min(a.shape[0], (p + 1) * per)]
        s = np.float32(0.0)
        for i in range(b.shape[0]):
            s += b[i]
        partial[p] = s
    return partial.sum()


class Ceiling:
    """Read bandwidth of a ``nbytes`` float32 buffer summed by all Numba threads.

    Call :meth:`probe` right beside each timing; a ceiling measured minutes earlier says little on
    shared hosts (DESIGN.md §6: probes are bimodal, 29–36 or 46–58 GB/s).
    """

    def __init__(self, nbytes: int = 1 << 30):
        self.buf = np.ones(nbytes // 4, np.float32)  # [n] float32, touched so pages are mapped
        self.nparts = 4 * get_num_threads()
        _parallel_sum(self.buf[:1024], self.nparts)

    def probe(self, repeats: int = 3) -> float:
        """Best GB/s of ``repeats`` full passes."""
        best = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            _parallel_sum(self.buf, self.nparts)
            best = max(best, self.buf.nbytes / (time.perf_counter() - t) / 1e9)
        return best
