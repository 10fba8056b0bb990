"""How close does decode get to the read ceiling? L in {1k, 4k, 16k, 64k}, MHA 8/8 and GQA 32/8, head_dim 64 and 128, float32 and float16, batch 1, causal (issue 2's grid).

    PYTHONPATH=. python benchmarks/decode_bandwidth.py [--impl cpu,numpy] [--threads 2] [--out out/decode_bandwidth]

One question, one script: the points are the "decode" suite of streamattn.bench.sweep (see its docstring for how each
point is checked, timed and compared with the read ceiling probed beside it). Prints the table, writes
out/decode_bandwidth/bench.json and bench.png.
"""

import sys

from streamattn.bench import sweep as bench

if __name__ == "__main__":
    sys.exit(bench.main(["--suite", "decode", "--out", "out/decode_bandwidth", *sys.argv[1:]]))
