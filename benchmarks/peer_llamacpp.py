"""Same-run peer benchmark: streamattn vs llama.cpp (npm node-llama-cpp, prebuilt CPU binaries) end to end.

    bash scripts/install_llamacpp_peer.sh                  # once: llama.cpp into ./.peer/llamacpp
    PYTHONPATH=. python benchmarks/peer_llamacpp.py        # defaults: both models, 1 and 2 threads, 3 repeats
    PYTHONPATH=. python benchmarks/peer_llamacpp.py --ours-args "--prefill-chunk 512 --weights f32"   # the f32 path

Both engines get the same GGUF file, the same prompt text (benchmarks/data/prompt_rome.txt, ~700 tokens),
greedy decoding of exactly ``--tokens`` new tokens (ours: ``generate --ignore-eos``; llama.cpp: the
driver keeps evaluating past end-of-generation tokens) and the same thread count. Each run is a fresh
process: prefill tok/s = prompt tokens / (prompt in -> first token out), decode tok/s = (tokens - 1) /
(first token -> last token), peak RSS from the kernel (``os.wait4``). Runs alternate engine, thread
count and model in every repeat (the order flips each repeat); the table holds medians. Our side's
command line is ``python -m streamattn.cli generate - --model M --threads T --ignore-eos --stats -q -n N``
plus ``--ours-args`` (default ``--prefill-chunk 256 --cache-dtype float16``: the packed kernels gain
little past 64 rows, docs/PERF.md; and llama.cpp keeps K and V as float16 unless told otherwise, its
``type_k``/``type_v`` default, so both engines store the same precision). Results: benchmarks/results/peer_llamacpp_<tag>.{json,md,png}, the tag
defaulting to the date; name a run by date and what it measures, e.g.
``--tag 2026-12-01_smollm2-gemma3_t1-2`` (benchmarks/results/README.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent / "peer_llamacpp.mjs"
PROMPT = Path(__file__).resolve().parent / "data" / "prompt_rome.txt"
MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}     # our names -> streamattn.gguf.hub names
ENGINES = ("streamattn", "llama.cpp")
_OURS_STATS = re.compile(r"\[prompt (\d+) tokens, prefill (\d+) ms; (\d+) decode steps, ([\d.]+) tok/s\]")


# ---------------------------------------------------------------------------------------- parsing
def parse_ours(stderr: str) -> dict:
    """Timings from ``streamattn generate --stats`` stderr: its last ``[prompt N tokens, ...]`` line.

    Returns ``{"prompt_tokens", "prefill_s", "decode_steps", "decode_s"}``; ValueError if no such line.
    """
    found = _OURS_STATS.findall(stderr)
    if not found:
        raise ValueError(f"no '[prompt N tokens, prefill X ms; S decode steps, R tok/s]' line in streamattn's "
                         f"stderr (last 500 chars: {stderr[-500:]!r})")
    prompt, prefill_ms, steps, tok_s = found[-1]
    steps, tok_s = int(steps), float(tok_s)
    return {"prompt_tokens": int(prompt), "prefill_s": int(prefill_ms) / 1e3, "decode_steps": steps,
            "decode_s": steps / tok_s if tok_s > 0 else float("inf")}


def parse_peer(stdout: str) -> dict:
    """Timings from the node driver's JSON line (the last line of its stdout that parses as JSON)."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(d, dict) and {"prompt_tokens", "prefill_s", "decode_s", "decode_steps"} <= d.keys():
            return {k: d[k] for k in ("prompt_tokens", "prefill_s", "decode_steps", "decode_s", "llama_cpp")
                    if k in d}
    raise ValueError(f"no JSON result line in the llama.cpp driver's stdout (last 500 chars: {stdout[-500:]!r})")


def rates(run: dict) -> dict:
    """Add prefill and decode tok/s to one parsed run."""
    return {**run, "prefill_tok_s": run["prompt_tokens"] / run["prefill_s"],
            "decode_tok_s": run["decode_steps"] / run["decode_s"]}


