"""How does decode throughput scale with batch? B in {1, 2, 4, 8} at L=4k, MHA 8/8 and GQA 32/8, d=64, float16.

    PYTHONPATH=. python benchmarks/batch_scaling.py [--impl cpu,numpy] [--threads 2] [--out out/batch_scaling]

One question, one script: the points are the "batch" suite of streamattn.bench.sweep (see its docstring for how each
point is checked, timed and compared with the read ceiling probed beside it). Prints the table, writes
out/batch_scaling/bench.json and bench.png.
"""

import sys

from streamattn.bench import sweep as bench

if __name__ == "__main__":
    sys.exit(bench.main(["--suite", "batch", "--out", "out/batch_scaling", *sys.argv[1:]]))
