"""How long a warm ``streamattn generate -n 1`` takes to its first token, and to its exit, for one or more
source trees run alternately on the same model (before/after a change, on the same host and load).

    PYTHONPATH=. python benchmarks/first_token.py --model /work/fixtures/llama-3.2-1b-q4_k_m.gguf \\
        --tree before=/path/to/old/checkout:~/.cache/streamattn/packed --tree after=.:/tmp/packed --rounds 3

Each ``--tree NAME=ROOT[:PACKED_FOLDER]`` runs ``python -m streamattn.cli generate`` with ``PYTHONPATH=ROOT``
(and ``STREAMATTN_PACKED_CACHE=PACKED_FOLDER`` when given: trees whose packed layout sources differ need a
folder each, or they rebuild each other's file). First one untimed run per tree (warm: Numba's kernels,
the packed file, Python's bytecode), then ``--rounds`` rounds, the trees in turn in each. The first token
is the moment the pipe shows more bytes than the prompt: ``generate`` writes the prompt and the token and
flushes once, after the token. ``PYTHONDONTWRITEBYTECODE`` is removed from the children's environment
(a user's install has its bytecode written; without it every start compiles the package's sources). The
host's load average is recorded beside each run. Correctness: every run's output (greedy) must be the
same text, across runs and trees, or the script stops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "Hello there"


def _load_avg() -> float:
    return float(open("/proc/loadavg").read().split()[0])


def run(root: str, packed: str | None, model: str, threads: int | None) -> dict:
    """One ``generate -n 1`` from ``root``: seconds to the first token and to the exit, and the load."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.path.abspath(root)
    if packed is not None:
        env["STREAMATTN_PACKED_CACHE"] = packed
    cmd = [sys.executable, "-m", "streamattn.cli", "generate", "--model", model, "-n", "1", "-q", PROMPT]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    before = _load_avg()
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as errf:         # (a pipe could fill and stall the child)
        p = subprocess.Popen(cmd, env=env, cwd=os.path.abspath(root), stdout=subprocess.PIPE, stderr=errf)
        got, first = b"", None
        while True:
            chunk = os.read(p.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            got += chunk
            if first is None and len(got) > len(PROMPT.encode()):
                first = time.perf_counter() - t0
        code = p.wait()
        errf.seek(0)
        err = errf.read()
    wall = time.perf_counter() - t0
    if code != 0 or first is None:
        raise RuntimeError(f"generate from {root} failed (exit {code}): {err.decode(errors='replace')[-2000:]}")
    return {"first_token_s": round(first, 3), "wall_s": round(wall, 3), "load_avg": [before, _load_avg()],
            "text": got.decode(errors="replace")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=ROOT[:PACKED_FOLDER]",
                    help="a source tree to run (repeat: run alternately)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="generate's --threads (default: its own)")
    ap.add_argument("--out", default=None, help="write the runs and medians as JSON here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1 (got {args.rounds})")
    trees = {}
    for spec in args.tree:
        name, sep, rest = spec.partition("=")
        if not sep or not name or not rest:
            ap.error(f"--tree must be NAME=ROOT[:PACKED_FOLDER] (got {spec!r})")
        root, _, packed = rest.partition(":")
        if not os.path.isdir(os.path.join(root, "streamattn")):
            ap.error(f"--tree {spec!r}: {root} holds no streamattn package")
        trees[name] = (root, os.path.expanduser(packed) if packed else None)
    texts = set()
    for name, (root, packed) in trees.items():          # untimed: whatever is not warm yet is built here
        r = run(root, packed, args.model, args.threads)
        texts.add(r["text"])
        print(f"warm-up {name}: {json.dumps(r)}", flush=True)
    runs = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, (root, packed) in trees.items():
            runs[name].append(run(root, packed, args.model, args.threads))
            texts.add(runs[name][-1]["text"])
            print(f"{name}: {json.dumps(runs[name][-1])}", flush=True)
    if len(texts) != 1:
        raise SystemExit(f"the runs wrote different texts: {sorted(texts)}")
    medians = {name: {"first_token_s": statistics.median(r["first_token_s"] for r in rs),
                      "wall_s": statistics.median(r["wall_s"] for r in rs)} for name, rs in runs.items()}
    print(json.dumps(medians))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "prompt": PROMPT, "threads": args.threads,
                       "trees": {n: {"root": r, "packed": p} for n, (r, p) in trees.items()},
                       "runs": runs, "medians": medians}, f, indent=1)


if __name__ == "__main__":
    main()
