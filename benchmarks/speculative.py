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

``--peer llama-server`` adds llama.cpp's n-gram speculation on the same prompts in the same run: two
llama-server processes (built by ``scripts/install_llamacpp_native.sh``; ``--peer-bin`` for another),
on 127.0.0.1 only, ``-t T -tb T -c 4096 --parallel 1``, one without speculation and one with
``--peer-spec`` (default ``--spec-type ngram-simple --spec-ngram-simple-size-n 3
--spec-ngram-simple-size-m <draft-max>``: a 3-token lookup key, the middle of ours (2..4), and drafts of
at most as many tokens as ours). Each gets the prompt as the very token ids our engine decodes (our
``Tokenizer.apply_chat`` render, encoded), greedy (temperature 0, top-k 1), ``n_predict`` = ``--tokens``,
no prompt cache; its decode tok/s is the server's ``timings.predicted_per_second`` (tokens after the
first / time after the first: the same definition as ours), its acceptance ``draft_n_accepted /
draft_n``. The tables also say whether llama.cpp's tokens with speculation equal its tokens without
(``peer same``) and how much of our output its plain run reproduces (``peer ~ ours``, common prefix).
The servers are stopped at the end and on any error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from streamattn.bench.llama_server import PEER_BIN, PEER_STATUS, LlamaServer, find_binary, server_version

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
PEER_SPEC = "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m {draft_max}"


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


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n



def run_one(gen, prompt: str, tokens: int, spec):
    t0 = time.perf_counter()
    evs = list(gen.stream(prompt, chat=True, max_tokens=tokens, speculative=spec))
    s = gen.stats
    decode_s = sum(s.decode_steps_s)
    return {"ids": [e.token_id for e in evs], "tokens": len(evs), "decode_s": decode_s,
            "decode_tok_s": (len(evs) - 1) / max(decode_s, 1e-9), "steps": len(s.decode_steps_s),
            "wall_s": time.perf_counter() - t0}


def bench_model(name: str, threads: int, tokens: int, repeats: int, draft_max: int, peer=None,
                peer_info=None) -> list:
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
    with contextlib.ExitStack() as stack, use_threads(threads):
        servers = None
        if peer is not None:
            from streamattn.gguf.hub import resolve_model
            gguf = resolve_model(MODELS[name], quiet=True)
            servers = {False: stack.enter_context(LlamaServer(peer["bin"], gguf, threads)),
                       True: stack.enter_context(LlamaServer(peer["bin"], gguf, threads, peer["spec"]))}
            variant = servers[True].cpu_variant()
            if peer_info is not None:
                peer_info.setdefault("servers", []).append(
                    {"model": name, "threads": threads, "gguf": str(gguf), "cpu_variant": variant,
                     "plain": shlex.join(servers[False].cmd), "speculative": shlex.join(servers[True].cmd)})
            print(f"llama-server {name} t{threads}: CPU variant {variant}", file=sys.stderr, flush=True)
        for kind, prompts in (("copy", COPY), ("ordinary", ORDINARY)):
            for pname, prompt in prompts.items():
                plain, fast, acc, peer_runs = [], [], [], []
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
                    if servers is not None:
                        ids = gen.encode_prompt(prompt, chat=True)
                        for sp in order:
                            got["peer", sp is not None] = servers[sp is not None].complete(ids, tokens)
                        peer_runs.append((got["peer", False], got["peer", True]))
                row = {"model": name, "threads": threads, "kind": kind, "prompt": pname,
                       "tokens": got[False]["tokens"], "plain_tok_s": statistics.median(plain),
                       "spec_tok_s": statistics.median(fast), "acceptance": statistics.median(acc),
                       "steps_plain": got[False]["steps"], "steps_spec": got[True]["steps"]}
                row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
                line = (f"{name} t{threads} {kind:8s} {pname:8s} {row['tokens']:4d} tok  plain "
                        f"{row['plain_tok_s']:6.1f}  spec {row['spec_tok_s']:6.1f} tok/s  x{row['speedup']:.2f}  "
                        f"accept {row['acceptance']:.2f}  steps {row['steps_plain']} -> {row['steps_spec']}")
                if servers is not None:
                    row.update(peer_row(peer_runs, got[False]["ids"]))
                    row["ours_vs_peer_spec"] = row["spec_tok_s"] / max(row["peer_spec_tok_s"], 1e-9)
                    line += (f"  | llama-server {row['peer_tokens']:4d} tok plain {row['peer_plain_tok_s']:6.1f}  "
                             f"spec {row['peer_spec_tok_s']:6.1f}  x{row['peer_speedup']:.2f}  accept "
                             f"{row['peer_acceptance']:.2f}  same {row['peer_same']}  "
                             f"~ours {row['peer_match_ours']:.2f}")
                rows.append(row)
                print(line, file=sys.stderr, flush=True)
    return rows


