"""Does quantized K/V storage make decode attention faster in proportion to the bytes it saves? float16
against q8_0 and q4_0 (issue 28) at L = 4k..64k, B = 1, causal, head_dim 64.

    PYTHONPATH=. python benchmarks/kv_quant_decode.py [--L 4096 16384 32768 65536] [--rounds 5] [--threads 2]
        [--heads 9/3 32/8] [--out benchmarks/results/kv_quant_decode_DATE]

Per row of 64 values K + V read 256 bytes in float16, 136 in q8_0 (two 34-byte blocks each), 72 in q4_0.
Points take turns: per round, each (heads, L) runs float16, q8_0 and q4_0 back to back, each timing (the
median of --calls calls, caches rotated past L3) between two one-pass read-ceiling probes and filed with
the higher one. Each call starts cold: the probe's 1 GiB buffer is read before it, untimed
(``Ceiling.evict``), as a model's other layers evict a layer's K/V between steps. Rotating caches alone
did not do that on a host whose LLC (480 MiB here) holds all of a kind's copies: float16's 3 copies at
32k were read from the LLC after the first visits while q4_0's 10 were read from memory, and the ratios
measured the LLC (``--warm`` keeps that mode). Reported per point: medians over rounds of tok/s, GB/s of
K/V read, % of the ceiling, and the tok/s ratio to the float16 timing of the same round. Every point is checked against the float64
oracle over its stored values first (float32 tolerance).
"""

import argparse
import json
import os
import sys
import time

import numpy as np

from streamattn.bench import report as benchreport, suites, sweep
from streamattn.bench.ceiling import Ceiling

DTYPES = ("float16", "q8_0", "q4_0")
ORACLE_TOL = 1e-5                         # float32 arithmetic over the stored values (tests/oracle.py)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--L", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    ap.add_argument("--heads", nargs="+", default=["9/3"], help="q_heads/kv_heads (SmolLM2-135M: 9/3)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=15, help="timed calls per turn")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--warm", action="store_true",
                    help="time calls back to back (the default evicts the last-level cache before each call)")
    ap.add_argument("--out", default="out/kv_quant_decode")
    args = ap.parse_args(argv)
    if args.threads:
        import numba
        numba.set_num_threads(args.threads)
    ceiling, rng = Ceiling(), np.random.default_rng(0)
    groups = []                                     # (label, {dtype: (point, fn)})
    for heads in args.heads:
        hq, hkv = (int(x) for x in heads.split("/"))
        for L in args.L:
            runs = {}
            for dt in DTYPES:
                p = suites.Point(impl="cpu", L=L, q_heads=hq, kv_heads=hkv, head_dim=64, dtype=dt)
                caches, q = sweep.build(p, rng)
                fn = sweep.runner(p, caches, q)
                err = sweep.oracle_error(p, fn(0), caches[0], q)
                if not err <= ORACLE_TOL:
                    print(f"{heads} L={L} {dt}: WRONG, oracle error {err:.3g}", file=sys.stderr)
                    return 1
                runs[dt] = (p, fn)
            groups.append((f"{heads} L={L}", runs))
    turns, i = [], 0
    for rnd in range(args.rounds):
        for label, runs in groups:
            for dt, (p, fn) in runs.items():
                med, c = ceiling.bracket(fn, args.calls, i, cold=not args.warm)
                i += args.calls
                turns.append({"round": rnd, "point": label, "dtype": dt, "bytes": p.bytes_read, "seconds": med,
                              "tokens_per_s": 1.0 / med, "gbps": p.bytes_read / med / 1e9, "ceiling_gbps": c,
                              "pct_ceiling": 100 * p.bytes_read / med / 1e9 / c})
        print(f"\rround {rnd + 1}/{args.rounds}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    summary = summarize(turns)
    lines = report(summary)
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"machine": benchreport.machine(), "argv": sys.argv[1:], "load": os.getloadavg(),
                   "summary": summary, "turns": turns}, f, indent=1)
    with open(args.out + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}.json and .txt", file=sys.stderr)
    return 0


def summarize(turns) -> dict:
    """Per point and dtype: medians over rounds; ``vs_float16``: median of the same-round tok/s ratios."""
    out = {}
    for label in dict.fromkeys(t["point"] for t in turns):
        rows = {}
        for dt in DTYPES:
            sel = [t for t in turns if t["point"] == label and t["dtype"] == dt]
            f16 = {t["round"]: t for t in turns if t["point"] == label and t["dtype"] == "float16"}
            rows[dt] = {"bytes": sel[0]["bytes"], "turns": len(sel),
                        **{k: float(np.median([t[k] for t in sel]))
                           for k in ("tokens_per_s", "gbps", "ceiling_gbps", "pct_ceiling")},
                        "vs_float16": float(np.median([t["tokens_per_s"] / f16[t["round"]]["tokens_per_s"]
                                                       for t in sel]))}
        out[label] = rows
    return out


def report(summary) -> list:
    lines = [f"{'point':16} {'dtype':8} {'MB read':>8} {'tok/s':>8} {'GB/s':>6} {'ceiling':>7} {'% ceil':>6} "
             f"{'vs f16':>6}"]
    for label, rows in summary.items():
        for dt, r in rows.items():
            lines.append(f"{label:16} {dt:8} {r['bytes'] / 1e6:8.2f} {r['tokens_per_s']:8.0f} {r['gbps']:6.1f} "
                         f"{r['ceiling_gbps']:7.1f} {r['pct_ceiling']:5.0f}% {r['vs_float16']:5.2f}x")
    return lines


if __name__ == "__main__":
    sys.exit(main())
