"""The machine's read-bandwidth ceiling, measured the way a decode kernel reads: a Numba parallel sum."""

from __future__ import annotations

import time

import numpy as np
from numba import njit, prange, get_num_threads


@njit(parallel=True, fastmath=True, cache=True)
def _parallel_sum(a, nparts, streams):
    """a: [n] float32. Each part sums a slice (a loop over a slice vectorises; over a range of a it did
    not), as one sequential stream or as two (its halves side by side, as decode reads K and V)."""
    per = (a.shape[0] + nparts - 1) // nparts
    partial = np.zeros(nparts, np.float64)
    for p in prange(nparts):
        b = a[p * per:min(a.shape[0], (p + 1) * per)]
        s = np.float32(0.0)
        if streams == 2:
            h = b.shape[0] // 2
            x, y = b[:h], b[h:2 * h]
            for i in range(h):
                s += x[i] + y[i]
            for i in range(2 * h, b.shape[0]):
                s += b[i]
        else:
            for i in range(b.shape[0]):
                s += b[i]
        partial[p] = s
    return partial.sum()


class Ceiling:
    """Read bandwidth of a ``nbytes`` float32 buffer summed by all Numba threads.

    Call :meth:`probe` right beside each timing; a ceiling measured minutes earlier says little on
    shared hosts (docs/PERF.md: the probes are bimodal).
    """

    def __init__(self, nbytes: int = 1 << 30):
        self.buf = np.ones(nbytes // 4, np.float32)  # [n] float32, touched so pages are mapped
        self.nparts = 4 * get_num_threads()
        _parallel_sum(self.buf[:1024], self.nparts, 1)

    def probe(self, repeats: int = 3) -> float:
        """Best GB/s of ``repeats`` rounds of full passes, one stream per part and two streams per part.

        Two streams read ~5% faster here (44.7 vs 42.8 GB/s, best of each in six rounds); the ceiling is
        whichever is higher, so a kernel that reads K and V side by side is not measured against the
        slower pattern.
        """
        best = 0.0
        for _ in range(repeats):
            for streams in (1, 2):
                t = time.perf_counter()
                _parallel_sum(self.buf, self.nparts, streams)
                best = max(best, self.buf.nbytes / (time.perf_counter() - t) / 1e9)
        return best
