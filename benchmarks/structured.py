"""What a JSON-schema constraint costs: the mask per token per sequence, and decode tok/s with and without.

    PYTHONPATH=. python benchmarks/structured.py [--models smollm2 gemma3] [--batches 1 8] [--tokens 96]
                                                 [--repeats 3] [--tag DATE_WHAT]

For each model and batch size: the same chat prompts decode greedily with and without a schema (a list
of at least 200 recipe objects, so that no constrained row finishes within ``--tokens`` and every step
of both runs has all its rows), alternated, medians of
``--repeats``; the median decode step in ms and tok/s per sequence as its inverse (a mean over a whole
run would count the steps after constrained sequences finish early, with fewer rows), and the mask alone: llguidance's mask plus its application to the logits, timed over the tokens of a
constrained completion, in µs per token per sequence. Writes benchmarks/results/structured_<tag>.{json,md}.
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
sys.path.insert(0, str(ROOT / "tests"))
MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
ASKS = ["Describe a dish as JSON.", "Give me a recipe as JSON.", "A quick dinner, as JSON.",
        "Something sweet, as JSON.", "A breakfast recipe as JSON.", "A soup as JSON.", "A salad as JSON.",
        "Describe a cake as JSON."]


def mask_us(gen, grammar, ids: list, vocab: int) -> float:
    """µs per token of mask + apply, replaying the tokens ``ids`` of a constrained completion."""
    c = grammar.constraint(vocab)
    z = np.zeros(vocab, np.float32)
    t0 = time.perf_counter()
    for t in ids:
        c.mask(z)
        c.take(t)
    return (time.perf_counter() - t0) / max(len(ids), 1) * 1e6


def bench(name: str, batches: list, tokens: int, repeats: int) -> list:
    from structured_cases import SCHEMAS
    from streamattn.engine.generate import warm_model
    from streamattn.engine.options import ModelOptions
    opts = ModelOptions(model=MODELS[name], cache_dtype="float16")
    tf, tok, m = opts.load()
    warm_model(tf, "float16")
    from streamattn.engine.generate import Generator
    gen = Generator(tf, tok, opts.engine_config())
    grammar = gen.grammars.json_schema({"type": "array", "minItems": 200, "items": SCHEMAS["recipe"]})
    rows = []
    for B in batches:
        prompts = [ASKS[i % len(ASKS)] for i in range(B)]
        steps = {False: [], True: []}
        last = None
        for r in range(repeats):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                evs = list(gen.stream_batch(prompts, chat=True, max_tokens=tokens, ignore_eos=not constrained,
                                            grammar=grammar if constrained else None))
                st = gen.stats
                steps[constrained].append(1e3 * statistics.median(st.decode_steps_s))
                if constrained:
                    last = [e.token_id for e in evs if e.seq == 0]
        row = {"model": name, "batch": B, "plain_step_ms": statistics.median(steps[False]),
               "constrained_step_ms": statistics.median(steps[True]),
               "mask_us": mask_us(gen, grammar, last, int(m.config.vocab_size)), "vocab": int(m.config.vocab_size)}
        row["plain_tok_s"], row["constrained_tok_s"] = 1e3 / row["plain_step_ms"], 1e3 / row["constrained_step_ms"]
        row["ratio"] = row["constrained_tok_s"] / row["plain_tok_s"]
        rows.append(row)
        print(f"{name} B={B}: plain {row['plain_tok_s']:.1f} tok/s ({row['plain_step_ms']:.2f} ms a step), "
              f"constrained {row['constrained_tok_s']:.1f} ({row['constrained_step_ms']:.2f} ms) = "
              f"{row['ratio']:.2f}x; mask {row['mask_us']:.0f} us/token/sequence", file=sys.stderr, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=sorted(MODELS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tag", default=datetime.date.today().isoformat())
    args = p.parse_args()
    from streamattn.runtime.threads import set_threads
    set_threads(1)
    rows = [r for m in args.models for r in bench(m, args.batches, args.tokens, args.repeats)]
    out = ROOT / "benchmarks" / "results" / f"structured_{args.tag}"
    out.with_suffix(".json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    lines = [f"# Constrained decoding cost, {args.tag} (1 thread, greedy, a list of >= 200 'recipe' objects)", "",
             f"`{' '.join(sys.argv)}`", "",
             "| model | vocab | batch | plain tok/s | constrained tok/s | ratio | step ms plain / constrained | "
             "mask us/token/seq |", "|---|---:|---:|---:|---:|---:|---|---:|"]
    lines += [f"| {r['model']} | {r['vocab']} | {r['batch']} | {r['plain_tok_s']:.1f} | {r['constrained_tok_s']:.1f} | "
              f"{r['ratio']:.2f}x | {r['plain_step_ms']:.2f} / {r['constrained_step_ms']:.2f} | {r['mask_us']:.0f} |"
              for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
