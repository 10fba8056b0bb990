"""Same-run peer benchmark: streamattn vs llama.cpp (npm node-llama-cpp, prebuilt) and ik_llama.cpp, end to end.

    bash scripts/install_llamacpp_peer.sh                  # once: llama.cpp into ./.peer/llamacpp
    bash scripts/install_ik_llamacpp.sh [SRC]              # once, for --peers ik_llama.cpp: its llama-bench
    PYTHONPATH=. python benchmarks/peer_llamacpp.py        # defaults: both models, 1 and 2 threads, 3 repeats
    PYTHONPATH=. python benchmarks/peer_llamacpp.py --ours-args "--prefill-chunk 512 --weights f32"   # the f32 path
    PYTHONPATH=. python benchmarks/peer_llamacpp.py --noise both   # quiet and beside a 50% busy neighbour
    PYTHONPATH=. python benchmarks/peer_llamacpp.py --models /work/fixtures/llama-3.2-1b-q4_k_m.gguf  # any GGUF
    PYTHONPATH=. python benchmarks/peer_llamacpp.py --models llama-3.2-1b-q4_k_m --fixtures /work/fixtures
    PYTHONPATH=. python benchmarks/peer_llamacpp.py --peers llama.cpp ik_llama.cpp --models F.gguf   # both peers

streamattn and llama.cpp get the same GGUF file, the same prompt text (benchmarks/data/prompt_rome.txt, ~700 tokens),
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

``--peers`` picks the engines timed beside ours: ``llama.cpp`` (the default: the node driver above) and/or
``ik_llama.cpp``, whose ``llama-bench -m FILE -rtr 1 -p P -n N -t T -r 1 -o json`` runs (the binary that
scripts/install_ik_llamacpp.sh builds; ``-rtr 1``: weights repacked for its kernels when loaded):
prefill tok/s = its ``pp<P>`` avg_ts, decode tok/s = its ``tg<N>`` avg_ts, peak RSS from ``os.wait4`` as for
the others. llama-bench times a count of tokens, not a text: with it among the peers, every engine's
prompt is cut to ``--prompt-tokens`` (default 512; streamattn/bench/prompt_tokens.py: the longest
whitespace-bounded prefix of the prompt file that the model's tokenizer makes into at most that many
tokens, BOS included), P is that count and N = ``--tokens`` - 1 (default ``--tokens`` 65), so every
engine times a prefill of ~P tokens and N decode steps. One difference stays: llama-bench's ``tg`` test
decodes from an empty cache, ours and node-llama-cpp's after the prompt; the % of the memory wall counts
the K/V each one actually read (positions 0..N-1 against P..P+N-1).

``--noise [DUTY ...]`` runs every engine run beside a noisy neighbour (streamattn/bench/noise.py: one
process keeping one core busy DUTY% of every ``--noise-period-ms``, default 50% of 10 ms; killed after
each run, and on every error); ``--noise both`` = ``--noise 0 50``: quiet and noisy runs alternated in
the same repeats, their columns side by side. ``0`` is quiet (no process).

Beside each decode figure, the % of the memory wall (streamattn/bench/memory_wall.py): the bytes a step
must read (the file's packed weights, float16 K/V of the visible keys; the same for every engine) × tok/s
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
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "streamattn" / "bench"
DRIVER = Path(__file__).resolve().parent / "peer_llamacpp.mjs"
PROMPT = Path(__file__).resolve().parent / "data" / "prompt_rome.txt"
MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}     # our names -> streamattn.gguf.hub names
OURS = "streamattn"
PEERS = ("llama.cpp", "ik_llama.cpp")      # node-llama-cpp's prebuilt llama.cpp; ik_llama.cpp's llama-bench
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


def ik_command(binary: Path, model: Path, *, threads: int, prompt_tokens: int, decode_steps: int) -> list:
    """ik_llama.cpp's llama-bench command line for one run: weights repacked at load (``-rtr 1``), a
    prefill test of ``prompt_tokens`` and a decode test of ``decode_steps``, one repetition (the benchmark
    repeats whole runs), JSON on stdout. ValueError for a count below 1."""
    if min(threads, prompt_tokens, decode_steps) < 1:
        raise ValueError(f"threads, prompt_tokens and decode_steps must be >= 1 (got {threads}, {prompt_tokens}, "
                         f"{decode_steps})")
    return [str(binary), "-m", str(model), "-rtr", "1", "-p", str(prompt_tokens), "-n", str(decode_steps),
            "-t", str(threads), "-r", "1", "-o", "json"]


def parse_llama_bench(stdout: str) -> dict:
    """Timings from llama-bench's ``-o json`` stdout: a JSON array of tests, one prefill test (``n_prompt``
    > 0, ``n_gen`` 0) and one decode test (``n_prompt`` 0, ``n_gen`` > 0), each with ``avg_ts`` (tokens
    per second, averaged over its repetitions).

    Returns the same keys as :func:`parse_ours` (``prompt_tokens``, ``prefill_s``, ``decode_steps``,
    ``decode_s``; the seconds are counts over avg_ts), ``decode_start`` 0 (the decode test starts from an
    empty cache) and ``ik_llama_cpp``: the build commit, CPU and repack flag it reported. ValueError naming
    what is missing.
    """
    start, end = stdout.find("["), stdout.rfind("]")
    try:
        tests = json.loads(stdout[start:end + 1]) if 0 <= start < end else None
    except json.JSONDecodeError:
        tests = None
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise ValueError(f"no JSON array of tests in llama-bench's stdout (last 500 chars: {stdout[-500:]!r})")
    pp = [t for t in tests if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0]
    tg = [t for t in tests if t.get("n_prompt", 0) == 0 and t.get("n_gen", 0) > 0]
    if len(pp) != 1 or len(tg) != 1 or not all(t.get("avg_ts", 0) > 0 for t in pp + tg):
        raise ValueError(f"llama-bench's JSON should hold one prefill (pp) and one decode (tg) test with avg_ts > 0 "
                         f"(got {[(t.get('n_prompt'), t.get('n_gen'), t.get('avg_ts')) for t in tests]}); "
                         "run it with -p P -n N and no -pg/-gp")
    pp, tg = pp[0], tg[0]
    return {"prompt_tokens": pp["n_prompt"], "prefill_s": pp["n_prompt"] / pp["avg_ts"],
            "decode_steps": tg["n_gen"], "decode_s": tg["n_gen"] / tg["avg_ts"], "decode_start": 0,
            "ik_llama_cpp": {k: pp.get(k) for k in ("build_commit", "build_number", "cpu_info", "repack", "type_k",
                                                     "flash_attn")}}


def rates(run: dict) -> dict:
    """Add prefill and decode tok/s to one parsed run."""
    return {**run, "prefill_tok_s": run["prompt_tokens"] / run["prefill_s"],
            "decode_tok_s": run["decode_steps"] / run["decode_s"]}


def peers_of(runs: list) -> list:
    """The peers among the runs' engines, in :data:`PEERS` order; ``["llama.cpp"]`` when there is none."""
    seen = {r["engine"] for r in runs}
    return [p for p in PEERS if p in seen] or ["llama.cpp"]


