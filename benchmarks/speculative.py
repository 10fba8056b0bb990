"""Speculative decoding's speed-up: copy-heavy and ordinary prompts, with and without n-gram drafts.

    PYTHONPATH=. python benchmarks/speculative.py [--models smollm2 gemma3] [--threads 1 2] [--tokens 256]
                                                  [--repeats 1] [--tag DATE_WHAT]

Each prompt (chat-wrapped, greedy, at most ``--tokens`` new tokens) runs without and with
``--speculative ngram`` in the same process, alternated, on fresh caches; the token ids must be equal
(the run stops if they are not: speculation here is exact). Decode tok/s = tokens after the first /
decode time (Generator stats; prefill excluded). The copy-heavy set: rename a variable across a 60-line
function, extract fields from a document into JSON, fix a typo in a paragraph and repeat it, summarise
with quotations; the ordinary set: short chat questions. Writes
benchmarks/results/speculative_<tag>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}


def _function() -> str:
    """A 60-line Python function whose variable ``total`` the rename task renames."""
    body = ["def summarize(records, limit=None):", '    """Totals per category of the first `limit` records."""',
            "    total = {}", "    seen = 0"]
    for i, cat in enumerate(["apples", "pears", "plums", "figs", "dates", "limes", "kiwis", "grapes",
                             "lemons", "cherries", "melons", "peaches", "mangos"]):
        body += [f"    # category {i}: {cat}",
                 f"    for r in records:",
                 f"        if r.get('kind') == '{cat}':",
                 f"            total['{cat}'] = total.get('{cat}', 0) + r['count']"]
    body += ["    for k in sorted(total):", "        seen += 1",
             "        if limit is not None and seen > limit:", "            break",
             "    return total"]
    return "\n".join(body)


DOCUMENT = ("Invoice 2291 was issued on 14 March 2025 by Northwind Traders, 12 Harbour Road, Bristol, to "
            "Contoso Ltd of 8 Mill Lane, Leeds. It lists 40 units of part A-113 at 2.50 each and 12 units of "
            "part B-07 at 11.00 each, a total of 232.00 pounds, due within 30 days. The contact is Dana "
            "Whitfield, dana.whitfield@northwind.example, telephone 0117 496 0321.")
PARAGRAPH = ("The ring buffer keeps the most recent keys and values of every layer, so the memory of a long "
             "conversation stays flat. When a new token arrives, its key overwrites the oldest slot, and the "
             "attention kernel reads the slots in place without copying them. Because softmax does not "
             "depend on the order of the keys, the kernal may visit the slots in any order it likes.")
QUOTES = ('In the talk, the speaker said: "Caches are where latency goes to hide." Later she added: "A ring '
          'buffer never forgets to forget." Asked about speed, she answered: "Measure first, then measure '
          'again, and only then change the code." She closed with: "Exact is a feature."')

COPY = {
    "rename": "Rename the variable `total` to `counts` everywhere in this function and print the whole "
              "function again, nothing else:\n\n" + _function(),
    "extract": "Extract these fields from the document as JSON with keys invoice, date, seller, buyer, "
               "total, contact_email. Quote the values exactly as they appear.\n\n" + DOCUMENT,
    "typo": "Fix the one spelling mistake in this paragraph and repeat the whole paragraph:\n\n" + PARAGRAPH,
    "quotes": "Summarise this passage in a few sentences, repeating each quotation word for word:\n\n" + QUOTES,
}
ORDINARY = {
    "capital": "What is the capital of France, and what is it known for?",
    "colours": "Name five colours and describe each in one sentence.",
    "sky": "Why is the sky blue? Explain it to a ten-year-old.",
    "haiku": "Write three haiku about the sea.",
}


def run_one(gen, prompt: str, tokens: int, spec):
    t0 = time.perf_counter()
    evs = list(gen.stream(prompt, chat=True, max_tokens=tokens, speculative=spec))
    s = gen.stats
    decode_s = sum(s.decode_steps_s)
    return {"ids": [e.token_id for e in evs], "tokens": len(evs), "decode_s": decode_s,
            "decode_tok_s": (len(evs) - 1) / max(decode_s, 1e-9), "steps": len(s.decode_steps_s),
            "wall_s": time.perf_counter() - t0}


def bench_model(name: str, threads: int, tokens: int, repeats: int, draft_max: int) -> list:
    from streamattn.engine.options import ModelOptions
    from streamattn.engine.generate import warm_model
    from streamattn.engine.sequence import Job
    from streamattn.engine.speculative import SpecParams
    from streamattn.threads import threads as use_threads
    opts = ModelOptions(model=MODELS[name], threads=threads, cache_dtype="float16", prefill_chunk=256)
    tf, tok, _ = opts.load()
    warm_model(tf, "float16")
    gen = opts.generator(tf, tok)
    spec = SpecParams(draft_max=draft_max)
    rows = []
    with use_threads(threads):
        for kind, prompts in (("copy", COPY), ("ordinary", ORDINARY)):
            for pname, prompt in prompts.items():
                plain, fast, acc = [], [], []
                for r in range(repeats):
                    order = (None, spec) if r % 2 == 0 else (spec, None)
                    got = {}
                    for sp in order:
                        got[sp is not None] = run_one(gen, prompt, tokens, sp)
                    if got[True]["ids"] != got[False]["ids"]:
                        raise SystemExit(f"{name} {pname}: speculation changed the tokens")
                    plain.append(got[False]["decode_tok_s"])
                    fast.append(got[True]["decode_tok_s"])
                    seqs = []
                    list(gen.stream_jobs([Job(prompt=tuple(gen.encode_prompt(prompt, chat=True)), max_tokens=tokens,
                                              speculative=spec)], seqs=seqs))
                    acc.append(seqs[0].accepted / max(seqs[0].drafted, 1))
                row = {"model": name, "threads": threads, "kind": kind, "prompt": pname,
                       "tokens": got[False]["tokens"], "plain_tok_s": statistics.median(plain),
                       "spec_tok_s": statistics.median(fast), "acceptance": statistics.median(acc),
                       "steps_plain": got[False]["steps"], "steps_spec": got[True]["steps"]}
                row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
                rows.append(row)
                print(f"{name} t{threads} {kind:8s} {pname:8s} {row['tokens']:4d} tok  plain "
                      f"{row['plain_tok_s']:6.1f}  spec {row['spec_tok_s']:6.1f} tok/s  x{row['speedup']:.2f}  "
                      f"accept {row['acceptance']:.2f}  steps {row['steps_plain']} -> {row['steps_spec']}",
                      file=sys.stderr, flush=True)
    return rows


def summary(rows: list) -> list:
    out = []
    for (m, t) in sorted({(r["model"], r["threads"]) for r in rows}):
        for kind in ("copy", "ordinary"):
            sel = [r for r in rows if (r["model"], r["threads"], r["kind"]) == (m, t, kind)]
            if sel:
                out.append({"model": m, "threads": t, "kind": kind,
                            "median_speedup": statistics.median(r["speedup"] for r in sel),
                            "median_plain_tok_s": statistics.median(r["plain_tok_s"] for r in sel),
                            "median_spec_tok_s": statistics.median(r["spec_tok_s"] for r in sel)})
    return out


def write(rows: list, tag: str, args) -> Path:
    out = ROOT / "benchmarks" / "results" / f"speculative_{tag}"
    summ = summary(rows)
    out.with_suffix(".json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows,
                                                    "summary": summ}, indent=1) + "\n")
    lines = [f"# Speculative decoding (n-gram, draft_max {args.draft_max}), {tag}", "",
             f"`{' '.join(sys.argv)}`", "",
             "| model | threads | set | median speed-up | plain tok/s | speculative tok/s |", "|---|---:|---|---:|---:|---:|"]
    lines += [f"| {s['model']} | {s['threads']} | {s['kind']} | {s['median_speedup']:.2f}x | "
              f"{s['median_plain_tok_s']:.1f} | {s['median_spec_tok_s']:.1f} |" for s in summ]
    lines += ["", "| model | threads | prompt | tokens | plain | speculative | speed-up | acceptance | steps |",
              "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['model']} | {r['threads']} | {r['prompt']} | {r['tokens']} | {r['plain_tok_s']:.1f} | "
              f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['acceptance']:.2f} | {r['steps_plain']} -> "
              f"{r['steps_spec']} |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(9, 4.5))
        labels = [f"{r['model']} t{r['threads']}\n{r['prompt']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["plain_tok_s"] for r in rows], 0.4, label="plain")
        ax.bar([i + 0.2 for i in x], [r["spec_tok_s"] for r in rows], 0.4, label="n-gram speculation")
        ax.set_xticks(list(x), labels, fontsize=6, rotation=90)
        ax.set_ylabel("decode tok/s (same tokens)")
        ax.set_title("Speculative decoding, copy-heavy and ordinary prompts")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
        plt.close(fig)
    except ImportError:
        pass
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=sorted(MODELS))
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--tag", default=datetime.date.today().isoformat())
    args = p.parse_args()
    rows = []
    for m in args.models:
        for t in args.threads:
            rows += bench_model(m, t, args.tokens, args.repeats, args.draft_max)
    out = write(rows, args.tag, args)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
