"""How fast does a real model prefill and decode, full vs window cache, by context and batch? (issue 5, item 2)

    PYTHONPATH=. python benchmarks/model_throughput.py [--contexts 512,4096] [--batches 1,8] [--caches full,window]
        [--threads 1] [--model smollm2-135m] [--window 512] [--chunk 64] [--prefill-reps 1]
        [--out out/model_throughput.json]

Each point (``streamattn.bench.sweep.end_to_end``): prefill = fixed random token ids, ``context`` per sequence, fed
in chunks of ``--chunk`` from fresh caches (allocation and growth included), median of ``--prefill-reps``
calls (default 1: a 4k x 8 prompt takes a minute or more on one core; Numba and BLAS are warmed up before on
a 16-token prompt of each cache kind); decode = one forward step of one token per sequence on the last
prefill's caches, median over >= 1 s. No sampling, only the model's forward. Caches: "full" (causal, float32), "window" (a ring of ``--window``
keys), "sinks" (4 sink tokens + ``--window`` - 4 recent keys). A full cache is skipped beyond the model's
trained context length. Prints the table, writes JSON; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from streamattn.bench import report as benchreport, suites, sweep as bench
from streamattn.gguf.loader import load_gguf
from streamattn.gguf.hub import resolve_model
from streamattn.models.transformer import Transformer
from streamattn.runtime.threads import set_threads

SINKS = suites.SINKS


def cache_kwargs(cache: str, window: int) -> dict:
    """``Transformer.new_caches`` keywords of a cache kind ("full", "window", "sinks") at ``window`` visible keys."""
    return {"full": dict(mode="full"), "window": dict(mode="window", window=window),
            "sinks": dict(mode="sinks", window=window - SINKS, sinks=SINKS)}[cache]


def engine_factory(tf: Transformer, *, window: int = 512, chunk: int = 64, seed: int = 0, log=sys.stderr):
    """``make_engine(context=, batch=, cache=)`` for :func:`streamattn.bench.sweep.end_to_end` on model ``tf``.

    Parameters
    ----------
    tf : Transformer
    window : int
        Keys a "window"/"sinks" cache keeps visible.
    chunk : int
        Prompt tokens per forward call during prefill.
    seed : int
        Seed of the fixed random prompt token ids.
    log : file
        Progress lines (one per point, as it starts).

    Returns
    -------
    callable
        ``make_engine(context=, batch=, cache=) -> (prefill, decode)``, or None for a full cache longer
        than the model's trained context.
    """
    c = tf.config

    def make_engine(*, context, batch, cache):
        if cache == "full" and context > c.context_length:
            print(f"skip full cache at context {context} > trained context {c.context_length}", file=log, flush=True)
            return None
        print(f"{cache:<6} context {context:>6} batch {batch} ...", file=log, flush=True)
        kw = cache_kwargs(cache, window)
        toks = np.random.default_rng(seed).integers(0, c.vocab_size, (batch, context + 1))
        state = {}

        def prefill():
            caches = state["caches"] = tf.new_caches(batch=batch, max_chunk=chunk, **kw)
            for s in range(0, context, chunk):
                tf.forward(toks[:, s:min(s + chunk, context)], caches, last_only=True)

        def decode():
            tf.forward(toks[:, context:], state["caches"], last_only=True)
        return prefill, decode
    return make_engine


def run(model=None, *, contexts=(512, 4096), batches=(1, 8), caches=("full", "window"), threads=1,
        window=512, chunk=64, prefill_reps=1, log=sys.stderr) -> dict:
    """Time ``model`` (a Transformer, a GGUF path or known name; default SmolLM2-135M) over the grid.

    Returns
    -------
    dict
        ``{"machine", "config", "rows"}``; rows as :func:`streamattn.bench.sweep.end_to_end` makes them.
    """
    set_threads(threads)
    tf = model if isinstance(model, Transformer) else Transformer(load_gguf(resolve_model(model, quiet=True)))
    info = benchreport.machine()
    make_engine = engine_factory(tf, window=window, chunk=chunk, log=log)
    for cache in caches:                                  # JIT and first-touch warm-up, untimed
        for step in make_engine(context=16, batch=1, cache=cache):
            step()
    t0 = time.perf_counter()
    rows = bench.end_to_end(make_engine, contexts=contexts, batches=batches, caches=caches, prefill_warmup=0,
                            prefill_reps=prefill_reps)
    info["seconds"] = time.perf_counter() - t0
    config = dict(model=tf.config.name, threads=threads, window=window, sinks=SINKS, chunk=chunk,
                  prefill_reps=prefill_reps, trained_context=tf.config.context_length,
                  cache_dtype="float32", weights="float32 (dequantized)")
    return {"machine": info, "config": config, "rows": rows}


def table(rows) -> str:
    """cache, context, batch, prefill tok/s, decode tok/s (all sequences), decode ms/step."""
    head = f"{'cache':<7}{'context':>8}{'batch':>6}{'prefill tok/s':>15}{'decode tok/s':>14}{'decode ms/step':>16}"
    return "\n".join([head, "-" * len(head)] + [
        f"{r['cache']:<7}{r['context']:>8}{r['batch']:>6}{r['prefill']['tokens_per_s']:>15.0f}"
        f"{r['decode']['tokens_per_s']:>14.1f}{r['decode']['median_s'] * 1e3:>16.2f}" for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: tuple(int(x) for x in s.split(","))                       # noqa: E731
    ap.add_argument("--contexts", type=ints, default=(512, 4096), help="prompt tokens per sequence (16384 allowed)")
    ap.add_argument("--batches", type=ints, default=(1, 8))
    ap.add_argument("--caches", type=lambda s: tuple(s.split(",")), default=("full", "window"),
                    help="comma list of full, window, sinks")
    ap.add_argument("--threads", type=int, default=1, help="OpenBLAS + Numba threads (streamattn/runtime/threads.py)")
    ap.add_argument("--model", default=None, help="GGUF path or known name (default: smollm2-135m)")
    ap.add_argument("--window", type=int, default=512, help="visible keys of window/sinks caches")
    ap.add_argument("--chunk", type=int, default=64, help="prefill tokens per forward call")
    ap.add_argument("--prefill-reps", type=int, default=1, help="timed prefills per point (median)")
    ap.add_argument("--out", default="out/model_throughput.json")
    a = ap.parse_args(argv)
    res = run(a.model, contexts=a.contexts, batches=a.batches, caches=a.caches, threads=a.threads,
              window=a.window, chunk=a.chunk, prefill_reps=a.prefill_reps)
    m, cfg = res["machine"], res["config"]
    print(f"{cfg['model']}, {cfg['threads']} thread(s), window {cfg['window']}, prefill chunk {cfg['chunk']}, "
          f"float32 weights and caches; {m['cpu']}, {m['cores']} cores, {m['date_utc']} UTC")
    print(table(res["rows"]))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.out} in {m['seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
