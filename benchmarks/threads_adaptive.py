"""Is decode with a 2-thread ceiling ever slower than with 1 thread? 1 thread, 2 fixed, 2 adaptive, alternated.

    PYTHONPATH=. python benchmarks/threads_adaptive.py [--model smollm2-135m] [--repeats 5] [--tokens 64]
        [--neighbour 0.5] [--variants "1 thread" "2 adaptive"] [--out benchmarks/results/threads_adaptive_<date>.json]

One process, one loaded model, the ~700-token prompt of benchmarks/data/prompt_rome.txt, greedy; per
variant and repeat one ``Generator.stream`` of --tokens tokens. Variants, in an order that flips every
repeat:

- ``1 thread``;
- ``2 fixed``: ``set_threads(2)``, ``EngineConfig(adapt_threads=False)``, every step on 2 threads;
- ``2 adaptive``: ``set_threads(2)``, the default: each decode step on 1 or 2 threads, whichever its
  recent steps were faster on (streamattn.runtime.threads.ThreadChooser; the model's, so what one run learnt
  carries into the next, as in a server or a process that generates repeatedly).

``--neighbour DUTY`` runs a second process for the whole run that keeps one core busy DUTY of the time
(busy 5 ms x DUTY / 0.5, then sleeps the rest of each 10 ms; stopped after): the shared host of issue 30.
Prints each run and the medians of decode tok/s (``GenerationStats.decode_tok_s``); writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ROOT / "benchmarks" / "data" / "prompt_rome.txt"
NEIGHBOUR = """
import time
busy, period = {busy}, 0.010
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(period - busy)
"""
VARIANTS = (("1 thread", 1, True), ("2 fixed", 2, False), ("2 adaptive", 2, True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model name or .gguf path (default: the CLI's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--neighbour", type=float, default=0.0, help="duty cycle of a busy neighbour process (0: none)")
    ap.add_argument("--variants", nargs="+", default=[v[0] for v in VARIANTS], choices=[v[0] for v in VARIANTS])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                    f"threads_adaptive_{datetime.date.today()}.json")
    args = ap.parse_args(argv)
    if not 0.0 <= args.neighbour < 1.0:
        ap.error(f"--neighbour must be a duty cycle in [0, 1) (got {args.neighbour})")

    from streamattn.engine.core import _chooser
    from streamattn.engine.generate import Generator, warm_model
    from streamattn.engine.options import ModelOptions
    from streamattn.gguf.hub import resolve_model
    from streamattn.runtime.threads import set_threads

    opts = ModelOptions() if args.model is None else ModelOptions(model=args.model)
    tf, tok, _ = replace(opts, model=str(resolve_model(opts.model, quiet=True))).load()
    for n in (2, 1):                                  # both thread counts' kernels loaded before timing
        set_threads(n)
        warm_model(tf, "float32")
    gen = Generator(tf, tok)
    ids = gen.encode_prompt(PROMPT.read_text())
    chooser, on = _chooser(tf), []                  # the engines' chooser; the count of each of its steps
    choose = chooser.choose
    chooser.choose = lambda kind, ceiling: on.append(choose(kind, ceiling)) or on[-1]
    neighbour = None
    if args.neighbour > 0:
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR.format(busy=0.010 * args.neighbour)])
    variants = [v for v in VARIANTS if v[0] in args.variants]
    runs, load0 = [], os.getloadavg()
    try:
        for rep in range(args.repeats):
            for name, n, adapt in (variants if rep % 2 == 0 else variants[::-1]):
                set_threads(n)
                gen.config = replace(gen.config, adapt_threads=adapt)
                on.clear()
                list(gen.stream(ids, max_tokens=args.tokens, ignore_eos=True))
                runs.append({"variant": name, "repeat": rep, "decode_tok_s": gen.stats.decode_tok_s,
                             "prefill_s": gen.stats.prefill_s, "steps_on_1": on.count(1), "steps_on_2": on.count(2),
                             "step_s": list(gen.stats.decode_steps_s), "step_threads": list(on)})
                print(f"[{rep + 1}/{args.repeats}] {name:11s} decode {runs[-1]['decode_tok_s']:6.1f} tok/s"
                      + (f" ({on.count(1)} steps on 1 thread, {on.count(2)} on 2)" if adapt and n > 1 else ""),
                      file=sys.stderr, flush=True)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    med = {name: statistics.median(r["decode_tok_s"] for r in runs if r["variant"] == name) for name, _, _ in variants}
    base = med.get("1 thread", float("nan"))
    lines = ["| variant | decode tok/s (median) | × 1 thread |", "|---|---:|---:|"]
    lines += [f"| {name} | {v:.1f} | {v / base:.2f} |" for name, v in med.items()]
    print(f"{len(ids)}-token prompt, {args.tokens} tokens, neighbour duty {args.neighbour}, load {load0[0]:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cmd": " ".join(sys.argv), "neighbour": args.neighbour, "tokens": args.tokens,
                                    "prompt_tokens": len(ids), "load_avg": [load0, os.getloadavg()],
                                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                    "medians": med, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
