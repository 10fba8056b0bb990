"""Does ``streamattn generate --threads 2`` beat ``--threads 1``? Decode and prefill tok/s, variants alternated.

    PYTHONPATH=. python benchmarks/threads_generate.py [--repeats 5] [--tokens 64] [--model smollm2-135m]

Each run is a fresh ``python -m streamattn.cli generate - --ignore-eos --stats`` process on the ~700-token
prompt of benchmarks/data/prompt_rome.txt (prefill tok/s over it, then decode tok/s of ``--tokens``
tokens). Variants, in an order that flips every repeat:

- ``1 thread``, ``2 threads``: what a user gets (streamattn/runtime/threads.py sets the wait policy at import);
- ``2 threads, spin``: the runtimes' own defaults put back by hand (libgomp GOMP_SPINCOUNT=300000,
  OpenBLAS OPENBLAS_THREAD_TIMEOUT=28): the behaviour before the wait policy was set in code;
- ``2 threads, numba 1``: BLAS on 2 threads, Numba's attention on 1 (NUMBA_NUM_THREADS=1).

Prints medians and each variant's ratio to ``1 thread``; writes benchmarks/results/threads_generate_<date>.json.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_llamacpp import PROMPT, ROOT, _communicate_wait4, parse_ours, rates  # noqa: E402

VARIANTS = {
    "1 thread": (1, {}),
    "2 threads": (2, {}),
    "2 threads, spin": (2, {"GOMP_SPINCOUNT": "300000", "OPENBLAS_THREAD_TIMEOUT": "28"}),
    "2 threads, numba 1": (2, {"NUMBA_NUM_THREADS": "1"}),
}


def run_variant(threads: int, env_extra: dict, model: str, tokens: int, extra: list, timeout: float) -> dict:
    """One fresh CLI process; parsed timings and peak RSS."""
    cmd = [sys.executable, "-m", "streamattn.cli", "generate", "-", "--model", model, "--threads", str(threads),
           "--ignore-eos", "--stats", "-q", "-n", str(tokens), *extra]
    with open(PROMPT) as fin:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdin=fin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, **env_extra})
        out, err = _communicate_wait4(proc, timeout)
    err = err.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{err[-2000:]}")
    return {**rates(parse_ours(err)), "rss_mb": proc.rss_mb}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--extra", default="--prefill-chunk 512", help="more `generate` arguments")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    runs, t0, load0 = [], time.time(), os.getloadavg()
    for rep in range(args.repeats):
        order = args.variants if rep % 2 == 0 else args.variants[::-1]
        for name in order:
            threads, env = VARIANTS[name]
            r = run_variant(threads, env, args.model, args.tokens, args.extra.split(), args.timeout)
            runs.append({"variant": name, "repeat": rep, **r})
            print(f"[{rep + 1}/{args.repeats} {time.time() - t0:.0f}s] {name:20s} prefill {r['prefill_tok_s']:6.0f} "
                  f"tok/s  decode {r['decode_tok_s']:6.1f} tok/s", file=sys.stderr, flush=True)
    med = {n: {k: statistics.median(r[k] for r in runs if r["variant"] == n)
               for k in ("prefill_tok_s", "decode_tok_s", "rss_mb")} for n in args.variants}
    base = med.get("1 thread")
    lines = ["| variant | decode tok/s | × 1 thread | prefill tok/s | × 1 thread |", "|---|---:|---:|---:|---:|"]
    for n, m in med.items():
        rd = m["decode_tok_s"] / base["decode_tok_s"] if base else float("nan")
        rp = m["prefill_tok_s"] / base["prefill_tok_s"] if base else float("nan")
        lines.append(f"| {n} | {m['decode_tok_s']:.1f} | {rd:.2f} | {m['prefill_tok_s']:.0f} | {rp:.2f} |")
    table = "\n".join(lines)
    print(table)
    # per-repeat ratios to the 1-thread run of the same repeat: less sensitive to load that drifts over minutes
    paired = {}
    for n in args.variants:
        for k in ("decode_tok_s", "prefill_tok_s"):
            paired[n, k] = [r[k] / b[k] for r in runs for b in runs
                            if r["variant"] == n and b["variant"] == "1 thread" and r["repeat"] == b["repeat"]]
    for n in args.variants:
        if n != "1 thread" and paired[n, "decode_tok_s"]:
            print(f"{n}: per-repeat ratio to 1 thread: decode "
                  f"{', '.join(f'{x:.2f}' for x in paired[n, 'decode_tok_s'])}; prefill "
                  f"{', '.join(f'{x:.2f}' for x in paired[n, 'prefill_tok_s'])}")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    path = args.out / f"threads_generate_{stamp:%Y-%m-%d}.json"
    path.write_text(json.dumps({"command": "PYTHONPATH=. python benchmarks/threads_generate.py "
                                           + " ".join(argv if argv is not None else sys.argv[1:]),
                                "utc": stamp.isoformat(timespec="seconds"), "load_avg_start_end": [load0, os.getloadavg()],
                                "medians": med, "table": table, "runs": runs}, indent=1))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
