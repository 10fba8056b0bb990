"""What a speculative verify step costs against a one-token step: a model's forward over 1 + k rows, the
logits of every row, as the engine runs a draft of k tokens, over the time of one row.

    PYTHONPATH=. python benchmarks/verify_cost.py --models MODEL_OR_GGUF ... [--threads 1 2] [--rows 1 2 3 5 9]
                                                  [--context 256] [--calls 15] [--tag DATE_WHAT]

Acceptance means nothing on random weights, but this ratio does: it is the price :class:`DraftPolicy`
(streamattn/engine/speculative.py) weighs a draft against, and it differs by model size, thread count
and host (a memory-bound 8B step reads the weights once for every row; a 135M step is compute-bound).
Each model (a name of ``streamattn pull`` or a GGUF path, e.g. the real-size fixtures of
scripts/make_real_size_gguf.py) is prefilled with ``--context`` tokens; then each row count is timed
``--calls`` times, counts interleaved round-robin, each call followed by a rewind of the rows it
appended (``state.rewind``) so every call sees the same context. Reported: the median seconds of each
count and its ratio to one row. Writes benchmarks/results/verify_cost_<tag>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def measure(model: str, threads: int, rows: list, context: int, calls: int) -> dict:
    from streamattn.kv import state
    from streamattn.engine.generate import warm_model
    from streamattn.engine.options import ModelOptions
    from streamattn.runtime.threads import threads as use_threads
    opts = ModelOptions(model=model, threads=threads, cache_dtype="float16", prefill_chunk=max(rows))
    tf, tok, _ = opts.load()
    with use_threads(threads):
        warm_model(tf, "float16")
        caches = tf.new_caches(batch=1, max_chunk=max(max(rows), 64), dtype="float16")
        rng = np.random.default_rng(0)
        prompt = rng.integers(100, tf.config.vocab_size - 100, size=context)
        for at in range(0, context, 64):                                # the context, in prompt chunks
            chunk = prompt[at:at + 64][None, :]
            tf.forward(chunk, caches, last_only=True)
        times = {r: [] for r in rows}
        for _ in range(calls):
            for r in rows:                                              # round-robin: drifts hit all alike
                toks = rng.integers(100, tf.config.vocab_size - 100, size=(1, r))
                t0 = time.perf_counter()
                tf.forward(toks, caches, logits_at=(np.zeros(r, np.int64), np.arange(r)))
                times[r].append(time.perf_counter() - t0)
                for c in caches:
                    state.rewind(c, 0, r)
    med = {r: statistics.median(v) for r, v in times.items()}
    return {"model": model, "threads": threads, "context": context, "calls": calls,
            "seconds": {str(r): med[r] for r in rows},
            "ratio": {str(r): med[r] / med[rows[0]] for r in rows}}


def markdown(results: list, rows: list, command: str) -> str:
    from streamattn.runtime import cpu_target
    from streamattn.bench.report import machine
    m = machine()
    lines = ["# Verify step cost: 1 + k rows (every row's logits) against one row", "", f"`{command}`", "",
             f"Host: {m['cpu']} ({m['cores']} cores; {'AVX-512' if cpu_target.has('avx512f') else 'AVX2'}); "
             f"median of each row count's calls, counts interleaved.", "",
             "| model | threads | 1 row (ms) | " + " | ".join(f"{r} rows" for r in rows[1:]) + " |",
             "|---|---:|---:|" + "---:|" * (len(rows) - 1)]
    for res in results:
        lines.append(f"| {Path(res['model']).name} | {res['threads']} | {res['seconds'][str(rows[0])] * 1e3:.1f} | "
                     + " | ".join(f"{res['ratio'][str(r)]:.2f}x" for r in rows[1:]) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 5, 9])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--tag", default=datetime.date.today().isoformat())
    args = p.parse_args()
    if args.rows[0] != 1:
        raise SystemExit("--rows must start with 1 (the one-row step every ratio is against)")
    results = []
    for model in args.models:
        for t in args.threads:
            res = measure(model, t, args.rows, args.context, args.calls)
            results.append(res)
            print(f"{Path(model).name} t{t}: " + "  ".join(f"{r} rows {res['ratio'][str(r)]:.2f}x"
                                                           for r in args.rows), file=sys.stderr, flush=True)
    out = ROOT / "benchmarks" / "results" / f"verify_cost_{args.tag}"
    command = " ".join(sys.argv)
    out.with_suffix(".json").write_text(json.dumps({"command": command, "results": results}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(results, args.rows, command))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
