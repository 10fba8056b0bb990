"""Do window and sink rings decode as fast as a causal cache of the same visible length? GQA 32/8, d=64, float16 and bfloat16, L (keys seen) in {1k, 4k, 16k}.

    PYTHONPATH=. python benchmarks/window_modes.py [--impl cpu,numpy] [--threads 2] [--out out/window_modes]

One question, one script: the points are the "modes" suite of streamattn.bench.sweep (see its docstring for how each
point is checked, timed and compared with the read ceiling probed beside it). Prints the table, writes
out/window_modes/bench.json and bench.png.
"""

import sys

from streamattn.bench import sweep as bench

if __name__ == "__main__":
    sys.exit(bench.main(["--suite", "modes", "--out", "out/window_modes", *sys.argv[1:]]))
