"""Speculative decoding's speed-up: copy-heavy and ordinary prompts, with and without n-gram drafts.

    PYTHONPATH=. python benchmarks/speculative.py [--models smollm2 gemma3] [--threads 1 2] [--tokens 256]
                                                  [--repeats 3] [--split heldout|tune|all] [--tag DATE_WHAT]

The prompts are benchmarks/data/speculative_prompts.json: 20 copy-heavy (code renames in Python,
JavaScript, SQL and shell; CSV/JSON/YAML/table conversions; typo fixes; summaries that quote; a poem
repeated with one word changed; multi-turn chats that ask for an earlier answer again) and 20 ordinary
(explanations, stories, lists, advice, multi-turn chat), split into a tuning half and a held-out half
before any tuning of the drafting policy; the default reports the held-out half. Each prompt (its chat
messages rendered by the model's template, greedy, at most ``--tokens`` new tokens) runs without and with
``--speculative ngram`` in the same process, ``--repeats`` alternated pairs, on fresh caches; the token
ids must be equal (the run stops if they are not: speculation here is exact). Decode tok/s = tokens after
the first / decode time (Generator stats; prefill excluded). A prompt's speed-up is the median of its
pairs' ratios, with their range beside it. Writes benchmarks/results/speculative_<tag>.{json,md,png}.

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

from streamattn.runtime import cpu_target
from streamattn.bench.report import machine
from streamattn.bench.llama_server import PEER_BIN, PEER_STATUS, LlamaServer, find_binary, server_version

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
PEER_SPEC = "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m {draft_max}"


PROMPTS = ROOT / "benchmarks" / "data" / "speculative_prompts.json"


def load_prompts(split: str) -> list:
    """The prompt set's entries of ``split`` ("tune", "heldout" or "all"), copy-heavy first: dicts with
    name, kind ("copy" | "ordinary"), split and messages (chat messages, multi-turn for some)."""
    entries = json.loads(PROMPTS.read_text())["prompts"]
    chosen = [e for e in entries if split == "all" or e["split"] == split]
    return sorted(chosen, key=lambda e: (e["kind"] != "copy", e["name"]))


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n



def run_one(gen, ids: list, tokens: int, spec):
    """One greedy completion of ``ids`` (plain when ``spec`` is None) on fresh caches."""
    from streamattn.engine.sequence import Job
    t0 = time.perf_counter()
    seqs: list = []
    evs = list(gen.stream_jobs([Job(prompt=tuple(ids), max_tokens=tokens, cache_prompt=False, speculative=spec)],
                               seqs=seqs))
    s = gen.stats
    decode_s = sum(s.decode_steps_s)
    return {"ids": [e.token_id for e in evs], "tokens": len(evs), "decode_s": decode_s,
            "decode_tok_s": (len(evs) - 1) / max(decode_s, 1e-9), "steps": len(s.decode_steps_s),
            "wall_s": time.perf_counter() - t0, "drafted": seqs[0].drafted, "accepted": seqs[0].accepted}


def bench_model(name: str, threads: int, tokens: int, repeats: int, draft_max: int, prompts: list, peer=None,
                peer_info=None) -> list:
    from streamattn.engine.options import ModelOptions
    from streamattn.engine.generate import warm_model
    from streamattn.engine.speculative import SpecParams
    from streamattn.runtime.threads import threads as use_threads
    opts = ModelOptions(model=MODELS[name], threads=threads, cache_dtype="float16", prefill_chunk=256)
    tf, tok, _ = opts.load()
    warm_model(tf, "float16")
    from streamattn.engine.generate import Generator
    gen = Generator(tf, tok, opts.engine_config())
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
        for entry in prompts:
            kind, pname = entry["kind"], entry["name"]
            ids = tok.encode(tok.apply_chat(entry["messages"]))
            plain, fast, acc, peer_runs, ratios = [], [], [], [], []
            for r in range(repeats):
                order = (None, spec) if r % 2 == 0 else (spec, None)
                got = {}
                for sp in order:
                    got[sp is not None] = run_one(gen, ids, tokens, sp)
                if got[True]["ids"] != got[False]["ids"]:
                    raise SystemExit(f"{name} {pname}: speculation changed the tokens")
                plain.append(got[False]["decode_tok_s"])
                fast.append(got[True]["decode_tok_s"])
                ratios.append(fast[-1] / plain[-1])
                acc.append(got[True]["accepted"] / max(got[True]["drafted"], 1))
                if servers is not None:
                    for sp in order:
                        got["peer", sp is not None] = servers[sp is not None].complete(ids, tokens)
                    peer_runs.append((got["peer", False], got["peer", True]))
            row = {"model": name, "threads": threads, "kind": kind, "prompt": pname,
                   "tokens": got[False]["tokens"], "plain_tok_s": statistics.median(plain),
                   "spec_tok_s": statistics.median(fast), "acceptance": statistics.median(acc),
                   "steps_plain": got[False]["steps"], "steps_spec": got[True]["steps"]}
            row["speedup"] = statistics.median(ratios)            # of the alternated pairs
            row["speedup_min"], row["speedup_max"] = min(ratios), max(ratios)
            row["drafted"] = got[True]["drafted"]
            line = (f"{name} t{threads} {kind:8s} {pname:8s} {row['tokens']:4d} tok  plain "
                    f"{row['plain_tok_s']:6.1f}  spec {row['spec_tok_s']:6.1f} tok/s  x{row['speedup']:.2f} "
                    f"({row['speedup_min']:.2f}-{row['speedup_max']:.2f})  "
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
                s = {"model": m, "threads": t, "kind": kind, "prompts": len(sel),
                     "median_speedup": statistics.median(r["speedup"] for r in sel),
                     "min_speedup": min(r["speedup"] for r in sel),
                     "max_speedup": max(r["speedup"] for r in sel),
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
    m = machine()
    lines = [f"# Speculative decoding (n-gram, draft_max {draft_max}), {tag}", "", f"`{command}`", "",
             f"Host: {m['cpu']} ({m['cores']} cores; {'AVX-512' if cpu_target.has('avx512f') else 'AVX2'}), "
             f"load average at the end {m['loadavg'][0]:.1f}", ""]
    if with_peer and peer_info:
        variants = sorted({str(s.get("cpu_variant")) for s in peer_info.get("servers", [])})
        lines += [f"Peer: llama-server ({peer_info.get('build') or 'build unknown'}; llama-cpp-python "
                  f"{peer_info.get('llama_cpp_python') or '?'} sources), CPU variant {', '.join(variants) or '?'}, "
                  f"speculation `{peer_info.get('spec', '')}`; same prompt token ids, greedy, same max tokens; "
                  f"decode tok/s from its `timings.predicted_per_second`.", ""]
    head = "| model | threads | set | prompts | median speed-up | lowest | highest | plain tok/s | speculative tok/s |"
    rule = "|---|---:|---|---:|---:|---:|---:|---:|---:|"
    if with_peer:
        head += " llama-server plain | llama-server n-gram | its speed-up | ours / its (speculative) |"
        rule += "---:|---:|---:|---:|"
    lines += [head, rule]
    for s in summ:
        line = (f"| {s['model']} | {s['threads']} | {s['kind']} | {s['prompts']} | {s['median_speedup']:.2f}x | "
                f"{s['min_speedup']:.2f}x | {s['max_speedup']:.2f}x | "
                f"{s['median_plain_tok_s']:.1f} | {s['median_spec_tok_s']:.1f} |")
        if with_peer:
            line += (f" {s['median_peer_plain_tok_s']:.1f} | {s['median_peer_spec_tok_s']:.1f} | "
                     f"{s['median_peer_speedup']:.2f}x | {s['median_ours_vs_peer_spec']:.2f}x |")
        lines.append(line)
    head = ("| model | threads | prompt | tokens | plain | speculative | speed-up (pairs' median) | pairs' range "
            "| acceptance | drafted | steps |")
    rule = "|---|---:|---|---:|---:|---:|---:|---|---:|---:|---|"
    if with_peer:
        head += (" peer tokens | peer plain | peer n-gram | peer speed-up | peer acceptance | peer same |"
                 " peer ~ ours |")
        rule += "---:|---:|---:|---:|---:|---|---:|"
    lines += ["", head, rule]
    for r in rows:
        line = (f"| {r['model']} | {r['threads']} | {r['prompt']} | {r['tokens']} | {r['plain_tok_s']:.1f} | "
                f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['speedup_min']:.2f}-{r['speedup_max']:.2f} | "
                f"{r['acceptance']:.2f} | {r['drafted']} | {r['steps_plain']} -> {r['steps_spec']} |")
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
    p.add_argument("--repeats", type=int, default=3, help="alternated plain/speculative pairs per prompt")
    p.add_argument("--split", choices=["heldout", "tune", "all"], default="heldout",
                   help="which half of benchmarks/data/speculative_prompts.json (default: the held-out half)")
    p.add_argument("--only", nargs="*", default=None, help="prompt names to run (default: the whole split)")
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
    prompts = [e for e in load_prompts(args.split) if not args.only or e["name"] in args.only]
    rows = []
    for m in args.models:
        for t in args.threads:
            rows += bench_model(m, t, args.tokens, args.repeats, args.draft_max, prompts, peer, peer_info)
    out = write(rows, args.tag, args, peer_info)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