def summarize(runs: list) -> list:
    """Medians per (model, threads, noise, engine) over repeats, plus ours/peer ratios.

    Parameters
    ----------
    runs : list of dict
        Each with model, threads, engine (``streamattn`` or one of :data:`PEERS`), prefill_tok_s,
        decode_tok_s, rss_mb, prompt_tokens; optionally ``noise`` (duty %, 0 when absent) and, where the
        memory wall was probed, ``wall_pct`` (% of the wall the decode reached), ``wall_tok_s`` (the decode
        tok/s at the wall) and ``ceiling_gbps``.

    Returns
    -------
    list of dict, one per (model, threads, noise) in first-seen order: ``{"model", "threads", "noise",
    "peers", "<engine>": {"prefill_tok_s", "decode_tok_s", "rss_mb", "prompt_tokens"[, "wall_pct"]},
    "n_<engine>", "ratios": {peer: {"decode", "prefill"}}, "decode_ratio", "prefill_ratio"[, "wall_tok_s",
    "ceiling_gbps"]}``: ``peers`` as :func:`peers_of` (every row the same); a ratio is streamattn / that
    peer, ``decode_ratio`` and ``prefill_ratio`` those against the first peer; None where an engine has no run.
    ``wall_tok_s`` is the median over the runs that decode after the prompt (ours, node-llama-cpp).
    """
    def key(r):
        return r["model"], r["threads"], r.get("noise", 0)

    peers = peers_of(runs)
    rows = []
    for model, threads, duty in dict.fromkeys(key(r) for r in runs):
        row = {"model": model, "threads": threads, "noise": duty, "peers": peers}
        for engine in (OURS, *peers):
            mine = [r for r in runs if key(r) == (model, threads, duty) and r["engine"] == engine]
            fields = ("prefill_tok_s", "decode_tok_s", "rss_mb", "prompt_tokens")
            if mine and all("wall_pct" in r for r in mine):
                fields += ("wall_pct",)
            row[engine] = {k: statistics.median(r[k] for r in mine) for k in fields} if mine else None
            row[f"n_{engine}"] = len(mine)
        row["ratios"] = {p: {what: (row[OURS][f"{what}_tok_s"] / row[p][f"{what}_tok_s"]
                                    if row[OURS] and row[p] else None) for what in ("decode", "prefill")}
                         for p in peers}
        for what in ("decode", "prefill"):
            row[f"{what}_ratio"] = row["ratios"][peers[0]][what]
        probed = [r for r in runs if key(r) == (model, threads, duty) and "wall_tok_s" in r]
        probed = [r for r in probed if r.get("decode_start", r["prompt_tokens"]) > 0] or probed
        if probed:
            row["wall_tok_s"] = statistics.median(r["wall_tok_s"] for r in probed)
            row["ceiling_gbps"] = statistics.median(r["ceiling_gbps"] for r in probed)
        rows.append(row)
    return rows


