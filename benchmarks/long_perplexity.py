"""Does a real model stay good far past its trained context? Perplexity against position (issue 15, item 4).

    bash scripts/get_text.sh        # the Python 3.11 tutorial + HOWTOs from Debian's python3.11-doc
    PYTHONPATH=. nice -n 5 python benchmarks/long_perplexity.py [--tokens 16384] [--full-tokens 8192]
        [--chunk 256] [--configs d,c,b,a] [--offset N] [--out benchmarks/results/long_perplexity]

SmolLM2-135M (trained context 8,192) over the text, teacher-forced through the caches in chunks:
(a) the full cache up to the trained context, (b) a window of 1,024 keys without sinks, (c) 4 sinks + a
window of 1,020 with RoPE at absolute positions, (d) the same at cache positions (StreamingLLM). Each
configuration's JSON is written as soon as it finishes (``OUT_<name>.json``; rerun with the same ``--out``
to skip those already done), then the PNG and a markdown table of perplexity per bucket.

Before anything is timed, a correctness check: on 40 tokens, a sinks cache whose window holds them all
gives the full cache's logits with cache positions (nothing has slid, so cache = absolute positions).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from streamattn.gguf.hub import resolve_model
from streamattn.gguf.loader import load_gguf
from streamattn.engine.perplexity import label, load_ids, perplexity, plot, progress_bar
from streamattn.text.tokenizer import Tokenizer
from streamattn.models.transformer import Transformer
from streamattn.runtime.threads import set_threads

CONFIGS = {  # name -> perplexity() keywords
    "a": dict(cache="full"),
    "b": dict(cache="window", window=1024),
    "c": dict(cache="sinks", window=1020, sinks=4, positions="absolute"),
    "d": dict(cache="sinks", window=1020, sinks=4, positions="cache"),
}
TEXT = "out/texts/python311_tutorial_howto.txt"


def check(tf: Transformer, ids) -> float:
    """max |logits(sinks, cache positions) - logits(full)| on ``ids`` (a window longer than them).

    Run it on float32 weights: the packed path quantizes activations to 8 bits per matmul, so a last-bit
    difference in summation order (the sinks kernel sums its two segments separately) can flip a rounding
    and move logits by up to ~1 (measured 0.64 on 40 tokens), which would hide a real positions bug.
    """
    n = len(ids)
    full = tf.forward(np.asarray([ids]), tf.new_caches(mode="full", max_chunk=n))
    sink = tf.forward(np.asarray([ids]), tf.new_caches(mode="sinks", window=n, sinks=4, max_chunk=n),
                      positions="cache")
    return float(np.abs(full - sink).max())


def table(results: list, marks=(0, 1000, 4000, 8000, 12000, 16000, 32000, 48000, 64000)) -> str:
    """Markdown table: perplexity of the bucket starting at each mark, and the last bucket."""
    starts = sorted({m for m in marks if any(b["start"] == m for r in results for b in r["buckets"])})
    head = "| configuration | tokens | " + " | ".join(f"@{s // 1000}k" for s in starts) + " | last bucket | tok/s |"
    rows = [head, "|" + "---|" * (len(starts) + 4)]
    for r in results:
        at = {b["start"]: b["ppl"] for b in r["buckets"]}
        last = r["buckets"][-1]
        cells = [f"{at[s]:.2f}" if s in at else "" for s in starts]
        rows.append(f"| {label(r)} | {r['tokens']} | " + " | ".join(cells)
                    + f" | {last['ppl']:.2f} ({last['start']}-{last['end']}) | {r['tok_s']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=TEXT)
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=16384, help="tokens scored by (b), (c), (d)")
    p.add_argument("--full-tokens", type=int, default=8192, help="tokens scored by (a): the trained context")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--bucket", type=int, default=1000)
    p.add_argument("--configs", default="d,c,b,a", help="which of a,b,c,d to run, in this order")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--weights", choices=("quant", "f32"), default="f32",
                   help="f32: the reference path (and the faster one for chunked prefill today)")
    p.add_argument("--offset", type=int, default=0,
                   help="start the stream at this token of the text (a content-controlled check: the same "
                        "tokens scored at another stream position)")
    p.add_argument("--out", default="benchmarks/results/long_perplexity")
    args = p.parse_args(argv)
    names = args.configs.split(",")
    if not set(names) <= set(CONFIGS):
        raise SystemExit(f"--configs must name some of {sorted(CONFIGS)} (got {args.configs!r})")
    set_threads(args.threads)
    path = resolve_model(args.model, quiet=True)
    m = load_gguf(path, weights="f32")
    tok = Tokenizer.from_metadata(m.metadata)
    ids = load_ids(args.text, tok, args.offset + max(args.tokens, args.full_tokens))
    err = check(Transformer(m), ids[:40])
    if args.weights != "f32":
        m = load_gguf(path, weights=args.weights)
    tf = Transformer(m)
    print(f"check: sinks cache holding all 40 tokens, cache positions vs full cache: max |dlogit| = {err:.2e}",
          file=sys.stderr)
    if err > 1e-3:
        raise SystemExit("correctness check failed: cache positions differ from absolute ones before any slide")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        out = Path(f"{args.out}_{name}.json")
        if out.exists():
            print(f"({name}) {out} exists: skipped", file=sys.stderr)
            continue
        n = args.full_tokens if name == "a" else args.tokens
        kw = CONFIGS[name]
        print(f"({name}) {label({'window': None, 'sinks': 0, 'positions': 'absolute', **kw})}: {n} tokens, "
              f"chunk {args.chunk}, started {time.strftime('%H:%M:%S')}", file=sys.stderr)
        if args.offset + n + 1 > len(ids):
            raise SystemExit(f"--offset {args.offset} + {n} tokens runs past the text ({len(ids)} tokens)")
        r = perplexity(tf, ids[args.offset:args.offset + n + 1], chunk=args.chunk, bucket=args.bucket,
                       progress=progress_bar(False), **kw)
        r = {"config": name, "file": args.text, "model": path.name, "weights": args.weights,
             "offset": args.offset, **r}
        out.write_text(json.dumps(r, indent=1) + "\n")
    results = [json.loads(Path(f"{args.out}_{n}.json").read_text()) for n in sorted(CONFIGS)
               if Path(f"{args.out}_{n}.json").exists()]
    plot(results, f"{args.out}.png", trained_context=m.config.context_length,
         title=f"{path.name} over {Path(args.text).name}: perplexity per {args.bucket}-token bucket")
    text = table(results)
    Path(f"{args.out}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