def peer_row(runs: list, ours_ids: list) -> dict:
    """The llama-server columns of one prompt's row from its (plain, speculative) runs over repeats."""
    plain = [p for p, _ in runs]
    spec = [q for _, q in runs]
    out = {"peer_tokens": plain[-1]["tokens"],
           "peer_plain_tok_s": statistics.median(p["decode_tok_s"] for p in plain),
           "peer_spec_tok_s": statistics.median(q["decode_tok_s"] for q in spec),
           "peer_acceptance": statistics.median(q["acceptance"] for q in spec),
           "peer_drafted": spec[-1]["drafted"], "peer_accepted": spec[-1]["accepted"],
           "peer_same": all(p["ids"] == q["ids"] for p, q in runs),
           "peer_match_ours": common_prefix(plain[-1]["ids"], ours_ids) / max(len(ours_ids), 1)}
    out["peer_speedup"] = out["peer_spec_tok_s"] / max(out["peer_plain_tok_s"], 1e-9)
    return out


def summary(rows: list) -> list:
    out = []
    for (m, t) in sorted({(r["model"], r["threads"]) for r in rows}):
        for kind in ("copy", "ordinary"):
            sel = [r for r in rows if (r["model"], r["threads"], r["kind"]) == (m, t, kind)]
            if sel:
                s = {"model": m, "threads": t, "kind": kind,
                     "median_speedup": statistics.median(r["speedup"] for r in sel),
                     "median_plain_tok_s": statistics.median(r["plain_tok_s"] for r in sel),
                     "median_spec_tok_s": statistics.median(r["spec_tok_s"] for r in sel)}
                if all("peer_spec_tok_s" in r for r in sel):
                    for src in ("peer_speedup", "peer_plain_tok_s", "peer_spec_tok_s", "ours_vs_peer_spec"):
                        s["median_" + src] = statistics.median(r[src] for r in sel)
                out.append(s)
    return out