def markdown(rows: list) -> str:
    """The summary as a markdown table: one row per (model, threads), each noise level's columns side by
    side (medians; the peers' figures first, then streamattn's; a ratio = streamattn / that peer; "(n%)":
    % of the memory wall; "memory wall tok/s": the decode tok/s at which a step's bytes would take all the
    probed read bandwidth)."""
    def f(x, spec=".0f"):
        return "–" if x is None else format(x, spec)

    def decode(e):
        if not e:
            return "–"
        rate = f(e["decode_tok_s"], ".1f" if e["decode_tok_s"] < 10 else ".0f")     # 1B-8B models: a few tok/s
        return rate + (f" ({e['wall_pct']:.0f}%)" if "wall_pct" in e else "")

    peers = rows[0]["peers"] if rows else ["llama.cpp"]
    engines = [*peers, OURS]
    names = " / ".join(engines)
    ratio_heads = ["ratio"] if len(peers) == 1 else [f"ratio vs {p}" for p in peers]
    levels = list(dict.fromkeys(r["noise"] for r in rows))
    walls = any("wall_tok_s" in r for r in rows)
    head, rule = ["model", "threads"], ["---", "---:"]
    for what in ("decode", "prefill"):
        for duty in levels:
            head += [f"{what} tok/s {names}, {noise_label(duty)}", *ratio_heads]
    if walls:
        head += ["memory wall tok/s"]
    head += [f"peak RSS MB {names}"]
    rule += ["---:"] * (len(head) - 2)
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(rule) + "|"]
    for model, threads in dict.fromkeys((r["model"], r["threads"]) for r in rows):
        at = {r["noise"]: r for r in rows if (r["model"], r["threads"]) == (model, threads)}
        cells = [model, str(threads)]
        for what in ("decode", "prefill"):
            for duty in levels:
                r = at.get(duty)
                if r is None:
                    cells += ["–"] * (1 + len(peers))
                    continue
                cells.append(" / ".join(decode(r[e]) if what == "decode" else f((r[e] or {}).get("prefill_tok_s"))
                                        for e in engines))
                cells += [f"{f(r['ratios'][p][what], '.2f')}×" for p in peers]
        if walls:
            probed = [r["wall_tok_s"] for r in at.values() if "wall_tok_s" in r]
            cells.append(f(statistics.median(probed) if probed else None))
        rss = {e: statistics.median(r[e]["rss_mb"] for r in at.values() if r[e]) if any(r[e] for r in at.values())
               else None for e in engines}
        cells.append(" / ".join(f(rss[e]) for e in engines))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(rows: list, path: Path) -> bool:
    """Decode and prefill tok/s (with the memory wall's tok/s), % of the wall and peak RSS per model,
    thread count and noise level, the engines side by side. False without matplotlib."""
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
    engines = [*(rows[0]["peers"] if rows else ["llama.cpp"]), OURS]
    width = 0.8 / len(engines)
    for ax, (key, title) in zip(axes.flat, (("decode_tok_s", "decode tok/s"), ("prefill_tok_s", "prefill tok/s"),
                                            ("wall_pct", "decode, % of the memory wall"),
                                            ("rss_mb", "peak RSS (MB)"))):
        for i, engine in enumerate(engines):
            vals = [(r[engine] or {}).get(key, 0.0) for r in rows]
            ax.bar([j + (i - (len(engines) - 1) / 2) * width for j in x], vals, width, label=engine)
        if key == "decode_tok_s" and any("wall_tok_s" in r for r in rows):
            ax.plot(list(x), [r.get("wall_tok_s", float("nan")) for r in rows], "k_", markersize=30,
                    label="memory wall")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(title)
    axes[0, 0].legend(fontsize=8, loc="center right")
    fig.suptitle(f"streamattn vs {', '.join(engines[:-1])}, same GGUF, same prompt, greedy; medians")
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


