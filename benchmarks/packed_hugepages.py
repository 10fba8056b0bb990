"""One-thread decode of a model mapped from its packed file, with and without the map's huge-page advice.

    PYTHONPATH=. python benchmarks/packed_hugepages.py [--model /work/fixtures/llama-3.2-1b-q4_k_m.gguf]
        [--runs 3] [--rounds 2] [--steps 24]

:func:`streamattn.quant.packed_file.read` asks for huge pages on the packed file's map (``ADVICE``) and
on the model file's (``SOURCE_ADVICE``); the variant ``4k`` leaves both out (read-ahead on the packed file's
map only, as before). The map is made once a process, so each run is a process of its own: the packed file
is built once in a folder under /tmp, then each run drops the pages of that file and of the model file from
the page cache (``posix_fadvise(DONTNEED)``, no root needed: a fresh read decides the folio sizes), loads
the model, decodes ``--steps`` greedy steps ``--rounds`` times after a 64-token prompt
(``decode_threads.py``'s step, one thread), then times every matmul of a step alone, one after another
(thread CPU time, as GB/s of their weights: the GEMV's read rate from the map), and prints both with how
much of the packed file's map the kernel maps with 2 MiB entries (``FilePmdMapped`` of /proc/self/smaps).
Variants alternate, the load average is printed with each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

#: Each variant's (ADVICE, SOURCE_ADVICE): "4k" as before the huge-page advice (read-ahead on the packed
#: file's map, none on the model file's), "huge" packed_file's own (None: left as it is).
VARIANTS = {"4k": (("MADV_WILLNEED",), ()), "huge": None}


def _child(model: str, folder: str, variant: str, rounds: int, steps: int) -> None:
    import time

    import numpy as np

    from streamattn.gguf.loader import load_gguf
    from streamattn.models.transformer import Transformer
    from streamattn.quant import matmul as qm
    from streamattn.quant import packed_file
    from streamattn.runtime.threads import set_threads

    if VARIANTS[variant] is not None:
        packed_file.ADVICE, packed_file.SOURCE_ADVICE = VARIANTS[variant]
    for path in [model, *(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".packed"))]:
        fd = os.open(path, os.O_RDONLY)            # both maps' pages: the packed file's and the model file's
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    set_threads(1)
    tf = Transformer(load_gguf(model, tokenizer=False, packed_cache=folder))
    MODES = {"wqkv": qm.NORM, "wo": qm.PLAIN, "wgu": qm.NORM, "wdown": qm.SILU}
    rates = []
    for _ in range(rounds):
        caches = tf.new_caches(batch=1, max_chunk=64, dtype="float16")
        tf.forward((np.arange(64)[None] * 7 + 3) % 5000, caches)
        tok, t = 11, time.perf_counter()
        for _ in range(steps):
            tok = int(tf.forward(np.array([[tok]]), caches, last_only=True)[0].argmax())
        rates.append(steps / (time.perf_counter() - t))
    kb, inside = {}, False
    with open("/proc/self/smaps") as f:
        lines = f.readlines()
    for line in lines:
        head = line.split()
        if not line[0].isupper() or ":" not in head[0]:          # a mapping's first line
            inside = head[-1].endswith(".packed")
        elif inside and head[0] in ("Rss:", "FilePmdMapped:"):
            kb[head[0][:-1]] = kb.get(head[0][:-1], 0) + int(head[1])
    calls = [(mode, w) for lw in tf.layers for name, mode in MODES.items()
             for w in (getattr(lw, name) if isinstance(getattr(lw, name), tuple) else [getattr(lw, name)])]
    calls.append((qm.NORM, tf.output))
    nbytes, spent = sum(w.nbytes for _, w in calls), []
    for _ in range(rounds):                      # every matmul of a step alone, one after another
        t = time.thread_time()
        for mode, w in calls:
            x = np.ones((1, w.shape[1] * (2 if mode == qm.SILU else 1)), np.float32)
            tf.matmuls._fused(mode, x, np.ones(x.shape[1], np.float32), 1e-5, w)
        spent.append(time.thread_time() - t)
    print(json.dumps({"tok_s": statistics.median(rates), "runs": rates,
                      "matmul_gb_s": nbytes / statistics.median(spent) / 1e9, **kb}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/work/fixtures/llama-3.2-1b-q4_k_m.gguf")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args.model, args.child[0], args.child[1], args.rounds, args.steps)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def run(folder, variant, rounds):
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--rounds", str(rounds),
                              "--steps", str(args.steps), "--child", folder, variant],
                             check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
        return json.loads(out.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory(prefix="packed_hugepages.", dir="/tmp") as folder:
        run(folder, "huge", 1)                                  # builds the packed file, compiles
        got = {v + " tok/s": [] for v in VARIANTS}
        for r in range(args.runs):
            for v in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
                res = run(folder, v, args.rounds)
                got[v + " tok/s"].append(res["tok_s"])
                with open("/proc/loadavg") as f:
                    load = f.read().split()[:3]
                got.setdefault(v + " matmuls GB/s", []).append(res["matmul_gb_s"])
                rounds = ", ".join(f"{x:.1f}" for x in res["runs"])
                print(f"run {r} {v:4s}: {res['tok_s']:5.1f} tok/s, matmuls {res['matmul_gb_s']:4.1f} GB/s"
                      f" (rounds {rounds});"
                      f" PMD-mapped {res.get('FilePmdMapped', 0) / 1e3:.0f} of {res.get('Rss', 0) / 1e3:.0f} MB;"
                      f" load {load}", flush=True)
        print("medians: " + ", ".join(f"{v} {statistics.median(x):.1f}" for v, x in got.items()))


if __name__ == "__main__":
    main()
