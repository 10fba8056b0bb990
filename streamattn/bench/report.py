"""Reports of streamattn.bench.sweep: the table (with the recompute-vs-cache row), the PNG, the machine label."""

from __future__ import annotations

import os
import platform
import time

import numpy as np


def table(rows) -> str:
    """One line per point: median time, tokens/s, GB/s at the median and at the 10th percentile of times
    (what the kernel reaches when no other job interrupts it), the ceiling, the median's % of it."""
    head = (f"{'impl':<6} {'phase':<9} {'mode':<6} {'B':>2} {'Hq/Hkv':>6} {'d':>4} {'dtype':<8} {'L':>6} {'T':>5} "
            f"{'us/call':>10} {'tok/s':>10} {'GB/s':>7} {'p10':>6} {'ceil':>6} {'%ceil':>6} {'err':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        base = (f"{r['impl']:<6} {r['phase']:<9} {r['mode']:<6} {r['batch']:>2} {r['q_heads']:>3}/{r['kv_heads']:<2} "
                f"{r['head_dim']:>4} {r['dtype']:<8} {r['L']:>6} {r['T']:>5} ")
        if r["status"] != "ok":
            lines.append(base + f"{'WRONG: oracle error ' + format(r['oracle_error'], '.3g'):>44}")
            continue
        lines.append(base + f"{r['median_s'] * 1e6:>10.1f} {r['tokens_per_s']:>10.0f} {r['gbps']:>7.2f} {r.get('gbps_p10', np.nan):>6.1f} "
                     f"{r['ceiling_gbps']:>6.1f} {r['pct_ceiling']:>5.1f}% {r['oracle_error']:>8.1e}")
    same = ("impl", "L", "batch", "q_heads", "kv_heads", "head_dim", "dtype", "mode")
    for r in rows:                     # the KV cache's reason to exist, as one row
        dec = [d for d in rows if r["phase"] == "recompute" and d["phase"] == "decode" and r["status"] == "ok"
               and d["status"] == "ok" and all(d[k] == r[k] for k in same)]
        if dec:
            lines.append(f"full recompute vs cached decode, {r['impl']}, L={r['L']}: "
                         f"{r['median_s'] * 1e3:.1f} ms vs {dec[0]['median_s'] * 1e6:.1f} us per new token "
                         f"= {r['median_s'] / dec[0]['median_s']:.0f}x (at the 10th percentiles: "
                         f"{r['p10_s'] / dec[0]['p10_s']:.0f}x)")
    return "\n".join(lines)


def machine() -> dict:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from numba import get_num_threads
    import numba
    return {"cpu": model, "cores": os.cpu_count(), "numba_threads": get_num_threads(),
            "numpy": np.__version__, "numba": numba.__version__, "python": platform.python_version(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def plot(rows, path: str) -> bool:
    """GB/s vs L per implementation, one panel per configuration, the probed ceiling drawn. False if no matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = {}
    for r in rows:
        if r["status"] == "ok" and r["phase"] != "recompute":
            key = (r["phase"], r["mode"], r["batch"], r["q_heads"], r["kv_heads"], r["head_dim"], r["dtype"], r["T"])
            groups.setdefault(key, []).append(r)
    groups = {k: g for k, g in groups.items() if len({r["L"] for r in g}) > 1}
    if not groups:
        return False
    n = len(groups)
    cols = min(4, n)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows), squeeze=False)
    for ax, (key, g) in zip(axes.flat, groups.items()):
        phase, mode, B, hq, hkv, d, dt, T = key
        for impl in dict.fromkeys(r["impl"] for r in g):
            pts = sorted((r["L"], r["gbps"]) for r in g if r["impl"] == impl)
            ax.plot(*zip(*pts), "o-", label=impl)
        Ls = sorted({r["L"] for r in g})
        ceil = [[r["ceiling_gbps"] for r in g if r["L"] == L] for L in Ls]   # every probe beside this L
        ax.fill_between(Ls, [min(c) for c in ceil], [max(c) for c in ceil], color="k", alpha=0.12, lw=0)
        ax.plot(Ls, [float(np.median(c)) for c in ceil], "k--", lw=1, label="read ceiling (probed beside)")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{phase}{' T=' + str(T) if phase == 'prefill' else ''} {mode} B={B} {hq}/{hkv} d={d} {dt}",
                     fontsize=8)
        ax.set_xlabel("L (keys seen)", fontsize=8)
        ax.set_ylabel("GB/s of K+V", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