def fixture_names() -> list:
    """``<model>-<type>`` for every model and file type scripts/make_real_size_gguf.py writes (its MODELS
    and FILE_TYPES; the file it writes is ``<name>.gguf``)."""
    import importlib.util
    name = "_peer_bench_make_real_size_gguf"
    if name not in sys.modules:               # its dataclasses look their module up in sys.modules
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "make_real_size_gguf.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    mod = sys.modules[name]
    return [f"{m}-{t}" for m in mod.MODELS for t in mod.FILE_TYPES]


def fixture_paths(models: list, folder: Path) -> list:
    """``--models`` with each fixture name (:func:`fixture_names`) replaced by ``folder/<name>.gguf``.
    ValueError for a fixture not written yet, with the command that writes it."""
    names = set(fixture_names())
    out = []
    for m in models:
        if m not in names:
            out.append(m)
            continue
        path = Path(folder) / f"{m}.gguf"
        if not path.is_file():
            model, kind = m.rsplit("-", 1)
            raise ValueError(f"--models {m}: no {path}; write it with PYTHONPATH=. python scripts/make_real_size_gguf.py "
                             f"--models {model} --types {kind} --out {folder} (or give --fixtures the folder "
                             "that holds it)")
        out.append(str(path))
    return out


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


def cut_prompt(model: Path, n_tokens: int, folder: Path, timeout: float) -> tuple:
    """The prompt file cut to at most ``n_tokens`` of ``model``'s tokenizer (streamattn/bench/
    prompt_tokens.py, in a child), written to ``folder``: ``(path, tokens)``."""
    out = subprocess.run([sys.executable, "-m", "streamattn.bench.prompt_tokens", str(model), str(PROMPT),
                          str(n_tokens)], cwd=ROOT, check=True, capture_output=True, text=True, timeout=timeout)
    sys.stderr.write(out.stderr)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    path = folder / f"prompt_{model.name}_{n_tokens}.txt"
    path.write_text(d["text"], encoding="utf-8")
    return path, d["tokens"]


