"""What a start costs with and without the packed weights' disk cache: ``load_gguf`` seconds, and the wall
time and peak RSS of ``streamattn generate -n 1``, each in a fresh process.

    PYTHONPATH=. python benchmarks/packed_start.py --model /work/fixtures/llama-3.2-1b-q4_k_m.gguf --rounds 2

Per round, in this order: packed in memory (``STREAMATTN_PACKED_CACHE=off``), cold (an empty cache folder:
packed and written), warm (mapped from it). Each mode runs a process that times ``load_gguf`` alone, then
``streamattn generate -n 1`` under ``/usr/bin/time -v`` (its wall time and maximum RSS). The host's load
average is recorded beside each run: on a shared host the seconds move with it, the RSS does not. The
Numba kernel cache should be warm first (one ``generate`` before): compiles are another question
(benchmarks/compile_per_storage.py). The logits are checked elsewhere (tests/test_packed_cache.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LOAD = ("import sys, time; t = time.perf_counter(); from streamattn.gguf.loader import load_gguf; "
         "i = time.perf_counter(); load_gguf(sys.argv[1]); print(i - t, time.perf_counter() - i)")


def _load_avg() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def run(model: str, mode: str, cache: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, STREAMATTN_PACKED_CACHE="off" if mode == "memory" else cache)
    if mode == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    before = _load_avg()
    out = subprocess.run([sys.executable, "-c", _LOAD, model], env=env, capture_output=True, text=True, check=True)
    imports, load = map(float, out.stdout.split())
    if mode == "cold":
        shutil.rmtree(cache, ignore_errors=True)      # generate's own cold start, not the one above's file
    gen = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "streamattn.cli", "generate", "--model",
                          model, "-n", "1", "Hello there"], env=env, capture_output=True, text=True, check=True)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", gen.stderr).group(1)
    seconds = sum(float(p) * 60 ** i for i, p in enumerate(reversed(wall.split(":"))))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", gen.stderr).group(1)) * 1024
    return {"mode": mode, "load_gguf_s": round(load, 2), "import_s": round(imports, 2),
            "generate_wall_s": round(seconds, 2), "generate_max_rss_mb": round(rss / 1e6, 1),
            "load_avg": [before, _load_avg()]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the runs as JSON here")
    args = ap.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="packed_start_")
    runs = []
    try:
        for _ in range(args.rounds):
            for mode in ("memory", "cold", "warm"):
                runs.append(run(args.model, mode, cache))
                print(json.dumps(runs[-1]), flush=True)
        packed = [f for f in os.listdir(cache) if f.endswith(".packed")]
        sizes = {"gguf_mb": round(os.path.getsize(args.model) / 1e6, 1),
                 "packed_mb": round(os.path.getsize(os.path.join(cache, packed[0])) / 1e6, 1) if packed else None}
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(sizes))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, **sizes, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