def summarize(runs: list) -> list:
    """Medians per (model, threads, engine) over repeats, plus ours/llama.cpp ratios.

    Parameters
    ----------
    runs : list of dict
        Each with model, threads, engine, prefill_tok_s, decode_tok_s, rss_mb, prompt_tokens.

    Returns
    -------
    list of dict, one per (model, threads) in first-seen order: ``{"model", "threads", "n",
    "<engine>": {"prefill_tok_s", "decode_tok_s", "rss_mb", "prompt_tokens"}, "decode_ratio",
    "prefill_ratio"}`` (ratio = streamattn / llama.cpp; None where an engine has no run).
    """
    keys = list(dict.fromkeys((r["model"], r["threads"]) for r in runs))
    rows = []
    for model, threads in keys:
        row = {"model": model, "threads": threads}
        for engine in ENGINES:
            mine = [r for r in runs if (r["model"], r["threads"], r["engine"]) == (model, threads, engine)]
            row[engine] = {k: statistics.median(r[k] for r in mine)
                           for k in ("prefill_tok_s", "decode_tok_s", "rss_mb", "prompt_tokens")} if mine else None
            row[f"n_{engine}"] = len(mine)
        both = row["streamattn"] and row["llama.cpp"]
        for what in ("decode", "prefill"):
            row[f"{what}_ratio"] = (row["streamattn"][f"{what}_tok_s"] / row["llama.cpp"][f"{what}_tok_s"]
                                    if both else None)
        rows.append(row)
    return rows