def run_one(engine: str, model_path: Path, threads: int, tokens: int, ours_args: list, peer_dir: Path,
            timeout: float, *, prompt: Path = PROMPT, ik_bin: Path | None = None,
            prompt_tokens: int | None = None) -> dict:
    """One fresh-process run of one engine; parsed timings plus ``rss_mb`` (peak resident set) and
    ``decode_start``, the position of the first timed decode step.

    streamattn and llama.cpp (node) read the text in ``prompt`` and make ``tokens`` new tokens;
    ik_llama.cpp runs ``ik_bin`` (its llama-bench) on ``prompt_tokens`` tokens and ``tokens`` - 1
    decode steps (:func:`ik_command`).
    """
    if engine == OURS:
        cmd = [sys.executable, "-m", "streamattn.cli", "generate", "-", "--model", str(model_path),
               "--threads", str(threads), "--ignore-eos", "--stats", "-q", "-n", str(tokens), *ours_args]
        cwd, feed = ROOT, prompt
    elif engine == "llama.cpp":
        cmd = ["node", str(peer_dir / DRIVER.name), json.dumps({"model": str(model_path), "prompt_file": str(prompt),
                                                               "tokens": tokens, "threads": threads})]
        cwd, feed = peer_dir, os.devnull
    elif engine == "ik_llama.cpp":
        if ik_bin is None or prompt_tokens is None:
            raise ValueError("an ik_llama.cpp run needs ik_bin and prompt_tokens")
        cmd = ik_command(ik_bin, model_path, threads=threads, prompt_tokens=prompt_tokens, decode_steps=tokens - 1)
        cwd, feed = ROOT, os.devnull
    else:
        raise ValueError(f"unknown engine {engine!r}; expected {OURS} or one of {', '.join(PEERS)}")
    t = time.perf_counter()
    with open(feed) as fin:
        proc = subprocess.Popen(cmd, cwd=cwd, stdin=fin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = _communicate_wait4(proc, timeout)
    wall = time.perf_counter() - t
    out, err = out.decode(errors="replace"), err.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} exited {proc.returncode}: {shlex.join(cmd)}\n{err[-2000:]}")
    parsed = (parse_ours(err) if engine == OURS else parse_peer(out) if engine == "llama.cpp"
              else parse_llama_bench(out))
    parsed.setdefault("decode_start", parsed["prompt_tokens"])
    return {**rates(parsed), "rss_mb": proc.rss_mb, "wall_s": wall}


def step_bytes_mean(prof: dict, start: int, steps: int) -> float:
    """Mean bytes a decode step reads over ``steps`` steps at positions ``start`` .. ``start + steps - 1``
    (streamattn.bench.memory_wall.step_bytes)."""
    return sum(wall.step_bytes(prof, p) for p in range(start, start + steps)) / steps


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


