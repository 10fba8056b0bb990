"""Same-run peer benchmark: streamattn vs llama.cpp (npm node-llama-cpp, prebuilt CPU binaries) end to end.

    bash scripts/install_llamacpp_peer.sh                  # once: llama.cpp into ./.peer/llamacpp
    PYTHONPATH=. python benchmarks/peer_llamacpp.py        # defaults: both models, 1 and 2 threads, 3 repeats
    PYTHONPATH=. python benchmarks/peer_llamacpp.py --ours-args "--prefill-chunk 512 --weights f32"   # the f32 path
    PYTHONPATH=. python benchmarks/peer_llamacpp.py --noise both   # quiet and beside a 50% busy neighbour
    PYTHONPATH=. python benchmarks/peer_llamacpp.py --models /work/fixtures/llama-3.2-1b-q4_k_m.gguf  # any GGUF

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

``--noise [DUTY ...]`` runs every engine run beside a noisy neighbour (streamattn/bench/noise.py: one
process keeping one core busy DUTY% of every ``--noise-period-ms``, default 50% of 10 ms; killed after
each run, and on every error); ``--noise both`` = ``--noise 0 50``: quiet and noisy runs alternated in
the same repeats, their columns side by side. ``0`` is quiet (no process).

Beside each decode figure, the % of the memory wall (streamattn/bench/memory_wall.py): the bytes a step
must read (the file's packed weights, float16 K/V of the visible keys; the same for both engines) × tok/s
over the read bandwidth probed in the same run at that thread count, once per model, thread count and
repeat, right before that model's runs at that thread count. The probe runs without the neighbour: a
busy loop takes CPU time, not memory bandwidth, so the wall is the host's own and a noisy run's % says
how far the neighbour pushes an engine from it. ``--ceiling-mb 0`` skips the probe.
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
BENCH = ROOT / "streamattn" / "bench"
DRIVER = Path(__file__).resolve().parent / "peer_llamacpp.mjs"
PROMPT = Path(__file__).resolve().parent / "data" / "prompt_rome.txt"
MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}     # our names -> streamattn.gguf.hub names
ENGINES = ("streamattn", "llama.cpp")
_OURS_STATS = re.compile(r"\[prompt (\d+) tokens, prefill (\d+) ms; (\d+) decode steps, ([\d.]+) tok/s"
                         r"(?:; (\d+) on (\d+) threads)?\]")


def _standalone(name: str):
    """streamattn/bench/<name>.py loaded by its path, without the package's __init__ (which loads Numba,
    see resolve_path): the helpers this process uses are standard library only."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"_peer_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


noise = _standalone("noise")
wall = _standalone("memory_wall")


def noise_levels(values) -> list:
    """``--noise`` as duty percents: absent (None) -> [0] (quiet); given bare ([]) -> [50]; ``both`` ->
    [0, 50]; else each a number in 0..100, kept in the given order without repeats. ValueError naming a
    bad value."""
    if values is None:
        return [0]
    out = []
    for v in values or ["50"]:
        for duty in ([0, 50] if v == "both" else [_duty(v)]):
            if duty not in out:
                out.append(duty)
    return out


def _duty(text: str):
    try:
        duty = float(text)
    except ValueError:
        duty = float("nan")
    if not 0 <= duty <= 100:
        raise ValueError(f"--noise takes duty percents in 0..100 or 'both' (got {text!r})")
    return int(duty) if duty.is_integer() else duty


def noise_label(duty) -> str:
    return "quiet" if duty == 0 else f"noise {duty:g}%"


