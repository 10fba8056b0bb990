"""How does `streamattn serve` scale with concurrent clients? Aggregate tok/s, TTFT and inter-token latency.

    PYTHONPATH=. python benchmarks/serve_load.py --start [--parallel 16] [--requests 16] [--max-tokens 32]
    PYTHONPATH=. python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model-id NAME

For each concurrency level (1, 2, 4, 8, 16) it sends max(--requests, level) streaming text completions,
``level`` at a time, each a different short prompt, greedy, ``ignore_eos`` so every request makes exactly
--max-tokens tokens, prompt cache off (decode is measured, not the cache). Per request it records the time
to the first token (TTFT) and the gaps between later tokens (inter-token latency, ITL). Per level:
aggregate tok/s = all tokens / wall time of the level; decode tok/s = tokens after each request's first /
wall time from the first token of the level to the last. Checked before timing: every request returns
exactly --max-tokens tokens. Writes benchmarks/results/serve_load_<date>.{json,txt,md,png}; name a run by
date and what it measures with --out, e.g. ``serve_load_2026-12-01_smollm2_t2`` (benchmarks/results/README.md).

    PYTHONPATH=. python benchmarks/serve_load.py --start --peer llama-server [--threads 2] [--repeats 3]

``--peer llama-server`` (with ``--start``) runs the same load against llama-server in the same run: the
binary scripts/install_llamacpp_native.sh built (``--peer-bin`` for another), the same GGUF file as
``--model``, the same slots (``--parallel``), threads (``-t``/``-tb``), clients, prompts and max tokens,
greedy, ``ignore_eos`` and no prompt cache, through the same OpenAI streaming endpoint; its context
``-c`` is ``parallel × (max-tokens + 256)``, room for every slot's request (the prompts are a few
tokens). Both servers stay up for the whole run and the engines alternate at every level (the
order flips each time); with ``--repeats`` every figure is the median over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from streamattn.bench.llama_server import LlamaServer, find_binary, server_version

ENGINES = ("streamattn", "llama-server")

PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):", "The sky is", "Water boils at",
           "My favourite food is", "Once upon a time", "The largest planet is", "In 1492,", "A good recipe for",
           "The quick brown fox", "Dear diary,", "import numpy as", "The moon is", "Rain in spring", "Hello, my"]


async def one(http, url, model, prompt, n):
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "cache_prompt": False, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, tokens = [], None
    for attempt in (0, 1):
        try:
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        raise RuntimeError(ev["error"])
                    if ev["choices"] and ev["choices"][0]["text"]:
                        stamps.append(time.perf_counter())
                    if ev.get("usage"):
                        tokens = ev["usage"]["completion_tokens"]
            break
        except httpx.RemoteProtocolError:
            # A kept-alive connection the server closed as this request went out (llama-server did so
            # on back-to-back streamed requests with --threads 2): nothing was answered, so send it
            # once more on a new connection; the clock keeps running from the first try.
            if stamps or attempt:
                raise
    return {"t0": t0, "stamps": stamps, "tokens": tokens, "retried": attempt}


async def level(url, model, conc, n_req, n_tok):
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=conc + 4)) as http:
        async def guarded(i):
            async with sem:
                return await one(http, url, model, PROMPTS[i % len(PROMPTS)], n_tok)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(guarded(i) for i in range(n_req)))
        wall = time.perf_counter() - t0
    bad = [r["tokens"] for r in res if r["tokens"] != n_tok]
    if bad:
        raise RuntimeError(f"requests returned {bad} tokens, expected {n_tok} each")
    ttft = np.array([r["stamps"][0] - r["t0"] for r in res])
    itl = np.concatenate([np.diff(r["stamps"]) for r in res])
    first, last = min(r["stamps"][0] for r in res), max(r["stamps"][-1] for r in res)
    tokens = sum(r["tokens"] for r in res)
    return {"concurrency": conc, "requests": n_req, "tokens": tokens, "wall_s": wall,
            "retried": sum(r["retried"] for r in res),
            "aggregate_tok_s": tokens / wall, "decode_tok_s": (tokens - n_req) / max(last - first, 1e-9),
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "itl_p50_s": float(np.percentile(itl, 50)), "itl_p99_s": float(np.percentile(itl, 99))}


def start_server(args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "streamattn.cli", "serve", "--port", str(port), "--parallel", str(args.parallel),
           "--threads", str(args.threads), "--model-id", args.model_id, "--max-queue", "64"]
    if args.model:
        cmd += ["--model", args.model]
    cmd += shlex.split(args.ours_args)
    proc = subprocess.Popen(cmd, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not become healthy")


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def median_row(runs: list) -> dict:
    """One level's figures as the medians over its repeats (``runs``: rows of :func:`level`); ``retried``
    summed."""
    def over_repeats(k):
        if k in ("concurrency", "requests", "tokens"):
            return runs[0][k]
        return sum(r[k] for r in runs) if k == "retried" else statistics.median(r[k] for r in runs)
    return {k: over_repeats(k) for k in runs[0]} | {"repeats": len(runs)}


def markdown(by_engine: dict) -> str:
    """Per level: aggregate tok/s of each engine (and ours / llama-server's where both ran), decode tok/s,
    TTFT p50 and inter-token latency p50/p99."""
    engines = [e for e in ENGINES if e in by_engine]
    pair = " / ".join(engines)
    both = len(engines) == 2
    head = ["clients", f"aggregate tok/s {pair}"] + (["ratio"] if both else []) + [
        f"decode tok/s {pair}", f"TTFT p50 ms {pair}", f"ITL p50 ms {pair}", f"ITL p99 ms {pair}"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---:"] * len(head)) + "|"]
    for i, ours in enumerate(by_engine[engines[0]]):
        rows = [by_engine[e][i] for e in engines]

        def cell(key, scale=1.0, spec=".0f"):
            return " / ".join(format(r[key] * scale, spec) for r in rows)
        cells = [str(ours["concurrency"]), cell("aggregate_tok_s")]
        if both:
            cells.append(f"{rows[0]['aggregate_tok_s'] / rows[1]['aggregate_tok_s']:.2f}×")
        cells += [cell("decode_tok_s"), cell("ttft_p50_s", 1e3), cell("itl_p50_s", 1e3, ".1f"),
                  cell("itl_p99_s", 1e3, ".1f")]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(by_engine: dict, path):
    """Throughput and latency over the levels, one colour per engine."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for colour, (engine, rows) in zip(("C0", "C1"), by_engine.items()):
        c = [r["concurrency"] for r in rows]
        a.plot(c, [r["aggregate_tok_s"] for r in rows], "o-", color=colour,
               label=f"{engine} aggregate (incl. prefill, TTFT)")
        a.plot(c, [r["decode_tok_s"] for r in rows], "s--", color=colour, label=f"{engine} decode")
        for key, m in (("ttft", "o"), ("itl", "s")):
            for q, ls in (("p50", "-"), ("p99", "--")):
                b.plot(c, [r[f"{key}_{q}_s"] * 1e3 for r in rows], marker=m, ls=ls, color=colour,
                       alpha=1.0 if key == "itl" else 0.5, label=f"{engine} {key.upper()} {q}")
    a.set(xscale="log", xlabel="concurrent clients", ylabel="tokens / s", title="throughput")
    b.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title="latency")
    for ax in (a, b):
        ax.set_xticks(c, [str(x) for x in c])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _levels(text: str) -> list:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must be comma-separated positive integers, e.g. 1,8,16 (got {text!r})")
    return levels


