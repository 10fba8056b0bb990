"""How fast is a prefill chunk (T queries over the cache and causally over each other)? T in {16, 64}, L in {1k, 4k, 16k}, GQA 32/8, d=64, float16, causal and window.

    PYTHONPATH=. python benchmarks/prefill_chunks.py [--impl cpu,numpy] [--threads 2] [--out out/prefill_chunks]

One question, one script: the points are the "prefill" suite of streamattn.bench.sweep (see its docstring for how each
point is checked, timed and compared with the read ceiling probed beside it). Prints the table, writes
out/prefill_chunks/bench.json and bench.png.
"""

import sys

from streamattn.bench import sweep as bench

if __name__ == "__main__":
    sys.exit(bench.main(["--suite", "prefill", "--out", "out/prefill_chunks", *sys.argv[1:]]))