def markdown(rows: list) -> str:
    """The summary as a markdown table (medians; ratio = streamattn / llama.cpp)."""
    def f(x, spec=".0f"):
        return "–" if x is None else format(x, spec)

    out = ["| model | threads | decode tok/s llama.cpp | decode tok/s streamattn | ratio | prefill tok/s llama.cpp "
           "| prefill tok/s streamattn | ratio | peak RSS MB llama.cpp | peak RSS MB streamattn |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p, o = r["llama.cpp"] or {}, r["streamattn"] or {}
        out.append(f"| {r['model']} | {r['threads']} | {f(p.get('decode_tok_s'))} | {f(o.get('decode_tok_s'))} | "
                   f"{f(r['decode_ratio'], '.2f')}× | {f(p.get('prefill_tok_s'))} | {f(o.get('prefill_tok_s'))} | "
                   f"{f(r['prefill_ratio'], '.2f')}× | {f(p.get('rss_mb'))} | {f(o.get('rss_mb'))} |")
    return "\n".join(out) + "\n"


def plot(rows: list, path: Path) -> bool:
    """Decode and prefill tok/s per model and thread count, both engines side by side. False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    labels = [f"{r['model']}\n{r['threads']} thr" for r in rows]
    for ax, (key, title) in zip(axes, (("decode_tok_s", "decode tok/s"), ("prefill_tok_s", "prefill tok/s"),
                                       ("rss_mb", "peak RSS (MB)"))):
        for i, engine in enumerate(ENGINES):
            vals = [(r[engine] or {}).get(key, 0.0) for r in rows]
            ax.bar([x + (i - 0.5) * 0.4 for x in range(len(rows))], vals, 0.4, label=engine)
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("streamattn vs llama.cpp (node-llama-cpp), same GGUF, same prompt, greedy; medians")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------- running
def resolve_path(name: str) -> Path:
    """``streamattn.gguf.hub.resolve_model(name)``, asked of a child process. This process must not load
    Numba: a page of its LLVM library mapped here too stays resident in our engine's process, whose
    release of those pages (streamattn.memory.release_compiler_pages) skips shared ones, and its peak
    RSS read 287-289 MB here against 267 MB for the same command run alone (2026-12-01)."""
    code = "import sys; from streamattn.gguf.hub import resolve_model; print(resolve_model(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, name], cwd=ROOT, check=True, capture_output=True, text=True)
    sys.stderr.write(out.stderr)
    return Path(out.stdout.strip())


def run_one(engine: str, model_path: Path, threads: int, tokens: int, ours_args: list, peer_dir: Path,
            timeout: float) -> dict:
    """One fresh-process run of one engine; parsed timings plus ``rss_mb`` (peak resident set)."""
    if engine == "streamattn":
        cmd = [sys.executable, "-m", "streamattn.cli", "generate", "-", "--model", str(model_path),
               "--threads", str(threads), "--ignore-eos", "--stats", "-q", "-n", str(tokens), *ours_args]
        cwd, feed = ROOT, True
    else:
        cmd = ["node", str(peer_dir / DRIVER.name), json.dumps({"model": str(model_path), "prompt_file": str(PROMPT),
                                                               "tokens": tokens, "threads": threads})]
        cwd, feed = peer_dir, False
    t = time.perf_counter()
    with open(PROMPT) if feed else open(os.devnull) as fin:
        proc = subprocess.Popen(cmd, cwd=cwd, stdin=fin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = _communicate_wait4(proc, timeout)
    wall = time.perf_counter() - t
    out, err = out.decode(errors="replace"), err.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} exited {proc.returncode}: {shlex.join(cmd)}\n{err[-2000:]}")
    parsed = parse_ours(err) if engine == "streamattn" else parse_peer(out)
    return {**rates(parsed), "rss_mb": proc.rss_mb, "wall_s": wall}


def _communicate_wait4(proc, timeout: float) -> tuple:
    """communicate() that reaps the child with os.wait4, keeping its own peak RSS on ``proc.rss_mb``."""
    import threading
    bufs = {}

    def drain(name, stream):
        bufs[name] = stream.read()

    readers = [threading.Thread(target=drain, args=(n, s)) for n, s in (("out", proc.stdout), ("err", proc.stderr))]
    for r in readers:
        r.start()
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            os.wait4(proc.pid, 0)
            raise RuntimeError(f"{proc.args[0]} ran past {timeout:.0f} s")
        time.sleep(0.05)
    for r in readers:
        r.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.rss_mb = usage.ru_maxrss / 1024                  # Linux: KiB
    return bufs["out"], bufs["err"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per run (exactly: EOS ignored)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine/model/threads (medians)")
    ap.add_argument("--ours-args", default="--prefill-chunk 256 --cache-dtype float16",
                    help="extra arguments for `streamattn generate` (e.g. \"--prefill-chunk 512 --weights f32\")")
    ap.add_argument("--peer-dir", type=Path, default=ROOT / ".peer" / "llamacpp",
                    help="where scripts/install_llamacpp_peer.sh put node-llama-cpp")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it is killed")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--tag", default=None, help="file name suffix (default: today's date, UTC)")
    args = ap.parse_args(argv)

    if not (args.peer_dir / "node_modules" / "node-llama-cpp").is_dir():
        print(f"peer_llamacpp: node-llama-cpp not found under {args.peer_dir}; run "
              f"bash scripts/install_llamacpp_peer.sh first", file=sys.stderr)
        return 2
    shutil.copy(DRIVER, args.peer_dir / DRIVER.name)     # ESM resolves packages from the script's folder
    paths = {m: resolve_path(MODELS[m]) for m in args.models}
    ours_args = shlex.split(args.ours_args)
    plan = [(m, t, e) for m in args.models for t in args.threads for e in ENGINES]
    runs, t_start, load_start = [], time.time(), os.getloadavg()
    for rep in range(args.repeats):
        order = plan if rep % 2 == 0 else plan[::-1]
        for i, (model, threads, engine) in enumerate(order):
            r = run_one(engine, paths[model], threads, args.tokens, ours_args, args.peer_dir, args.timeout)
            runs.append({"model": model, "threads": threads, "engine": engine, "repeat": rep, **r})
            print(f"[{rep + 1}/{args.repeats} {i + 1}/{len(order)} {time.time() - t_start:.0f}s] {model} "
                  f"{threads} thr {engine:10s}: prompt {r['prompt_tokens']} tok, prefill {r['prefill_tok_s']:.0f} "
                  f"tok/s, decode {r['decode_tok_s']:.1f} tok/s, peak RSS {r['rss_mb']:.0f} MB", file=sys.stderr)
    rows = summarize(runs)
    table = markdown(rows)
    tag = args.tag or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"peer_llamacpp_{tag}"
    cmdline = "PYTHONPATH=. python benchmarks/peer_llamacpp.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    meta = {"command": cmdline.strip(), "ours_args": args.ours_args, "tokens": args.tokens, "repeats": args.repeats,
            "prompt_file": str(PROMPT.relative_to(ROOT)), "load_avg_start_end": [load_start, os.getloadavg()],
            "llama_cpp": next((r.get("llama_cpp") for r in runs if r.get("llama_cpp")), None),
            "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": rows, "runs": runs}, indent=1))
    stem.with_suffix(".md").write_text(f"`{meta['command']}` ({meta['utc']}, load average at the end "
                                       f"{os.getloadavg()[0]:.1f})\n\n{table}")
    plot(rows, stem.with_suffix(".png"))
    print(table)
    print(f"wrote {stem}.json/.md/.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