# ---------------------------------------------------------------------------------------- parsing
def parse_ours(stderr: str) -> dict:
    """Timings from ``streamattn generate --stats`` stderr: its last ``[prompt N tokens, ...]`` line.

    Returns ``{"prompt_tokens", "prefill_s", "decode_steps", "decode_s"}`` and, with more than one
    thread, ``decode_steps_on_ceiling`` (the steps the thread chooser ran on them all); ValueError if no
    such line.
    """
    found = _OURS_STATS.findall(stderr)
    if not found:
        raise ValueError(f"no '[prompt N tokens, prefill X ms; S decode steps, R tok/s]' line in streamattn's "
                         f"stderr (last 500 chars: {stderr[-500:]!r})")
    prompt, prefill_ms, steps, tok_s, on, threads = found[-1]
    steps, tok_s = int(steps), float(tok_s)
    out = {"prompt_tokens": int(prompt), "prefill_s": int(prefill_ms) / 1e3, "decode_steps": steps,
           "decode_s": steps / tok_s if tok_s > 0 else float("inf")}
    if on:                        # how many decode steps the thread chooser ran on the count asked for
        out["decode_steps_on_ceiling"] = int(on)
    return out


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
    """Medians per (model, threads, noise, engine) over repeats, plus ours/llama.cpp ratios.

    Parameters
    ----------
    runs : list of dict
        Each with model, threads, engine, prefill_tok_s, decode_tok_s, rss_mb, prompt_tokens; optionally
        ``noise`` (duty %, 0 when absent) and, where the memory wall was probed, ``wall_pct`` (% of the
        wall the decode reached), ``wall_tok_s`` (the decode tok/s at the wall) and ``ceiling_gbps``.

    Returns
    -------
    list of dict, one per (model, threads, noise) in first-seen order: ``{"model", "threads", "noise",
    "<engine>": {"prefill_tok_s", "decode_tok_s", "rss_mb", "prompt_tokens"[, "wall_pct"]},
    "n_<engine>", "decode_ratio", "prefill_ratio"[, "wall_tok_s", "ceiling_gbps"]}`` (ratio = streamattn
    / llama.cpp; None where an engine has no run).
    """
    def key(r):
        return r["model"], r["threads"], r.get("noise", 0)

    rows = []
    for model, threads, duty in dict.fromkeys(key(r) for r in runs):
        row = {"model": model, "threads": threads, "noise": duty}
        for engine in ENGINES:
            mine = [r for r in runs if key(r) == (model, threads, duty) and r["engine"] == engine]
            fields = ("prefill_tok_s", "decode_tok_s", "rss_mb", "prompt_tokens")
            if mine and all("wall_pct" in r for r in mine):
                fields += ("wall_pct",)
            row[engine] = {k: statistics.median(r[k] for r in mine) for k in fields} if mine else None
            row[f"n_{engine}"] = len(mine)
        both = row["streamattn"] and row["llama.cpp"]
        for what in ("decode", "prefill"):
            row[f"{what}_ratio"] = (row["streamattn"][f"{what}_tok_s"] / row["llama.cpp"][f"{what}_tok_s"]
                                    if both else None)
        probed = [r for r in runs if key(r) == (model, threads, duty) and "wall_tok_s" in r]
        if probed:
            row["wall_tok_s"] = statistics.median(r["wall_tok_s"] for r in probed)
            row["ceiling_gbps"] = statistics.median(r["ceiling_gbps"] for r in probed)
        rows.append(row)
    return rows


