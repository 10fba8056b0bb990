"""What does a KV cache save? At L=4k (MHA 8/8, d=64, float32): cached decode of one new token vs recomputing causal attention for all L positions (K/V projections aside), as one row.

    PYTHONPATH=. python benchmarks/recompute_vs_cache.py [--impl cpu,numpy] [--threads 2] [--out out/recompute_vs_cache]

One question, one script: the points are the "recompute" suite of streamattn.bench.sweep (see its docstring for how each
point is checked, timed and compared with the read ceiling probed beside it). Prints the table, writes
out/recompute_vs_cache/bench.json and bench.png.
"""

import sys

from streamattn.bench import sweep as bench

if __name__ == "__main__":
    sys.exit(bench.main(["--suite", "recompute", "--out", "out/recompute_vs_cache", *sys.argv[1:]]))