def markdown(rows: list, summ: list, tag: str, draft_max: int, command: str, peer_info=None) -> str:
    """The .md report: a summary per (model, threads, set) and one row per prompt; llama-server's
    columns where the run had ``--peer``."""
    with_peer = bool(rows) and all("peer_spec_tok_s" in r for r in rows)
    lines = [f"# Speculative decoding (n-gram, draft_max {draft_max}), {tag}", "", f"`{command}`", ""]
    if with_peer and peer_info:
        variants = sorted({str(s.get("cpu_variant")) for s in peer_info.get("servers", [])})
        lines += [f"Peer: llama-server ({peer_info.get('build') or 'build unknown'}; llama-cpp-python "
                  f"{peer_info.get('llama_cpp_python') or '?'} sources), CPU variant {', '.join(variants) or '?'}, "
                  f"speculation `{peer_info.get('spec', '')}`; same prompt token ids, greedy, same max tokens; "
                  f"decode tok/s from its `timings.predicted_per_second`.", ""]
    head = "| model | threads | set | median speed-up | plain tok/s | speculative tok/s |"
    rule = "|---|---:|---|---:|---:|---:|"
    if with_peer:
        head += " llama-server plain | llama-server n-gram | its speed-up | ours / its (speculative) |"
        rule += "---:|---:|---:|---:|"
    lines += [head, rule]
    for s in summ:
        line = (f"| {s['model']} | {s['threads']} | {s['kind']} | {s['median_speedup']:.2f}x | "
                f"{s['median_plain_tok_s']:.1f} | {s['median_spec_tok_s']:.1f} |")
        if with_peer:
            line += (f" {s['median_peer_plain_tok_s']:.1f} | {s['median_peer_spec_tok_s']:.1f} | "
                     f"{s['median_peer_speedup']:.2f}x | {s['median_ours_vs_peer_spec']:.2f}x |")
        lines.append(line)
    head = "| model | threads | prompt | tokens | plain | speculative | speed-up | acceptance | steps |"
    rule = "|---|---:|---|---:|---:|---:|---:|---:|---|"
    if with_peer:
        head += (" peer tokens | peer plain | peer n-gram | peer speed-up | peer acceptance | peer same |"
                 " peer ~ ours |")
        rule += "---:|---:|---:|---:|---:|---|---:|"
    lines += ["", head, rule]
    for r in rows:
        line = (f"| {r['model']} | {r['threads']} | {r['prompt']} | {r['tokens']} | {r['plain_tok_s']:.1f} | "
                f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['acceptance']:.2f} | {r['steps_plain']} -> "
                f"{r['steps_spec']} |")
        if with_peer:
            line += (f" {r['peer_tokens']} | {r['peer_plain_tok_s']:.1f} | {r['peer_spec_tok_s']:.1f} | "
                     f"{r['peer_speedup']:.2f}x | {r['peer_acceptance']:.2f} | {'yes' if r['peer_same'] else 'NO'} | "
                     f"{r['peer_match_ours']:.2f} |")
        lines.append(line)
    if with_peer:
        lines += ["", "peer same: llama-server's tokens with speculation equal its tokens without (every repeat); "
                  "peer ~ ours: the share of our tokens that its plain run reproduces as a common prefix."]
    return "\n".join(lines) + "\n"


def write(rows: list, tag: str, args, peer_info=None) -> Path:
    out = ROOT / "benchmarks" / "results" / f"speculative_{tag}"
    summ = summary(rows)
    doc = {"command": " ".join(sys.argv), "rows": rows, "summary": summ}
    if peer_info:
        doc["peer"] = peer_info
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, summ, tag, args.draft_max, " ".join(sys.argv), peer_info))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(9, 4.5))
        labels = [f"{r['model']} t{r['threads']}\n{r['prompt']}" for r in rows]
        x = range(len(rows))
        series = [("plain_tok_s", "streamattn plain"), ("spec_tok_s", "streamattn n-gram speculation")]
        if rows and all("peer_spec_tok_s" in r for r in rows):
            series += [("peer_plain_tok_s", "llama-server plain"), ("peer_spec_tok_s", "llama-server n-gram")]
        w = 0.8 / len(series)
        for j, (key, label) in enumerate(series):
            ax.bar([i - 0.4 + w * (j + 0.5) for i in x], [r[key] for r in rows], w, label=label)
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
    p.add_argument("--peer", choices=["llama-server"], help="also run llama.cpp's n-gram speculation (llama-server)")
    p.add_argument("--peer-bin", default=None,
                   help="llama-server binary (default: the one scripts/install_llamacpp_native.sh reports in "
                        f"{PEER_STATUS}, else {PEER_BIN})")
    p.add_argument("--peer-spec", default=PEER_SPEC,
                   help="llama-server's speculation flags; {draft_max} is replaced (default: %(default)s)")
    args = p.parse_args()
    peer = peer_info = None
    if args.peer:
        try:
            binary, status = find_binary(args.peer_bin)
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from None
        args.peer_bin = str(binary)
        spec = args.peer_spec.format(draft_max=args.draft_max)
        peer = {"bin": args.peer_bin, "spec": shlex.split(spec)}
        peer_info = {"engine": "llama-server", "bin": args.peer_bin, "spec": spec,
                     "build": server_version(args.peer_bin) or None,
                     "llama_cpp_python": status.get("llama_cpp_python"), "install": status or None}
    rows = []
    for m in args.models:
        for t in args.threads:
            rows += bench_model(m, t, args.tokens, args.repeats, args.draft_max, peer, peer_info)
    out = write(rows, args.tag, args, peer_info)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