def markdown(rows: list) -> str:
    """The summary as a markdown table: one row per (model, threads), each noise level's columns side by
    side (medians; ratio = streamattn / llama.cpp; "(n%)": % of the memory wall; "memory wall tok/s": the
    decode tok/s at which a step's bytes would take all the probed read bandwidth)."""
    def f(x, spec=".0f"):
        return "–" if x is None else format(x, spec)

    def decode(e):
        if not e:
            return "–"
        return f(e["decode_tok_s"]) + (f" ({e['wall_pct']:.0f}%)" if "wall_pct" in e else "")

    levels = list(dict.fromkeys(r["noise"] for r in rows))
    walls = any("wall_tok_s" in r for r in rows)
    head, rule = ["model", "threads"], ["---", "---:"]
    for duty in levels:
        head += [f"decode tok/s llama.cpp / streamattn, {noise_label(duty)}", "ratio"]
    for duty in levels:
        head += [f"prefill tok/s llama.cpp / streamattn, {noise_label(duty)}", "ratio"]
    if walls:
        head += ["memory wall tok/s"]
    head += ["peak RSS MB llama.cpp / streamattn"]
    rule += ["---:"] * (len(head) - 2)
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    for model, threads in dict.fromkeys((r["model"], r["threads"]) for r in rows):
        at = {r["noise"]: r for r in rows if (r["model"], r["threads"]) == (model, threads)}
        cells = [model, str(threads)]
        for what in ("decode", "prefill"):
            for duty in levels:
                r = at.get(duty)
                if r is None:
                    cells += ["–", "–"]
                    continue
                p, o = r["llama.cpp"], r["streamattn"]
                pair = (f"{decode(p)} / {decode(o)}" if what == "decode" else
                        f"{f((p or {}).get('prefill_tok_s'))} / {f((o or {}).get('prefill_tok_s'))}")
                cells += [pair, f"{f(r[f'{what}_ratio'], '.2f')}×"]
        if walls:
            probed = [r["wall_tok_s"] for r in at.values() if "wall_tok_s" in r]
            cells.append(f(statistics.median(probed) if probed else None))
        rss = {e: statistics.median(r[e]["rss_mb"] for r in at.values() if r[e]) if any(r[e] for r in at.values())
               else None for e in ENGINES}
        cells.append(f"{f(rss['llama.cpp'])} / {f(rss['streamattn'])}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(rows: list, path: Path) -> bool:
    """Decode and prefill tok/s (with the memory wall's tok/s), % of the wall and peak RSS per model,
    thread count and noise level, both engines side by side. False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    labels = [f"{r['model']}\n{r['threads']} thr" + (f"\n{noise_label(r['noise'])}" if r["noise"] else "")
              for r in rows]
    x = range(len(rows))
    for ax, (key, title) in zip(axes.flat, (("decode_tok_s", "decode tok/s"), ("prefill_tok_s", "prefill tok/s"),
                                            ("wall_pct", "decode, % of the memory wall"),
                                            ("rss_mb", "peak RSS (MB)"))):
        for i, engine in enumerate(ENGINES):
            vals = [(r[engine] or {}).get(key, 0.0) for r in rows]
            ax.bar([j + (i - 0.5) * 0.4 for j in x], vals, 0.4, label=engine)
        if key == "decode_tok_s" and any("wall_tok_s" in r for r in rows):
            ax.plot(list(x), [r.get("wall_tok_s", float("nan")) for r in rows], "k_", markersize=30,
                    label="memory wall")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(title)
    axes[0, 0].legend(fontsize=8, loc="center right")
    fig.suptitle("streamattn vs llama.cpp (node-llama-cpp), same GGUF, same prompt, greedy; medians")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------- running
def resolve_path(name: str) -> Path:
    """``streamattn.gguf.hub.resolve_model(name)``, asked of a child process. This process must not load
    Numba: a page of its LLVM library mapped here too stays resident in our engine's process, whose
    release of those pages (streamattn.runtime.memory.release_compiler_pages) skips shared ones, and its peak
    RSS read 287-289 MB here against 267 MB for the same command run alone (2026-12-01)."""
    code = "import sys; from streamattn.gguf.hub import resolve_model; print(resolve_model(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, name], cwd=ROOT, check=True, capture_output=True, text=True)
    sys.stderr.write(out.stderr)
    return Path(out.stdout.strip())


def model_labels(models: list) -> dict:
    """``--models`` entry -> its label in the results: a short name of :data:`MODELS` as it is, a GGUF file
    by its name without ``.gguf``. ValueError naming an entry that is neither, or two with one label."""
    out = {}
    for m in models:
        if m in MODELS:
            out[m] = m
        elif Path(m).is_file():
            out[m] = Path(m).name.removesuffix(".gguf")
        else:
            raise ValueError(f"--models: {m!r} is neither a short name ({', '.join(MODELS)}) nor a file; give "
                             "a GGUF path, e.g. one written by scripts/make_real_size_gguf.py")
    if len(set(out.values())) < len(out):
        raise ValueError(f"--models: two entries share a label ({', '.join(out.values())}); rename a file")
    return out


def child_json(args: list, env: dict | None = None, timeout: float = 600.0) -> dict:
    """The JSON line ``python -m streamattn.bench.memory_wall ARGS`` prints (a child: Numba stays out)."""
    out = subprocess.run([sys.executable, "-m", "streamattn.bench.memory_wall", *args], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    sys.stderr.write(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def probe_wall(threads: int, mb: int, timeout: float) -> dict:
    """Read bandwidth with at most ``threads`` threads (streamattn.bench.memory_wall.probe), in a child."""
    return child_json(["probe", "--threads", str(threads), "--mb", str(mb)], {"NUMBA_NUM_THREADS": str(threads)},
                      timeout)


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
    ap.add_argument("--models", nargs="+", default=list(MODELS), metavar="NAME|PATH.gguf",
                    help=f"short names ({', '.join(MODELS)}) or GGUF files, e.g. the fixtures of "
                         "scripts/make_real_size_gguf.py (labelled by the file name without .gguf)")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per run (exactly: EOS ignored)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine/model/threads (medians)")
    ap.add_argument("--ours-args", default="--prefill-chunk 256 --cache-dtype float16",
                    help="extra arguments for `streamattn generate` (e.g. \"--prefill-chunk 512 --weights f32\")")
    ap.add_argument("--peer-dir", type=Path, default=_standalone("peer_home").peer_home(ROOT) / "llamacpp",
                    help="where scripts/install_llamacpp_peer.sh put node-llama-cpp (default: this checkout's "
                         ".peer/, or from a git worktree its main checkout's)")
    ap.add_argument("--noise", nargs="*", default=None, metavar="DUTY",
                    help="a neighbour keeping one core busy DUTY%% of the time during every run (bare: 50; "
                         "'both': 0 and 50, quiet and noisy side by side; 0: quiet)")
    ap.add_argument("--noise-period-ms", type=float, default=10.0, help="the neighbour's busy + asleep period")
    ap.add_argument("--ceiling-mb", type=int, default=1024,
                    help="read-bandwidth probe buffer in MiB for the %% of the memory wall (0: no probe)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it is killed")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--tag", default=None, help="file name suffix (default: today's date, UTC)")
    args = ap.parse_args(argv)
    try:
        levels = noise_levels(args.noise)
        noise.Noise(0.5, period_ms=args.noise_period_ms)            # checks the period before any run
    except ValueError as e:
        ap.error(str(e))
    if min(args.threads) < 1:
        ap.error(f"--threads must all be >= 1 (got {args.threads})")
    if args.tokens < 2 or args.repeats < 1:
        ap.error(f"--tokens must be >= 2 (a decode step after the first token) and --repeats >= 1 (got "
                 f"{args.tokens}, {args.repeats})")
    if args.ceiling_mb < 0:
        ap.error(f"--ceiling-mb must be >= 0 (got {args.ceiling_mb}; 0 skips the probe)")
    try:
        labels = model_labels(args.models)
    except ValueError as e:
        ap.error(str(e))

    if not (args.peer_dir / "node_modules" / "node-llama-cpp").is_dir():
        print(f"peer_llamacpp: node-llama-cpp not found under {args.peer_dir}; run "
              f"bash scripts/install_llamacpp_peer.sh first", file=sys.stderr)
        return 2
    shutil.copy(DRIVER, args.peer_dir / DRIVER.name)     # ESM resolves packages from the script's folder
    paths = {m: resolve_path(MODELS[m]) if m in MODELS else Path(m).resolve() for m in args.models}
    paths = {labels[m]: p for m, p in paths.items()}
    profiles = {m: child_json(["profile", str(paths[m])]) for m in paths} if args.ceiling_mb else {}
    ours_args = shlex.split(args.ours_args)
    plan = [(m, t, d, e) for m in paths for t in args.threads for d in levels for e in ENGINES]
    runs, probes, t_start, load_start = [], [], time.time(), os.getloadavg()
    lifetime = args.timeout + 60                         # the neighbour outlives no run by more than this
    for rep in range(args.repeats):
        order = plan if rep % 2 == 0 else plan[::-1]
        ceiling = {}
        for i, (model, threads, duty, engine) in enumerate(order):
            if args.ceiling_mb and (model, threads) not in ceiling:          # right before these runs
                ceiling[model, threads] = probe_wall(threads, args.ceiling_mb, args.timeout)
                probes.append({"repeat": rep, "model": model, **ceiling[model, threads]})
            with noise.Noise(duty / 100, period_ms=args.noise_period_ms, lifetime=lifetime) as nb:
                r = run_one(engine, paths[model], threads, args.tokens, ours_args, args.peer_dir, args.timeout)
            r = {"model": model, "threads": threads, "noise": duty, "engine": engine, "repeat": rep, **r}
            if duty:
                r["noise_duty_achieved"] = nb.cpu_s / max(nb.wall_s, 1e-9)
            if args.ceiling_mb:
                gbps = ceiling[model, threads]["gbps"]
                per_step = wall.decode_bytes(profiles[model], r["prompt_tokens"], r["decode_steps"])
                r.update(ceiling_gbps=gbps, bytes_per_step=per_step, wall_tok_s=gbps * 1e9 / per_step,
                         wall_pct=100 * r["decode_tok_s"] * per_step / (gbps * 1e9))
            runs.append(r)
            print(f"[{rep + 1}/{args.repeats} {i + 1}/{len(order)} {time.time() - t_start:.0f}s] {model} "
                  f"{threads} thr {noise_label(duty):9s} {engine:10s}: prompt {r['prompt_tokens']} tok, prefill "
                  f"{r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.1f} tok/s"
                  + (f" ({r['wall_pct']:.0f}% of {r['ceiling_gbps']:.1f} GB/s)" if "wall_pct" in r else "")
                  + f", peak RSS {r['rss_mb']:.0f} MB", file=sys.stderr)
    rows = summarize(runs)
    table = markdown(rows)
    tag = args.tag or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"peer_llamacpp_{tag}"
    cmdline = "PYTHONPATH=. python benchmarks/peer_llamacpp.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    meta = {"command": cmdline.strip(), "ours_args": args.ours_args, "tokens": args.tokens, "repeats": args.repeats,
            "prompt_file": str(PROMPT.relative_to(ROOT)), "load_avg_start_end": [load_start, os.getloadavg()],
            "noise": {"levels_pct": levels, "period_ms": args.noise_period_ms},
            "memory_wall": {"ceiling_mb": args.ceiling_mb, "kv_bytes": wall.KV_BYTES, "profiles": profiles},
            "llama_cpp": next((r.get("llama_cpp") for r in runs if r.get("llama_cpp")), None),
            "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    doc = {"meta": meta, "summary": rows, "runs": runs, "probes": probes}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    note = ""
    if profiles:
        weights = "; ".join(f"{m} {p['weights'] / 1e6:.1f} MB of weights" for m, p in profiles.items())
        note = (f"\n(n%): share of the memory wall: bytes a decode step must read ({weights}, + float16 K/V "
                "of the visible keys) × tok/s over the read bandwidth probed (quiet) right before each model's runs "
                "at that thread count; memory wall tok/s = that bandwidth / those bytes.\n")
    stem.with_suffix(".md").write_text(f"`{meta['command']}` ({meta['utc']}, load average at the end "
                                       f"{os.getloadavg()[0]:.1f})\n\n{table}{note}")
    plot(rows, stem.with_suffix(".png"))
    print(table)
    print(f"wrote {stem}.json/.md/.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
