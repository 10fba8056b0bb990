"""How fast does a real model prefill on packed weights, by kernel group rows R and threads? (issue 13, item 4)

    PYTHONPATH=. python benchmarks/prefill_rows.py [--repeats 3] [--rows 1,4] [--threads 1,2] [--chunk 64]
        [--model smollm2-135m] [--no-f32] [--amx off|on|both]

One process, the model loaded once per weight kind. Each variant prefills the ~700-token prompt of
benchmarks/data/prompt_rome.txt (the llama.cpp peer's prompt) from fresh caches, in chunks of ``--chunk``
tokens, through ``Generator.prefill`` (what ``streamattn generate`` times): quant weights with
a model of ``KernelPlan(rows=R)`` (activation rows per weight-block unpacking; R = 1 is the one-row kernel; with
``--amx both``, the default where AMX is usable, each R also with ``amx=True``: rows in 16s on the tile unit)
and the float32 reference (OpenBLAS), at each thread count. Variants alternate within each repeat, in an order
that flips every repeat; a warm-up prefill of each runs first (JIT). Before timing, the last-token logits
of every R are checked bit-identical. Prints median prefill tok/s per variant, the share of time in the
packed matmul kernels (``qmatmul``, activation quantization excluded), ratios, and the process's CPU
seconds over wall seconds: on a shared host, a 2-thread variant whose ratio stays near 1 was given one
core's worth of time, and its CPU seconds against the 1-thread variant's show what threading costs.
"""

from __future__ import annotations

import argparse
import functools
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from streamattn.quant import matmul as qm
from streamattn.engine.generate import Generator
from streamattn.gguf.hub import resolve_model
from streamattn.gguf.loader import load_gguf
from streamattn.text.tokenizer import Tokenizer
from streamattn.models.transformer import Transformer
from streamattn.runtime.threads import set_threads

PROMPT = Path(__file__).resolve().parent / "data" / "prompt_rome.txt"


class KernelClock:
    """Wraps a function of ``qmatmul`` to add up the seconds spent in it (``_fused``: every packed matmul of
    the model; ``qmatmul``: the float kinds')."""

    def __init__(self, inner):
        self.seconds, self._inner = 0.0, inner

    def __call__(self, *args, **kw):
        t = time.perf_counter()
        try:
            return self._inner(*args, **kw)
        finally:
            self.seconds += time.perf_counter() - t

    def __get__(self, obj, objtype=None):          # in place of a method: bound to its instance
        return self if obj is None else functools.partial(self, obj)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", default="1,4", help="KernelPlan rows values, comma-separated")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--no-f32", action="store_true", help="skip the float32 reference")
    ap.add_argument("--amx", choices=("off", "on", "both"), default="off" if not qm.amx_kernels.AVAILABLE else "both",
                    help="prompt rows on AMX tiles (KernelPlan amx); default: both where AMX is usable")
    args = ap.parse_args()
    path = resolve_model(args.model, quiet=True)
    quant = load_gguf(str(path), weights="quant")
    tok = Tokenizer.from_metadata(quant.metadata)
    ids = tok.encode(PROMPT.read_text())
    amx = {"both": (False, True), "on": (True,), "off": (False,)}[args.amx]
    gens = {f"quant R={r}{' amx' if a else ''}": (Generator(Transformer(quant, plan=qm.KernelPlan(rows=r, amx=a)), tok,
                                                            prefill_chunk=args.chunk), r)
            for r in (int(v) for v in args.rows.split(",")) for a in amx}
    if not args.no_f32:
        gens["f32"] = (Generator(Transformer(load_gguf(str(path), weights="f32")), tok, prefill_chunk=args.chunk),
                       None)
    clock, fclock = KernelClock(qm.Matmuls._fused), KernelClock(qm.qmatmul)
    qm.Matmuls._fused, qm.qmatmul = clock, fclock
    threads = [int(t) for t in args.threads.split(",")]
    variants = [(name, t) for t in threads for name in gens]

    def run(name, t):
        gen, rows = gens[name]
        set_threads(t)
        clock.seconds = fclock.seconds = 0.0
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        logits = gen.prefill([ids])
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
        return wall, clock.seconds + fclock.seconds, cpu, logits

    ref = None
    for name, t in variants:                                   # warm-up (JIT) and the bit-identity check
        *_, logits = run(name, t)
        if name.startswith("quant"):
            if ref is None:
                ref = logits
            assert np.array_equal(logits, ref), f"{name}, {t} threads: logits differ from the first variant"
        print(f"warm {name:10s} {t} thr", file=sys.stderr, flush=True)
    times = {v: [] for v in variants}
    for rep in range(args.repeats):
        for v in variants if rep % 2 == 0 else variants[::-1]:
            s, k, c, _ = run(*v)
            times[v].append((s, k, c))
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    base = {t: statistics.median(x[0] for x in times[(next(iter(gens)), t)]) for t in threads}
    one = {name: statistics.median(x[0] for x in times[(name, threads[0])]) for name in gens}
    print(f"{args.model}, {len(ids)}-token prompt, chunk {args.chunk}, median of {args.repeats} (alternated)")
    print(f"{'variant':12s} {'thr':>3s} {'prefill tok/s':>13s} {'runs tok/s':>22s} {'qmatmul %':>9s} "
          f"{'vs ' + next(iter(gens)):>12s} {'vs ' + str(threads[0]) + ' thr':>9s} {'cpu s':>6s} {'cpu/wall':>8s}")
    for name, t in variants:
        s = statistics.median(x[0] for x in times[(name, t)])
        share = statistics.median(k / x for x, k, _ in times[(name, t)])
        cpu = statistics.median(c for _, _, c in times[(name, t)])
        runs = " ".join(f"{len(ids) / x[0]:.0f}" for x in times[(name, t)])
        print(f"{name:12s} {t:>3d} {len(ids) / s:13.1f} {runs:>22s} {100 * share:9.0f} {base[t] / s:12.2f} "
              f"{one[name] / s:9.2f} {cpu:6.2f} {cpu / s:8.2f}")


if __name__ == "__main__":
    main()
