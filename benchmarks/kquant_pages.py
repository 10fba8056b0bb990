"""The one-row Q4_K / Q6_K GEMV from memory, in 4 KiB pages and in huge pages: with and without the drivers'
prefetch settings.

    PYTHONPATH=. python benchmarks/kquant_pages.py [--repeats 7] [--pages 4k,huge] [--shapes q4k_2048x8192,...]

A decode step reads each weight once, from a model file's pages (4 KiB: a file mapping gets no huge pages),
and the hardware prefetcher that follows a row group's reads stops at each page's end. Per Llama-3.2-1B
shape (``--shapes``), one thread runs the one-row kernel (:func:`streamattn.quant.kernels.make_qdot`, R = 1)
over every row group of ~400 MB of copies of the matrix (random block bytes, float16 super-block scales:
the kernels' time does not depend on the values), so every byte comes from memory: once as the drivers
build it (:data:`~streamattn.quant.matmul.ONE_ROW_PREFETCH_BYTES`, :data:`~streamattn.quant.matmul.TOUCH_BYTES`)
and once with no software prefetch, alternated, after a check that both give the same bits (and
:func:`~streamattn.quant.matmul.qmatmul`'s on the first group: the harness calls the kernel right). The buffers
are numpy's, which asks for huge pages on big arrays; ``4k`` turns that off before allocating. Prints the
median CPU time of each (``time.process_time``: the host is shared, and a descheduled thread's wait is not
the kernel's) as GB/s of the weights' bytes, and the load average.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from numba import njit, set_num_threads

from streamattn.quant import matmul as qm
from streamattn.quant.kernels import LANES, LANES_VNNI, make_qdot
from streamattn.quant.weights import QWeight

#: name -> (kind, rows, cols) of Llama-3.2-1B's matrices: attn_output / attn_q, ffn_gate/up, ffn_down, the head.
SHAPES = {"q4k_2048x2048": ("q4k", 2048, 2048), "q4k_8192x2048": ("q4k", 8192, 2048),
          "q4k_2048x8192": ("q4k", 2048, 8192), "q6k_2048x8192": ("q6k", 2048, 8192),
          "q6k_128256x2048": ("q6k", 128256, 2048)}
CYCLED = 400e6                                  # bytes of copies a timing reads: well past the LLC


def _load() -> list:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def _driver(dot):
    @njit
    def run(qs, scale, minv, xq, xd, xs, xc, out):
        for g in range(qs.shape[0]):            # every group of every copy once: a decode step's one pass
            dot(qs, scale, minv, g, xq, xd, xs, xc, 0, out)
    return run


def planes(kind: str, n: int, k: int, rng):
    """Random planes of a packed weight of ``kind`` [n, k], repeated to ~CYCLED bytes (as more groups)."""
    per_row = {"q4k": 0.5625, "q6k": 0.8203}[kind] * k
    groups = n // LANES * max(1, int(CYCLED // (n * per_row)))
    row_bytes = (140 * (k // 256) if kind == "q4k" else 104 * (k // 128)) * LANES
    qs = rng.integers(0, 256, (groups, row_bytes), dtype=np.uint8)
    scale = (rng.random((groups, k // 256 * LANES)) * 0.02 + 0.001).astype(np.float16).view(np.uint16)
    minv = (-(rng.random(scale.shape) * 0.02)).astype(np.float16).view(np.uint16) if kind == "q4k" else None
    return qs, scale, minv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--pages", default="4k,huge")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"one thread, {LANES} lanes, vnni {LANES_VNNI}; median CPU time of {args.repeats}; "
          f"load {_load()}")
    for pages in args.pages.split(","):
        core = getattr(np, "_core", None) or np.core                  # numpy 2 renamed it
        core.multiarray._set_madvise_hugepage(pages == "huge")       # numpy's own switch (on by default)
        for name in args.shapes.split(","):
            kind, n, k = SHAPES[name]
            qs, scale, minv = planes(kind, n, k, rng)
            m = np.zeros((1, 1), np.float32) if minv is None else minv
            x = rng.standard_normal((1, k)).astype(np.float32)
            xq, xd, xs, xc = qm.quantize_activations(x)
            group = 16 if kind == "q6k" else 32
            kernels = {"none": make_qdot(kind, group, 1, LANES, LANES_VNNI),
                       "plan": make_qdot(kind, group, 1, LANES, LANES_VNNI,
                                             qm.ONE_ROW_PREFETCH_BYTES.get(kind, 0), qm.TOUCH_BYTES.get(kind, 0))}
            runs, outs = {}, {}
            for v, dot in kernels.items():
                runs[v], outs[v] = _driver(dot), np.zeros((1, qs.shape[0] * LANES), np.float32)
                runs[v](qs, scale, m, xq, xd, xs, xc, outs[v])
            assert np.array_equal(outs["none"], outs["plan"]), name    # a prefetch changes no result
            # the harness calls the kernel as qmatmul does
            first = QWeight(kind, (LANES, k), qs[:1], scale[:1], None if minv is None else minv[:1],
                            group=group, source=name, lanes=LANES)
            assert np.array_equal(outs["none"][:, :LANES], qm.qmatmul(x, first, parallel=False)), name
            times = {v: [] for v in kernels}
            for _ in range(args.repeats):
                for v in kernels:
                    t = time.process_time()
                    runs[v](qs, scale, m, xq, xd, xs, xc, outs[v])
                    times[v].append(time.process_time() - t)
            nbytes = qs.nbytes + scale.nbytes + (0 if minv is None else minv.nbytes)
            med = {v: statistics.median(t) for v, t in times.items()}
            print(f"{pages:4s} {name:16s} {nbytes / 1e6:5.0f} MB: none {nbytes / med['none'] / 1e9:5.1f} GB/s, "
                  f"drivers' {nbytes / med['plan'] / 1e9:5.1f} GB/s (x{med['none'] / med['plan']:.2f})", flush=True)
            del qs, scale, minv
    print(f"load {_load()}")


if __name__ == "__main__":
    main()
