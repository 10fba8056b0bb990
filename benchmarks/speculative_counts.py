"""Speculation's load-independent counts: decode steps, verify steps, drafted and accepted tokens per prompt.

    PYTHONPATH=. python benchmarks/speculative_counts.py [--model smollm2] [--split heldout] [--tokens 256]
                                                         [--costs 1:1,2:1.06,3:1.36,5:1.95,9:3.38]

The drafting policy prices a draft from step times the engine measures (``StepCosts``), so on a busy host
what it drafts moves with the load. Here those prices are fixed to ``--costs`` (rows:cost of a step of
that many rows in one-row steps, linear between; the default is SmolLM2's at one thread in
benchmarks/results/verify_cost_2026-12-07_1b-8b-smollm2_t1-2.md), which makes every draft, and so every
count, a function of the code and the prompts alone: two commits compare exactly. ``modelled`` is the
speed-up those costs give: tokens after the first / the summed cost of the decode steps. One greedy run
per prompt of benchmarks/data/speculative_prompts.json, one thread. Prints one JSON line per prompt and
the medians per set.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speculative as bench                                                      # noqa: E402


def cost_table(text: str):
    """``rows:cost,...`` -> cost(rows), linear between the rows given, flat past the last."""
    table = {}
    for item in text.split(","):
        rows, _, c = item.partition(":")
        table[int(rows)] = float(c)
    if table.get(1) != 1.0:
        raise SystemExit(f"--costs must give 1 row a cost of 1 (got {text!r})")
    known = sorted(table)

    def cost(rows: int) -> float:
        rows = min(rows, known[-1])
        for a, b in zip(known, known[1:]):
            if a <= rows <= b:
                return table[a] + (table[b] - table[a]) * (rows - a) / (b - a)
        return table[known[-1]]
    return cost


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(bench.MODELS), default="smollm2")
    p.add_argument("--split", choices=("tune", "heldout", "all"), default="heldout")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--costs", default="1:1,2:1.06,3:1.36,5:1.95,9:3.38")
    args = p.parse_args()
    cost = cost_table(args.costs)
    from streamattn.engine import sequence
    from streamattn.engine.generate import Generator, warm_model
    from streamattn.engine.options import ModelOptions
    from streamattn.engine.speculative import SpecParams, StepCosts
    from streamattn.runtime.threads import threads as use_threads
    StepCosts.ratio = lambda self, base, rows: cost(rows) / cost(base)          # fixed prices
    drafts: list = []                                                           # k of every decode step
    plan = sequence.Sequence.plan_draft

    def planned(self, *a, **kw):
        d = plan(self, *a, **kw)
        drafts.append(len(d))
        return d
    sequence.Sequence.plan_draft = planned
    opts = ModelOptions(model=bench.MODELS[args.model], threads=1, cache_dtype="float16", prefill_chunk=256)
    tf, tok, _ = opts.load()
    warm_model(tf, "float16")
    gen = Generator(tf, tok, opts.engine_config())
    spec = SpecParams(draft_max=args.draft_max)
    rows = []
    with use_threads(1):
        for e in bench.load_prompts(args.split):
            drafts.clear()
            r = bench.run_one(gen, tok.encode(tok.apply_chat(e["messages"])), args.tokens, spec)
            row = {"prompt": e["name"], "kind": e["kind"], "tokens": r["tokens"], "steps": len(drafts),
                   "verifies": sum(k > 0 for k in drafts), "drafted": r["drafted"], "accepted": r["accepted"],
                   "modelled": round((r["tokens"] - 1) / sum(cost(1 + k) for k in drafts), 3),
                   "draft_lengths": dict(sorted(collections.Counter(k for k in drafts if k).items()))}
            rows.append(row)
            print(json.dumps(row), flush=True)
    for kind in ("copy", "ordinary"):
        m = [r["modelled"] for r in rows if r["kind"] == kind]
        if m:
            print(f"{kind}: modelled median {statistics.median(m):.3f}, lowest {min(m):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
