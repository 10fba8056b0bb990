"""Every packed GGUF type's matmul on one matrix shape: time, weights/s and resident bytes/s, beside the
read ceiling, and resident vs file bytes per weight (docs/perf/2026-12-02.md, "more GGUF types").

    PYTHONPATH=. python benchmarks/quant_types.py [--rows-n 16384] [--cols 2048] [--m 1,16] [--repeats 7]
        [--types Q4_1,Q5_K] [--threads 1]

Types gguf-py cannot quantize (K-quants, IQ4) are random blocks with float16 scales in [0.001, 0.021]
(tests/_model_util.py: random bytes are valid blocks). Each type is checked against ``x @ W.T`` over
``gguf.quants.dequantize`` before timing; the types alternate within each repeat; medians are reported,
and the 1-thread read ceiling (streamattn.bench.ceiling) is probed before and after each repeat.
"""

import argparse
import statistics
import time

import gguf
import numpy as np

from streamattn.bench.ceiling import Ceiling
from streamattn.quant.matmul import qmatmul
from streamattn.quant.weights import SUPPORTED_TYPES, pack
from streamattn.runtime.threads import set_threads

#: (block columns, block bytes, offset of the float16 scales, their count) of the types gguf-py cannot
#: quantize (the same table as tests/_model_util.py's RANDOM_BLOCKS).
RANDOM = {"Q4_K": (256, 144, 0, 2), "Q6_K": (256, 210, 208, 1), "Q5_K": (256, 176, 0, 2), "Q3_K": (256, 110, 108, 1),
          "Q2_K": (256, 84, 80, 2), "IQ4_NL": (32, 18, 0, 1), "IQ4_XS": (256, 136, 0, 1)}


def file_bytes(type_name, n, k, rng):
    """uint8 [n, bytes per row] of GGUF type ``type_name``."""
    if type_name not in RANDOM:
        x = rng.standard_normal((n, k)).astype(np.float32)
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType[type_name])
    bc, size, at, count = RANDOM[type_name]
    blocks = rng.integers(0, 256, (n, k // bc, size), dtype=np.uint8)
    d = (rng.random((n, k // bc, count)) * 0.02 + 0.001).astype(np.float16)
    blocks[..., at:at + 2 * count] = d.view(np.uint8).reshape(n, k // bc, 2 * count)
    return blocks.reshape(n, -1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows-n", type=int, default=16384, help="weight rows N")
    ap.add_argument("--cols", type=int, default=2048, help="weight columns K (a multiple of 256)")
    ap.add_argument("--m", default="1,16", help="activation rows M, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--types", default=",".join(t for t in SUPPORTED_TYPES if t.startswith(("Q", "IQ"))))
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    set_threads(a.threads)
    n, k = a.rows_n, a.cols
    rng = np.random.default_rng(0)
    types, ms = a.types.split(","), [int(m) for m in a.m.split(",")]
    ws, file_bpw = {}, {}
    for t in types:
        data = file_bytes(t, n, k, rng)
        file_bpw[t] = data.nbytes / (n * k)
        ws[t] = pack("w", t, data, (n, k))
        x = rng.standard_normal((2, k)).astype(np.float32)
        want = x.astype(np.float64) @ gguf.quants.dequantize(data[:64], gguf.GGMLQuantizationType[t]).T
        got = qmatmul(x, ws[t], parallel=a.threads > 1)[:, :64]
        assert np.abs(got - want).max() <= 0.03 * np.abs(want).max(), t          # 8-bit activations
        del data
    xs = {m: rng.standard_normal((m, k)).astype(np.float32) for m in ms}
    ceiling = Ceiling(256 << 20)
    times, ceil = {(t, m): [] for t in types for m in ms}, []
    for _ in range(a.repeats):
        ceil.append(ceiling.probe(1))
        for m in ms:
            for t in types:
                t0 = time.perf_counter()
                qmatmul(xs[m], ws[t], parallel=a.threads > 1)
                times[t, m].append(time.perf_counter() - t0)
        ceil.append(ceiling.probe(1))
    c = statistics.median(ceil)
    print(f"N={n} K={k}, {a.threads} thread(s), read ceiling median {c:.1f} GB/s "
          f"(range {min(ceil):.1f}-{max(ceil):.1f})")
    print(f"{'type':8} {'kind':5} {'file B/w':>8} {'res. B/w':>8} " + " ".join(
        f"{'M=' + str(m) + ' ms':>9} {'Gw/s':>6} {'GB/s':>6} {'%ceil':>5}" for m in ms))
    for t in types:
        w = ws[t]
        res = w.nbytes / (w.qs.shape[0] * w.lanes * k)
        cells = []
        for m in ms:
            s = statistics.median(times[t, m])
            cells.append(f"{s * 1e3:9.2f} {n * k / s / 1e9:6.1f} {w.nbytes / s / 1e9:6.1f} "
                         f"{100 * w.nbytes / s / 1e9 / c:5.0f}")
        print(f"{t:8} {w.kind:5} {file_bpw[t]:8.4f} {res:8.4f} " + " ".join(cells))


if __name__ == "__main__":
    main()
