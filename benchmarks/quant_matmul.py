"""Packed-weight matmul kernels (streamattn/quant/matmul.py) against float32 numpy, alternated.

    PYTHONPATH=. python benchmarks/quant_matmul.py [--repeats 7] [--rows 1,4,64,256] [--group-rows 1,2,4,8]
        [--threads 1] [--types Q4_1,Q8_0]

For the matrix shapes of SmolLM2-135M (Q4_1) and Gemma-3-270M (Q5_0, Q4_K, Q6_K, Q8_0): median time of
``x @ W.T`` for M activation rows (1 = a decode step, 4+ = prefill chunks), the packed kernel with each
``group_rows`` R (activation rows per weight-block unpacking; R = 1 is the one-row kernel) beside
``x @ W_f32.T`` (numpy/OpenBLAS on the dequantized matrix). Variants alternate within each repeat;
outputs of every R are checked bit-identical before timing. Also the route not taken: a plain-Numba
float FMA over unpacked Q4_1 nibbles (route (a) of issue 13), which LLVM did not vectorise.
"""

import argparse
import statistics
import time

import numpy as np
from numba import njit

from streamattn.quant.matmul import qmatmul
from streamattn.quant.weights import pack
from streamattn.runtime.threads import set_threads

SHAPES = [("Q4_1", 1536 * 2, 576), ("Q4_1", 576, 1536), ("Q8_0", 49152, 576), ("Q5_0", 2048 * 2, 640),
          ("Q4_K", 640, 1024), ("Q6_K", 640, 2048)]


@njit(fastmath=True, cache=True)
def q4_float_route(qs, scale, minv, x, out):
    """Route (a): unpack nibbles to float and FMA with float32 activations (plain Numba)."""
    nb = scale.shape[1]
    xs = np.empty(nb, np.float32)
    for i in range(nb):
        s = np.float32(0.0)
        for j in range(32):
            s += x[i * 32 + j]
        xs[i] = s
    for r in range(qs.shape[0]):
        acc = np.float32(0.0)
        for i in range(nb):
            s = np.float32(0.0)
            for j in range(16):
                q = qs[r, i * 16 + j]
                s += np.float32(q & 15) * x[i * 32 + j] + np.float32(q >> 4) * x[i * 32 + 16 + j]
            acc += scale[r, i] * s + minv[r, i] * xs[i]
        out[r] = acc


def packed(type_name, n, k, rng):
    import gguf
    from gguf.quants import quantize
    if type_name in ("Q4_K", "Q6_K"):
        size = {"Q4_K": 144, "Q6_K": 210}[type_name]
        b = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
        sc = (rng.random((n, k // 256, 2)) * 0.02).astype(np.float16).view(np.uint8)
        if type_name == "Q4_K":
            b[..., 0:4] = sc.reshape(n, k // 256, 4)
        else:
            b[..., 208:210] = sc[..., 0:2]
        data = b.reshape(n, -1)
    else:
        data = quantize(rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType[type_name])
    return pack("w", type_name, data, (n, k))


def timed(fn, reps):
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", default="1,4,64,256", help="activation rows M, comma-separated")
    ap.add_argument("--group-rows", default="1,2,4,8", help="kernel variants R, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types", default="", help="only these GGUF types (default: every shape)")
    args = ap.parse_args()
    set_threads(args.threads)
    par = args.threads > 1
    rng = np.random.default_rng(0)
    group_rows = [int(r) for r in args.group_rows.split(",")]
    heads = " ".join(f"{'R=' + str(r) + ' us':>10s}" for r in group_rows)
    print(f"threads {args.threads}; median of {args.repeats}; Gw/s = weights x rows / s of the best R")
    print(f"{'type':5s} {'N x K':>12s} {'M':>4s} {heads} {'f32 us':>9s} {'best/R=1':>8s} {'f32/best':>8s} {'Gw/s':>6s}")
    for type_name, n, k in SHAPES:
        if args.types and type_name not in args.types.split(","):
            continue
        w = packed(type_name, n, k, rng)
        wf = w.dequantize()
        for m in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((m, k)).astype(np.float32)
            ref = qmatmul(x, w, parallel=par, group_rows=1)
            for r in group_rows:                                # every R gives the same bits
                assert np.array_equal(qmatmul(x, w, parallel=par, group_rows=r), ref), (type_name, m, r)
            reps = max(2, int(1e8 / (n * k * m)))
            times = {r: [] for r in group_rows + ["f32"]}
            for _ in range(args.repeats):                       # alternated
                for r in group_rows:
                    times[r].append(timed(lambda: qmatmul(x, w, parallel=par, group_rows=r), reps))
                times["f32"].append(timed(lambda: x @ wf.T, reps))
            med = {r: statistics.median(t) for r, t in times.items()}
            best = min(group_rows, key=med.get)
            cols = " ".join(f"{med[r] * 1e6:10.1f}" for r in group_rows)
            print(f"{type_name:5s} {n:>5d} x {k:<5d} {m:>4d} {cols} {med['f32'] * 1e6:9.1f} "
                  f"{med.get(1, med[best]) / med[best]:8.2f} {med['f32'] / med[best]:8.2f} "
                  f"{n * k * m / med[best] / 1e9:6.2f}  (best R={best})", flush=True)
    if 1 not in group_rows:
        return
    w = packed("Q4_1", 3072, 576, rng)
    x = rng.standard_normal(576).astype(np.float32)
    out = np.empty(3072, np.float32)
    qs, scale, minv = w.row_major()                         # nibble bytes [N, K/2], float32 scales
    ta, tb = [], []
    for _ in range(args.repeats):
        ta.append(timed(lambda: q4_float_route(qs, scale, minv, x, out), 20))
        tb.append(timed(lambda: qmatmul(x[None], w, parallel=False), 20))
    want = w.dequantize().astype(np.float64) @ x                # route (a) must compute the matmul it times
    if not np.allclose(out, want, rtol=1e-4, atol=1e-3 * np.abs(want).max()):
        raise SystemExit("route (a) disagrees with the dequantized matmul: its timing would mean nothing")
    a, b = statistics.median(ta), statistics.median(tb)
    print(f"Q4_1 3072 x 576, one row: route (a) float unpack + FMA (plain Numba) {a * 1e6:.1f} us, "
          f"route (b) 8-bit activations + integer dot (IR kernel) {b * 1e6:.1f} us: (b) {a / b:.1f}x faster")


if __name__ == "__main__":
    main()