def parse_args(argv=None):
    """The command line, checked: every count positive, ``--peer`` only with ``--start``, a llama-server
    binary that exists (``args.peer_bin`` resolved, ``args.peer_status`` what its install recorded)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (else --start)")
    p.add_argument("--start", action="store_true", help="start a server for the run (stopped after)")
    p.add_argument("--model", default=None, help="with --start: model name or .gguf path")
    p.add_argument("--model-id", default="bench", help="the served model id")
    p.add_argument("--parallel", type=int, default=16, help="with --start: sequence slots")
    p.add_argument("--threads", type=int, default=1, help="with --start: CPU threads")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--requests", type=int, default=16, help="requests per level (at least the level)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ours-args", default="", help="with --start: more flags for `streamattn serve` (e.g. "
                                                   "\"--cache-dtype float16\", llama-server's K/V type)")
    p.add_argument("--repeats", type=int, default=1, help="rounds over all levels (medians; engines alternate)")
    p.add_argument("--peer", choices=["llama-server"], help="with --start: the same load against llama-server")
    p.add_argument("--peer-bin", default=None, help="llama-server binary (default: the one "
                                                     "scripts/install_llamacpp_native.sh built)")
    p.add_argument("--out", default=f"benchmarks/results/serve_load_{datetime.date.today()}")
    args = p.parse_args(argv)
    if not args.url and not args.start:
        p.error("give --url of a running server or --start")
    if args.peer and not args.start:
        p.error("--peer llama-server needs --start: both servers must serve the same model file (--model)")
    try:
        args.levels = _levels(args.concurrency)
    except ValueError as e:
        p.error(str(e))
    for name in ("parallel", "threads", "requests", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    try:
        shlex.split(args.ours_args)
    except ValueError as e:
        p.error(f"--ours-args {args.ours_args!r} is not a shell-quoted argument list ({e})")
    args.peer_status = {}
    if args.peer:
        try:
            binary, args.peer_status = find_binary(args.peer_bin)
        except FileNotFoundError as e:
            p.error(str(e))
        args.peer_bin = str(binary)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = {}                                      # engine -> concurrency -> [level rows over repeats]
    peer_info = None
    with contextlib.ExitStack() as stack:
        urls = {}
        if args.start:
            proc, urls["streamattn"] = start_server(args)
            stack.callback(stop_server, proc)
        else:
            urls["streamattn"] = args.url
        if args.peer:
            from streamattn.gguf.hub import resolve_model
            gguf = resolve_model(args.model, quiet=True)
            srv = stack.enter_context(LlamaServer(args.peer_bin, gguf, args.threads, parallel=args.parallel,
                                                  ctx=args.parallel * (args.max_tokens + 256)))
            urls["llama-server"] = srv.url
            peer_info = {"engine": "llama-server", "bin": args.peer_bin, "command": shlex.join(srv.cmd),
                         "cpu_variant": srv.cpu_variant(), "build": server_version(args.peer_bin) or None,
                         "llama_cpp_python": args.peer_status.get("llama_cpp_python"), "gguf": str(gguf)}
            print(f"llama-server: CPU variant {peer_info['cpu_variant']}", flush=True)
        for url in urls.values():
            asyncio.run(level(url, args.model_id, 1, 1, 4))                          # warm-up
        runs = {e: {c: [] for c in args.levels} for e in urls}
        turn = 0
        for rep in range(args.repeats):
            for conc in args.levels:
                order = list(urls) if turn % 2 == 0 else list(urls)[::-1]
                turn += 1
                for engine in order:
                    try:
                        r = asyncio.run(level(urls[engine], args.model_id, conc, max(args.requests, conc),
                                              args.max_tokens))
                    except Exception:
                        if engine == "llama-server":
                            srv.raise_if_dead(f"died under {conc} clients")
                        raise
                    runs[engine][conc].append(r)
                    print(f"{engine:12s} c={conc:3d}  {r['aggregate_tok_s']:7.1f} tok/s  decode "
                          f"{r['decode_tok_s']:7.1f} tok/s  TTFT p50/p99 {r['ttft_p50_s'] * 1e3:7.0f}/"
                          f"{r['ttft_p99_s'] * 1e3:7.0f} ms  ITL p50/p99 {r['itl_p50_s'] * 1e3:6.0f}/"
                          f"{r['itl_p99_s'] * 1e3:6.0f} ms" + (f"  ({r['retried']} sent again)" if r["retried"] else ""),
                          flush=True)
    by_engine = {e: [median_row(runs[e][c]) for c in args.levels] for e in runs}
    rows = by_engine["streamattn"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "PYTHONPATH=. python benchmarks/serve_load.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    meta = {"cmd": command, "max_tokens": args.max_tokens, "parallel": args.parallel, "ours_args": args.ours_args,
            "threads": args.threads, "repeats": args.repeats, "load_avg": os.getloadavg(), "cpus": os.cpu_count(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    doc = {"meta": meta, "rows": rows}
    if peer_info:
        doc |= {"peer": peer_info, "peer_rows": by_engine["llama-server"],
                "runs": {e: {str(c): v for c, v in lv.items()} for e, lv in runs.items()}}
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [f"# {meta}"]
    for engine, erows in by_engine.items():
        base = erows[0]["decode_tok_s"]
        lines += [f"# {engine}" + (f" ({peer_info['command']})" if engine == "llama-server" else ""),
                  "conc  agg_tok/s  decode_tok/s  x(c=1)  ttft_p50_ms  ttft_p99_ms  itl_p50_ms  itl_p99_ms"]
        lines += [f"{r['concurrency']:4d}  {r['aggregate_tok_s']:9.1f}  {r['decode_tok_s']:12.1f}  "
                  f"{r['decode_tok_s'] / base:6.2f}  {r['ttft_p50_s'] * 1e3:11.0f}  {r['ttft_p99_s'] * 1e3:11.0f}  "
                  f"{r['itl_p50_s'] * 1e3:10.0f}  {r['itl_p99_s'] * 1e3:10.0f}" for r in erows]
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    table = markdown(by_engine)
    out.with_suffix(".md").write_text(f"`{meta['cmd']}` ({meta['date']}, {args.parallel} slots, {args.threads} "
                                      f"thread(s), {args.max_tokens} tokens a request, load average "
                                      f"{meta['load_avg'][0]:.1f})\n\n{table}")
    print("\n".join(lines))
    print(table)
    plot(by_engine, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
