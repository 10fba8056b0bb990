"""What does Gemma-2's attention soft cap cost in the CPU decode kernel? (issue 25)

    PYTHONPATH=. python benchmarks/softcap_attention.py [--contexts 512,4096] [--repeats 7] [--threads 1]

One decode query per sequence (Gemma-2 2B's shape: 8 query heads over 4 kv heads of 256, a float16 cache)
attends over ``context`` keys through ``streamattn.kv.backends.cpu.attend``, without a cap and with one of
50 (the models' value), alternating the two in every repeat; before timing, the capped output is
checked against the float64 oracle with the cap. Prints the median microseconds of each, the ratio,
and the K/V bytes read per call over the time, next to the read-bandwidth ceiling probed in the same
run (streamattn.bench.ceiling).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from streamattn.kv import reference
from streamattn.kv.backends import cpu
from streamattn.bench.ceiling import Ceiling
from streamattn.runtime.threads import set_threads

Q_HEADS, KV_HEADS, HEAD_DIM, CAP = 8, 4, 256, 50.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[512, 4096])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    set_threads(args.threads)
    rng = np.random.default_rng(0)
    ceiling = Ceiling(1 << 28)
    print(f"{'context':>7} {'plain us':>9} {'capped us':>10} {'ratio':>6} {'plain GB/s':>10} {'capped GB/s':>11} "
          f"{'ceiling GB/s':>12}")
    for L in args.contexts:
        k = rng.standard_normal((1, KV_HEADS, L, HEAD_DIM)).astype(np.float16)      # [1, Hk, L, D]
        v = rng.standard_normal((1, KV_HEADS, L, HEAD_DIM)).astype(np.float16)
        q = 4 * rng.standard_normal((1, Q_HEADS, 1, HEAD_DIM)).astype(np.float32)   # scores ~ N(0, 4²)
        lengths, counts = np.array([L]), np.array([1])

        def run(cap):
            return cpu.attend(q, k, v, lengths, counts, window=0, sinks=0, scale=HEAD_DIM ** -0.5, kind="float16",
                              softcap=cap)
        want, _ = reference.attention(q[0], k[0], v[0], [L - 1], scale=HEAD_DIM ** -0.5, softcap=CAP)
        got, _ = run(CAP)
        assert np.abs(got[0] - want).max() / np.abs(want).max() <= reference.TOLERANCE["float16"]
        times = {None: [], CAP: []}
        for r in range(args.repeats):
            for cap in ((None, CAP) if r % 2 == 0 else (CAP, None)):
                t = time.perf_counter()
                for _ in range(20):
                    run(cap)
                times[cap].append((time.perf_counter() - t) / 20)
        plain, capped = statistics.median(times[None]), statistics.median(times[CAP])
        nbytes = 2 * k.nbytes
        print(f"{L:>7} {plain * 1e6:>9.1f} {capped * 1e6:>10.1f} {capped / plain:>6.2f} {nbytes / plain / 1e9:>10.1f} "
              f"{nbytes / capped / 1e9:>11.1f} {ceiling.probe(1):>12.1f}")


if __name__ == "__main__":
    main()