def _json_or_none(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def host() -> str:
    """The CPU's model name and its AVX2 / AVX-512 / AMX flags, from /proc/cpuinfo ("unknown" elsewhere)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown host"
    name = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = sorted(set(re.findall(r"\b(avx2|avx512[a-z_0-9]*|amx[a-z_0-9]*)\b", info)))
    return f"{name.group(1).strip() if name else 'unknown CPU'}, {os.cpu_count()} CPUs, {' '.join(flags) or 'no AVX2'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), metavar="NAME|PATH.gguf",
                    help=f"short names ({', '.join(MODELS)}), fixture names of scripts/make_real_size_gguf.py "
                         "(<model>-<type>, e.g. llama-3.2-1b-q4_k_m, found in --fixtures) or GGUF files "
                         "(labelled by the file name without .gguf)")
    ap.add_argument("--fixtures", type=Path, default=_standalone("peer_home").peer_home(ROOT) / "fixtures",
                    help="where --models looks for fixture names such as llama-3.2-1b-q4_k_m (the --out of "
                         "scripts/make_real_size_gguf.py; default: fixtures/ in the peer home, .peer/)")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--peers", nargs="+", default=["llama.cpp"], choices=PEERS,
                    help="engines to time beside ours: llama.cpp (node-llama-cpp's prebuilt binaries) and/or "
                         "ik_llama.cpp (the llama-bench of scripts/install_ik_llamacpp.sh)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="new tokens per run (exactly: EOS ignored; default 128, or 65 with ik_llama.cpp: its "
                         "llama-bench -n is this - 1, the decode steps every engine times)")
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="cut the prompt to at most this many tokens of each model's tokenizer (default: the "
                         "whole file, ~700 tokens; 512 with ik_llama.cpp, its llama-bench -p)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine/model/threads (medians)")
    ap.add_argument("--ours-args", default="--prefill-chunk 256 --cache-dtype float16",
                    help="extra arguments for `streamattn generate` (e.g. \"--prefill-chunk 512 --weights f32\")")
    ap.add_argument("--peer-dir", type=Path, default=_standalone("peer_home").peer_home(ROOT) / "llamacpp",
                    help="where scripts/install_llamacpp_peer.sh put node-llama-cpp (default: this checkout's "
                         ".peer/, or from a git worktree its main checkout's)")
    ap.add_argument("--ik-bin", type=Path,
                    default=_standalone("peer_home").peer_home(ROOT) / "ik_llamacpp" / "build" / "bin" / "llama-bench",
                    help="ik_llama.cpp's llama-bench (default: where scripts/install_ik_llamacpp.sh builds it)")
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
    peers = [p for p in PEERS if p in args.peers]
    ik = "ik_llama.cpp" in peers
    if args.tokens is None:
        args.tokens = 65 if ik else 128
    if args.prompt_tokens is None and ik:
        args.prompt_tokens = 512
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
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        ap.error(f"--prompt-tokens must be >= 1 (got {args.prompt_tokens})")
    if args.ceiling_mb < 0:
        ap.error(f"--ceiling-mb must be >= 0 (got {args.ceiling_mb}; 0 skips the probe)")
    try:
        args.models = fixture_paths(args.models, args.fixtures)
        labels = model_labels(args.models)
    except ValueError as e:
        ap.error(str(e))

    if "llama.cpp" in peers and not (args.peer_dir / "node_modules" / "node-llama-cpp").is_dir():
        print(f"peer_llamacpp: node-llama-cpp not found under {args.peer_dir}; run "
              f"bash scripts/install_llamacpp_peer.sh first", file=sys.stderr)
        return 2
    if ik and not os.access(args.ik_bin, os.X_OK):
        print(f"peer_llamacpp: ik_llama.cpp's llama-bench not found at {args.ik_bin}; run bash "
              f"scripts/install_ik_llamacpp.sh first (its header says where the sources come from), or give "
              f"--ik-bin", file=sys.stderr)
        return 2
    if "llama.cpp" in peers:
        shutil.copy(DRIVER, args.peer_dir / DRIVER.name)     # ESM resolves packages from the script's folder
    paths = {m: resolve_path(MODELS[m]) if m in MODELS else Path(m).resolve() for m in args.models}
    paths = {labels[m]: p for m, p in paths.items()}
    scratch = Path(tempfile.mkdtemp(prefix="peer_llamacpp_"))
    prompts = ({m: cut_prompt(p, args.prompt_tokens, scratch, args.timeout)[0] for m, p in paths.items()}
               if args.prompt_tokens else dict.fromkeys(paths, PROMPT))
    profiles = {m: child_json(["profile", str(paths[m])]) for m in paths} if args.ceiling_mb else {}
    ours_args = shlex.split(args.ours_args)
    plan = [(m, t, d, e) for m in paths for t in args.threads for d in levels for e in (OURS, *peers)]
    try:
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
                    r = run_one(engine, paths[model], threads, args.tokens, ours_args, args.peer_dir, args.timeout,
                                prompt=prompts[model], ik_bin=args.ik_bin, prompt_tokens=args.prompt_tokens)
                r = {"model": model, "threads": threads, "noise": duty, "engine": engine, "repeat": rep, **r}
                if duty:
                    r["noise_duty_achieved"] = nb.cpu_s / max(nb.wall_s, 1e-9)
                if args.ceiling_mb:
                    gbps = ceiling[model, threads]["gbps"]
                    per_step = step_bytes_mean(profiles[model], r.get("decode_start", r["prompt_tokens"]),
                                                   r["decode_steps"])
                    r.update(ceiling_gbps=gbps, bytes_per_step=per_step, wall_tok_s=gbps * 1e9 / per_step,
                             wall_pct=100 * r["decode_tok_s"] * per_step / (gbps * 1e9))
                runs.append(r)
                print(f"[{rep + 1}/{args.repeats} {i + 1}/{len(order)} {time.time() - t_start:.0f}s] {model} "
                      f"{threads} thr {noise_label(duty):9s} {engine:12s}: prompt {r['prompt_tokens']} tok, prefill "
                      f"{r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.1f} tok/s"
                      + (f" ({r['wall_pct']:.0f}% of {r['ceiling_gbps']:.1f} GB/s)" if "wall_pct" in r else "")
                      + f", peak RSS {r['rss_mb']:.0f} MB", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = summarize(runs)
    table = markdown(rows)
    tag = args.tag or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"peer_llamacpp_{tag}"

    def named(ext):                   # not with_suffix: a tag such as llama-3.2-1b holds a dot
        return stem.parent / f"{stem.name}{ext}"
    cmdline = "PYTHONPATH=. python benchmarks/peer_llamacpp.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    meta = {"command": cmdline.strip(), "ours_args": args.ours_args, "tokens": args.tokens, "repeats": args.repeats,
            "peers": peers, "prompt_file": str(PROMPT.relative_to(ROOT)), "prompt_tokens_cut": args.prompt_tokens,
            "host": host(), "load_avg_start_end": [load_start, os.getloadavg()],
            "noise": {"levels_pct": levels, "period_ms": args.noise_period_ms},
            "memory_wall": {"ceiling_mb": args.ceiling_mb, "kv_bytes": wall.KV_BYTES, "profiles": profiles},
            "llama_cpp": next((r.get("llama_cpp") for r in runs if r.get("llama_cpp")), None),
            "ik_llama_cpp": next((r.get("ik_llama_cpp") for r in runs if r.get("ik_llama_cpp")), None),
            "ik_llama_cpp_build": _json_or_none(args.ik_bin.parents[2] / "status.json") if ik else None,
            "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    doc = {"meta": meta, "summary": rows, "runs": runs, "probes": probes}
    named(".json").write_text(json.dumps(doc, indent=1))
    note = ""
    if profiles:
        weights = "; ".join(f"{m} {p['weights'] / 1e6:.1f} MB of weights" for m, p in profiles.items())
        note = (f"\n(n%): share of the memory wall: bytes a decode step must read ({weights}, + float16 K/V "
                "of the visible keys) × tok/s over the read bandwidth probed (quiet) right before each model's runs "
                "at that thread count; memory wall tok/s = that bandwidth / those bytes"
                + (" (after the prompt; ik_llama.cpp's % counts the K/V of its decode test from an empty cache)"
                   if ik else "") + ".\n")
    named(".md").write_text(f"`{meta['command']}` ({meta['utc']}, {meta['host']}, load average at "
                                       f"the start {load_start[0]:.1f}, at the end {os.getloadavg()[0]:.1f})"
                                       f"\n\n{table}{note}")
    plot(rows, named(".png"))
    print(table)
    print(f"wrote {stem}.json/.md/.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
