"""How close is decode to the read ceiling in each bandwidth mode of a shared host? L = 16k, d = 64, B = 1, causal: MHA 8/8 and GQA 32/8, float32 and float16 (issue 2's targets).

    PYTHONPATH=. python benchmarks/ceiling_modes.py [--seconds 300] [--threads 2] [--out out/ceiling_modes]

The ceiling probe on these hosts is bimodal (docs/PERF.md: ~40 or ~70 GB/s, switching every few seconds
to minutes), and one benchmark point lands in whichever mode the host is in. Here the points take turns
for --seconds: each turn is a short timing (median of --calls calls) between two one-pass probes, and
is filed under the higher of the two. Turns are then split into modes at the widest gap between sorted
probe values (if it is wider than --gap GB/s), and each point gets, per mode, the median % of the
ceiling and the median tokens/s; float16 vs float32 tokens/s is compared within a mode. Every point is
checked against the float64 oracle before its first turn. Writes bench.json and a scatter of achieved
vs probed GB/s (bench.png).
"""

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import numpy as np

from streamattn.bench import report as benchreport, suites, sweep as bench
from streamattn.bench.ceiling import Ceiling

POINTS = [suites.Point(impl="cpu", L=suites.K16, q_heads=hq, kv_heads=8, head_dim=64, dtype=dt)
          for hq in (8, 32) for dt in ("float32", "float16")]


def _key(p: suites.Point) -> str:
    return f"{p.q_heads}/{p.kv_heads} {p.dtype}"


def split_modes(ceilings, gap: float) -> float | None:
    """The probe value that separates two modes, or None for one mode.

    Two clusters by Otsu's rule (the cut that maximises the variance between them); they count as two
    modes when their means are more than ``gap`` GB/s apart (a few probes fall between the modes, so
    the widest single gap between sorted values is not a reliable cut).
    """
    c = np.sort(np.asarray(ceilings, dtype=np.float64))
    if c.size < 2:
        return None
    k = np.arange(1, c.size)                        # cut after the k lowest values
    lo_mean = np.cumsum(c)[:-1] / k
    hi_mean = (c.sum() - np.cumsum(c)[:-1]) / (c.size - k)
    best = int(np.argmax(k * (c.size - k) * (hi_mean - lo_mean) ** 2))
    if hi_mean[best] - lo_mean[best] <= gap:
        return None
    return float((c[best] + c[best + 1]) / 2)


def summarize(turns, gap: float) -> dict:
    """Per mode and point: turns, median % of the ceiling, median tokens/s; float16/float32 per mode."""
    cut = split_modes([t["ceiling_gbps"] for t in turns], gap)
    modes = {"all": lambda c: True} if cut is None else {"low": lambda c: c < cut, "high": lambda c: c >= cut}
    out = {"split_gbps": cut, "modes": {}}
    for mode, keep in modes.items():
        rows = {}
        for key in dict.fromkeys(t["point"] for t in turns):
            sel = [t for t in turns if t["point"] == key and keep(t["ceiling_gbps"])]
            if sel:
                rows[key] = {"turns": len(sel),
                             "pct_ceiling": float(np.median([t["pct_ceiling"] for t in sel])),
                             "tokens_per_s": float(np.median([t["tokens_per_s"] for t in sel])),
                             "ceiling_gbps": float(np.median([t["ceiling_gbps"] for t in sel]))}
        for p in POINTS:                             # float16 against its float32 twin, same mode
            f32 = rows.get(_key(replace(p, dtype="float32")))
            if p.dtype == "float16" and f32 and _key(p) in rows:
                rows[_key(p)]["vs_float32"] = rows[_key(p)]["tokens_per_s"] / f32["tokens_per_s"]
        out["modes"][mode] = rows
    return out


def report(summary) -> None:
    split = summary["split_gbps"]
    print(f"modes split at {split:.1f} GB/s" if split else "one mode")
    print(f"{'mode':5} {'point':13} {'turns':>5} {'ceiling':>8} {'% ceiling':>9} {'tok/s':>7} {'f16/f32':>7}")
    for mode, rows in summary["modes"].items():
        for key, r in rows.items():
            ratio = f"{r['vs_float32']:.2f}x" if "vs_float32" in r else ""
            print(f"{mode:5} {key:13} {r['turns']:5d} {r['ceiling_gbps']:8.1f} {r['pct_ceiling']:8.1f}% "
                  f"{r['tokens_per_s']:7.0f} {ratio:>7}")


def plot(turns, path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 5))
    for key in dict.fromkeys(t["point"] for t in turns):
        sel = [t for t in turns if t["point"] == key]
        ax.scatter([t["ceiling_gbps"] for t in sel], [t["gbps"] for t in sel], s=8, alpha=0.5, label=key)
    hi = max(t["ceiling_gbps"] for t in turns) * 1.05
    for frac in (1.0, 0.8):
        ax.plot([0, hi], [0, frac * hi], "k--" if frac == 1 else "k:", lw=0.8, label=f"{frac:.0%} of ceiling")
    ax.set_xlabel("ceiling probed beside the timing (GB/s)")
    ax.set_ylabel("decode K+V read (GB/s)")
    ax.set_title("decode at L=16k, d=64 vs the host's bandwidth mode")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--calls", type=int, default=15, help="timed calls per turn")
    ap.add_argument("--gap", type=float, default=15.0, help="GB/s between the two modes' mean probes to count as two")
    ap.add_argument("--summarize", metavar="JSON", help="only summarise the turns of an earlier bench.json")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="out/ceiling_modes")
    args = ap.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            report(summarize(json.load(f)["turns"], args.gap))
        return 0
    if args.threads:
        import numba
        numba.set_num_threads(args.threads)
    ceiling = Ceiling()
    rng = np.random.default_rng(0)
    runs = {}
    for p in POINTS:
        caches, q = bench.build(p, rng)
        fn = bench.runner(p, caches, q)
        err = bench.oracle_error(p, fn(0), caches[0], q)
        if not err <= bench.TOL[p.dtype]:
            print(f"{_key(p)}: WRONG, oracle error {err:.3g}", file=sys.stderr)
            return 1
        runs[_key(p)] = (p, fn)
    turns, t0, i = [], time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds:
        for key, (p, fn) in runs.items():
            med, c = ceiling.bracket(fn, args.calls, i)
            i += args.calls
            turns.append({"point": key, "gbps": p.bytes_read / med / 1e9, "ceiling_gbps": c,
                          "pct_ceiling": 100 * p.bytes_read / med / 1e9 / c, "tokens_per_s": p.new_tokens / med})
        print(f"\r{time.perf_counter() - t0:5.0f} s, {len(turns)} turns", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    summary = summarize(turns, args.gap)
    report(summary)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"machine": benchreport.machine(), "seconds": args.seconds, "summary": summary,
                   "turns": turns}, f, indent=1)
    drew = plot(turns, os.path.join(args.out, "bench.png"))
    print(f"wrote {args.out}/bench.json" + (" and bench.png" if drew else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
