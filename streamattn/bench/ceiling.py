"""The machine's read-bandwidth ceiling: the best read rate any code here reaches over a big buffer.

A probe is a ceiling only if no kernel beats it. The first probe (a Numba parallel sum, LLVM's own
vectorisation) read less than the attention kernels do: ``streamattn bench --suite decode`` showed the
CPU kernel at 110-122% of it (float32 and float16, L = 16k). The kernels load 16-lane vectors and, for
some shapes, prefetch each line PREFETCH_BYTES ahead (streamattn/kv/backends/cpu_simd.py). So the probe now
times several readers over the same buffer and reports the best:

- ``sum`` 1 or 2 streams: the first probe (a loop over a slice vectorises; over a range it did not);
- ``vec``: 64-float rows read with the kernels' own 16-lane loads into four accumulators, no prefetch;
- ``vec+pf``: the same with the kernels' T0 prefetch of each line PREFETCH_BYTES ahead;

each with all Numba threads and with one thread (on these shared 2-core hosts one busy thread can read
faster than two that contend with other tenants). docs/ceiling_probe.md records the comparison.
"""

from __future__ import annotations

import time

import numba
import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..runtime import kernel_cache
from ..kv.backends import cpu_simd
from ..runtime import llvm_ir
from ..kv.backends.cpu_simd import prefetch_line
from ..runtime.llvm_ir import VF, W, Rows, c_arrays, const, load16

kernel_cache.register(__name__, depends_on=[cpu_simd, llvm_ir])

ROW = 64                    # floats per row of the vector readers' view of the buffer: four 16-lane loads


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


@intrinsic
def _read_rows(typingctx, x, lo, hi, prefetch):
    """Sum of x[lo:hi] (x: [n, 64] float32, C order) read with the kernels' 16-lane loads into four
    vector accumulators (one per chunk of a row); ``prefetch``: also the kernels' T0 prefetch
    PREFETCH_BYTES ahead of every line. Returns float32."""
    if not (c_arrays(x) and x.ndim == 2 and x.dtype == types.float32):
        return None

    def codegen(context, builder, sig, args):
        xa = Rows(context, builder, sig.args[0], args[0])
        lo_v, hi_v, pf = args[1], args[2], args[3]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(VF, [0.0] * W)) for _ in range(ROW // W)]

        def emit(with_prefetch):
            with cgutils.for_range_slice(builder, lo_v, hi_v, const(1)) as (row, _):
                for c, acc in enumerate(accs):
                    col = const(c * W)
                    if with_prefetch:
                        prefetch_line(builder, xa, row, col)
                    builder.store(builder.fadd(builder.load(acc), load16(builder, xa, row, col, 0)), acc)

        with builder.if_else(cgutils.as_bool_bit(builder, pf)) as (yes, no):
            with yes:
                emit(True)
            with no:
                emit(False)
        total = builder.load(accs[0])
        for acc in accs[1:]:
            total = builder.fadd(total, builder.load(acc))
        lanes = [builder.extract_element(total, ir.Constant(ir.IntType(32), i)) for i in range(W)]
        out = lanes[0]
        for v in lanes[1:]:
            out = builder.fadd(out, v)
        return out
    return types.float32(x, lo, hi, prefetch), codegen


@njit(parallel=True, cache=True)
def _vector_read(rows, nparts, prefetch):
    """rows: [n, 64] float32. Sum of all elements, part p of nparts reading rows [p*per, (p+1)*per)."""
    n = rows.shape[0]
    per = (n + nparts - 1) // nparts
    partial = np.zeros(nparts, np.float64)
    for p in prange(nparts):
        partial[p] = _read_rows(rows, min(n, p * per), min(n, (p + 1) * per), prefetch)
    return partial.sum()


READERS = ("sum", "sum2", "vec", "vec+pf")      # the probe's readers, see the module docstring


class Ceiling:
    """Read bandwidth of a ``nbytes`` float32 buffer: the best of several readers and thread counts.

    Call :meth:`probe` right beside each timing; a ceiling measured minutes earlier says little on
    shared hosts (probes there are bimodal: docs/PERF.md, "The host's two bandwidth modes").

    Parameters
    ----------
    nbytes : int
        Buffer size; keep it well above the last-level cache (default 1 GiB).
    """

    def __init__(self, nbytes: int = 1 << 30):
        n = max(ROW, nbytes // 4 // ROW * ROW)
        self.buf = np.ones(n, np.float32)          # [n] float32, touched so pages are mapped
        self.rows = self.buf.reshape(-1, ROW)       # [n / 64, 64]: the vector readers' view
        self.threads = sorted({1, get_num_threads()})
        self.last = {}                              # (reader, threads) -> GB/s of the last probe
        for reader in READERS:                      # compile (or load from cache) before any timing
            self._read(reader, 4, self.buf[:4 * ROW], self.rows[:4])

    @staticmethod
    def _read(reader, nparts, flat, rows):
        if reader.startswith("sum"):
            return _parallel_sum(flat, nparts, 2 if reader == "sum2" else 1)
        return _vector_read(rows, nparts, reader == "vec+pf")

    def probe(self, repeats: int = 3) -> float:
        """Best GB/s over ``repeats`` rounds; each round runs every reader with every thread count once.

        Returns
        -------
        float
            The best rate seen; :attr:`last` keeps each (reader, threads) pair's best of this call.
        """
        before = get_num_threads()
        self.last = {}
        try:
            for _ in range(repeats):
                for threads in self.threads:
                    numba.set_num_threads(threads)
                    for reader in READERS:
                        t = time.perf_counter()
                        self._read(reader, 4 * threads, self.buf, self.rows)
                        gbps = self.buf.nbytes / (time.perf_counter() - t) / 1e9
                        self.last[reader, threads] = max(self.last.get((reader, threads), 0.0), gbps)
        finally:
            numba.set_num_threads(before)
        return max(self.last.values())

    def evict(self) -> None:
        """Read the whole buffer once (one vector pass at the current thread count), so that what the
        next timed call reads comes from memory rather than from a last-level cache that kept it since an
        earlier call (a buffer of twice the LLC evicts it; the default 1 GiB is that on every host seen)."""
        self._read("vec", 4 * get_num_threads(), self.buf, self.rows)

    def bracket(self, fn, calls: int, start: int = 0, cold: bool = False) -> tuple[float, float]:
        """Time ``fn(i)`` for ``i = start .. start + calls - 1`` between two one-pass probes; ``cold``:
        :meth:`evict` before each call (untimed).

        Returns
        -------
        (float, float)
            The median seconds of a call, and the higher of the two probes (GB/s): the ceiling the
            calls are filed against (a host's bandwidth mode can change while they run).
        """
        before = self.probe(1)
        times = []
        for i in range(start, start + calls):
            if cold:
                self.evict()
            t = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t)
        return float(np.median(times)), max(before, self.probe(1))
