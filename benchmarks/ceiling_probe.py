"""Is the read-ceiling probe a ceiling? The CPU decode kernel against the old probe and the new, same run.

    PYTHONPATH=. python benchmarks/ceiling_probe.py [--turns 3] [--threads 2] [--where "L=16384,head_dim=64"]

Runs ``streamattn bench --suite decode`` points (default: L = 16k, head_dim 64, float32 and float16, MHA
and GQA; impl cpu) for ``--turns`` turns. Each point's ceiling is probed right before and after its
timing by every reader of streamattn/bench/ceiling.py; the old probe is the two Numba sums on all
threads (what the probe was before issue 13), the new one the best of all readers and thread counts.
Prints, per point and turn, the kernel's % of each and which reader set the new ceiling; writes
benchmarks/results/ceiling_probe_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import numba

from streamattn.bench import suites, sweep

OUT = Path(__file__).resolve().parent / "results"


def old_probe(readers: dict, threads: int) -> float:
    """The probe as it was: best of the one- and two-stream sums on all threads."""
    return max(readers[f"sum/{threads}"], readers[f"sum2/{threads}"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--where", default="L=16384,head_dim=64")
    ap.add_argument("--min-time", type=float, default=0.3)
    args = ap.parse_args(argv)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    threads = numba.get_num_threads()
    points = suites.select(suites.suite("decode", ["cpu"]), args.where)
    rows = []
    for turn in range(args.turns):
        for r in sweep.run(points, min_time=args.min_time, seed=turn):
            if r["status"] == "ok":
                r["turn"] = turn
                r["pct_old"] = 100 * r["gbps"] / old_probe(r["ceiling_readers"], threads)
                r["best_reader"] = max(r["ceiling_readers"], key=r["ceiling_readers"].get)
                rows.append(r)
    print("| heads | dtype | turn | kernel GB/s | old probe GB/s | % of old | new probe GB/s | % of new | best reader |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['q_heads']}/{r['kv_heads']} | {r['dtype']} | {r['turn']} | {r['gbps']:.1f} | "
              f"{old_probe(r['ceiling_readers'], threads):.1f} | {r['pct_old']:.0f}% | {r['ceiling_gbps']:.1f} | "
              f"{r['pct_ceiling']:.0f}% | {r['best_reader']} |")
    wins = {}
    for r in rows:
        wins[r["best_reader"]] = wins.get(r["best_reader"], 0) + 1
    print(f"median % of old probe {statistics.median(r['pct_old'] for r in rows):.0f}%, of new "
          f"{statistics.median(r['pct_ceiling'] for r in rows):.0f}%, max of new "
          f"{max(r['pct_ceiling'] for r in rows):.0f}%; best reader counts {wins}; load {os.getloadavg()[0]:.0f}")
    OUT.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc)
    (OUT / f"ceiling_probe_{stamp:%Y-%m-%d}.json").write_text(json.dumps(
        {"command": "PYTHONPATH=. python benchmarks/ceiling_probe.py " + " ".join(argv or sys.argv[1:]),
         "utc": stamp.isoformat(timespec="seconds"), "threads": threads, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
