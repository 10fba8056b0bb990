"""How does offline batch generation scale past one process? One process vs Ray Data with 1 and 2 actors.

    PYTHONPATH=. python benchmarks/batch_scaling_ray.py [--prompts 64] [--tokens 16] [--batch-size 8] [--repeats 1]

The same 64 greedy requests (SmolLM2-135M, --tokens new tokens each, batches of --batch-size) run through
``run_local`` in this process and through ``run_ray`` on a local Ray (num_cpus=2, 127.0.0.1) with 1 and 2
actors of 1 CPU and 1 thread. Variants alternate within each repeat. Checked before anything is reported:
every variant wrote all ids once, with the same texts as the one-process run. Per variant: prompts/s and
generated tok/s over the whole run (model loading and actor start included) and from the first record
to the last (steady state: decoding only, the first batch excluded), the ratio to one process, and the
steady tokens per CPU-second of the decoding processes (this one, or the actors): on a shared host the
wall-clock figures measure the host's load, the CPU-time one what a dedicated core gives.
Writes benchmarks/results/batch_scaling_ray_<date>.{json,txt}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from streamattn.engine.sampling import SamplingParams
from streamattn.scale.batch import ModelOptions, run_local
from streamattn.scale.jobs import OutputFile, parse_line

SUBJECTS = ["The capital of France is", "My favourite fruit is", "1, 2, 3,", "Once upon a time",
            "The best way to learn to code is", "Water boils at", "In 1492,", "Dear diary, today"]


def requests(n: int, tokens: int):
    return [parse_line(json.dumps({"id": i, "prompt": f"{SUBJECTS[i % len(SUBJECTS)]} (case {i})"}), i + 1,
                       max_tokens=tokens, sampling=SamplingParams(), stop=()) for i in range(n)]


def worker_cpu_s(variant: str) -> float:
    """CPU seconds (user + system) used so far by the processes that decode: this one for "local", the
    Ray Data actors (processes below this one titled ray::MapWorker) otherwise."""
    import psutil
    me = psutil.Process()
    if variant == "local":
        return sum(me.cpu_times()[:2])
    total = 0.0
    for p in me.children(recursive=True):
        try:
            if "MapWorker" in " ".join(p.cmdline()):
                total += sum(p.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def one_run(variant: str, reqs, opts, batch_size: int) -> dict:
    """Run one variant into a fresh output file; wall time and the workers' CPU time of every record."""
    stamps, cpu = [], []

    def on_result(_):
        stamps.append(time.perf_counter())
        cpu.append(worker_cpu_s(variant))

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "out.jsonl"
        t0 = time.perf_counter()
        with OutputFile(path) as out:
            kw = dict(batch_size=batch_size, on_result=on_result)
            if variant == "local":
                errors = run_local(reqs, out, opts, **kw)
            else:
                from streamattn.scale.ray_batch import run_ray
                errors = run_ray(reqs, out, opts, actors=int(variant.split("-")[1]), cpus_per_actor=1, **kw)
        wall = time.perf_counter() - t0
        recs = [json.loads(s) for s in path.read_text().splitlines()]
    assert not errors, errors
    assert cpu[-1] > cpu[0], f"{variant}: no CPU time found for the decoding processes"
    return dict(wall=wall, first=stamps[0] - t0, last=stamps[-1] - t0, cpu_s=cpu[-1] - cpu[0], records=recs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    from streamattn.scale.ray_batch import init_ray
    ray = init_ray(num_cpus=2)
    reqs, opts = requests(a.prompts, a.tokens), ModelOptions(model=a.model, threads=1)
    variants = ["local", "ray-1", "ray-2"]
    runs = {v: [] for v in variants}
    try:
        for rep in range(a.repeats):
            for v in variants:
                r = one_run(v, reqs, opts, a.batch_size)
                runs[v].append(r)
                print(f"repeat {rep} {v}: wall {r['wall']:.1f}s, first record {r['first']:.1f}s", file=sys.stderr)
    finally:
        ray.shutdown()
    ref = {r["id"]: r["text"] for r in runs["local"][0]["records"]}
    for v in variants:                                            # correctness before any figure
        for r in runs[v]:
            assert len(r["records"]) == a.prompts and {x["id"]: x["text"] for x in r["records"]} == ref, v
    rows = []
    for v in variants:
        toks = [sum(x["completion_tokens"] for x in r["records"]) for r in runs[v]]
        first_batch = a.batch_size                                 # records of the first batch arrive together
        rows.append(dict(
            variant=v,
            wall_s=float(np.median([r["wall"] for r in runs[v]])),
            prompts_s=float(np.median([a.prompts / r["wall"] for r in runs[v]])),
            tok_s=float(np.median([t / r["wall"] for t, r in zip(toks, runs[v])])),
            steady_prompts_s=float(np.median([(a.prompts - first_batch) / max(r["last"] - r["first"], 1e-9)
                                              for r in runs[v]])),
            steady_tok_s=float(np.median([t * (a.prompts - first_batch) / a.prompts
                                          / max(r["last"] - r["first"], 1e-9) for t, r in zip(toks, runs[v])])),
            tok_per_cpu_s=float(np.median([t * (a.prompts - first_batch) / a.prompts / max(r["cpu_s"], 1e-9)
                                           for t, r in zip(toks, runs[v])]))))
    base = rows[0]
    lines = [f"batch_scaling_ray: {a.prompts} prompts x {a.tokens} tokens (greedy, {a.model}), batch {a.batch_size}, "
             f"1 thread per worker, {a.repeats} repeat(s), {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC",
             f"{'variant':8s} {'wall s':>7s} {'prompts/s':>9s} {'tok/s':>7s} {'x local':>7s}   "
             f"{'steady p/s':>10s} {'steady tok/s':>12s} {'x local':>7s} {'tok/CPU-s':>9s}"]
    for r in rows:
        lines.append(f"{r['variant']:8s} {r['wall_s']:7.1f} {r['prompts_s']:9.2f} {r['tok_s']:7.1f} "
                     f"{r['prompts_s'] / base['prompts_s']:7.2f}   {r['steady_prompts_s']:10.2f} "
                     f"{r['steady_tok_s']:12.1f} {r['steady_prompts_s'] / base['steady_prompts_s']:7.2f} "
                     f"{r['tok_per_cpu_s']:9.1f}")
    per_core = rows[1]["tok_per_cpu_s"]
    lines.append(f"load average {os.getloadavg()[0]:.0f} on {os.cpu_count()} cores during the run: wall-clock "
                 f"figures are shares of a busy host; tok/CPU-s is what one dedicated core would give.")
    lines.append(f"A cluster of N such nodes (2 cores, 2 one-thread actors each) would give about N x 2 x "
                 f"{per_core:.0f} = {2 * per_core:.0f}N tok/s in steady state when its cores are its own (less "
                 f"where a node's two actors share its memory bandwidth), after each actor's model load.")
    text = "\n".join(lines)
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"batch_scaling_ray_{datetime.date.today()}"
    stem.with_suffix(".txt").write_text(text + "\n")
    stem.with_suffix(".json").write_text(json.dumps(dict(args=vars(a), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
