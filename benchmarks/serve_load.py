"""How does `streamattn serve` scale with concurrent clients? Aggregate tok/s, TTFT and inter-token latency.

    PYTHONPATH=. python benchmarks/serve_load.py --start [--parallel 16] [--requests 16] [--max-tokens 32]
    PYTHONPATH=. python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model-id NAME

For each concurrency level (1, 2, 4, 8, 16) it sends max(--requests, level) streaming text completions,
``level`` at a time, each a different short prompt, greedy, ``ignore_eos`` so every request makes exactly
--max-tokens tokens, prompt cache off (decode is measured, not the cache). Per request it records the time
to the first token (TTFT) and the gaps between later tokens (inter-token latency, ITL). Per level:
aggregate tok/s = all tokens / wall time of the level; decode tok/s = tokens after each request's first /
wall time from the first token of the level to the last. Checked before timing: every request returns
exactly --max-tokens tokens. Writes benchmarks/results/serve_load_<date>.{json,txt,png}; name a run by date
and what it measures with --out, e.g. ``serve_load_2026-12-01_smollm2_t2`` (benchmarks/results/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):", "The sky is", "Water boils at",
           "My favourite food is", "Once upon a time", "The largest planet is", "In 1492,", "A good recipe for",
           "The quick brown fox", "Dear diary,", "import numpy as", "The moon is", "Rain in spring", "Hello, my"]


async def one(http, url, model, prompt, n):
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "cache_prompt": False, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, tokens = [], None
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
    return {"t0": t0, "stamps": stamps, "tokens": tokens}


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


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(c, [r["aggregate_tok_s"] for r in rows], "o-", label="aggregate (incl. prefill, TTFT)")
    a.plot(c, [r["decode_tok_s"] for r in rows], "s-", label="decode")
    a.set(xscale="log", xlabel="concurrent clients", ylabel="tokens / s", title="throughput")
    a.set_xticks(c, [str(x) for x in c])
    a.legend()
    for key, m in (("ttft", "o"), ("itl", "s")):
        for q, ls in (("p50", "-"), ("p99", "--")):
            b.plot(c, [r[f"{key}_{q}_s"] * 1e3 for r in rows], marker=m, ls=ls, label=f"{key.upper()} {q}")
    b.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title="latency")
    b.set_xticks(c, [str(x) for x in c])
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
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
    p.add_argument("--out", default=f"benchmarks/results/serve_load_{datetime.date.today()}")
    args = p.parse_args(argv)
    if not args.url and not args.start:
        p.error("give --url of a running server or --start")
    proc = None
    if args.start:
        proc, args.url = start_server(args)
    try:
        asyncio.run(level(args.url, args.model_id, 1, 1, 4))                         # warm-up
        rows = []
        for conc in (int(x) for x in args.concurrency.split(",")):
            r = asyncio.run(level(args.url, args.model_id, conc, max(args.requests, conc), args.max_tokens))
            rows.append(r)
            print(f"c={conc:3d}  {r['aggregate_tok_s']:7.1f} tok/s  decode {r['decode_tok_s']:7.1f} tok/s  TTFT "
                  f"p50/p99 {r['ttft_p50_s'] * 1e3:7.0f}/{r['ttft_p99_s'] * 1e3:7.0f} ms  ITL p50/p99 "
                  f"{r['itl_p50_s'] * 1e3:6.0f}/{r['itl_p99_s'] * 1e3:6.0f} ms", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cmd": " ".join(sys.argv), "max_tokens": args.max_tokens, "parallel": args.parallel,
            "threads": args.threads, "load_avg": os.getloadavg(), "cpus": os.cpu_count(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    base = rows[0]["decode_tok_s"]
    lines = [f"# {meta}", "conc  agg_tok/s  decode_tok/s  x(c=1)  ttft_p50_ms  ttft_p99_ms  itl_p50_ms  itl_p99_ms"]
    lines += [f"{r['concurrency']:4d}  {r['aggregate_tok_s']:9.1f}  {r['decode_tok_s']:12.1f}  "
              f"{r['decode_tok_s'] / base:6.2f}  {r['ttft_p50_s'] * 1e3:11.0f}  {r['ttft_p99_s'] * 1e3:11.0f}  "
              f"{r['itl_p50_s'] * 1e3:10.0f}  {r['itl_p99_s'] * 1e3:10.0f}" for r in rows]
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
