"""Stream a million tokens through window caches: flat memory, flat per-token time, still exact.

    python -m streamattn.bench.stream --tokens 1000000        # summary line on stdout, out/stream/stream.{png,json}
    python -m streamattn.bench.stream --tokens 20000 --check-every 101 --threads 1

An attention-only engine: ``layers`` window caches (GQA, window n_c + n_s sinks, float16 by default), and
per token and layer a random K/V row appended and a random query attended (random projections of
nothing: the cache and the kernel are what is under test). Along the way it records every token's
latency (all layers' append + attend), samples the process RSS (psutil), and every ``check_every``
tokens compares each layer's output with the float64 oracle over the visible window, kept beside the
cache independently: the first n_s tokens and a deque of the last n_c.

The loop allocates nothing of its own: random K/V/q come from buffers refilled in blocks, and the
latency/RSS records are preallocated and touched before the stream starts (an untouched page joining
the RSS later would read as growth). What ``append``/``attend`` allocate inside is the engine's cost.

Summary: latency at the end / latency at 1k (medians over 1000 tokens: tokens 1000..1999 vs the last
1000), RSS growth from token 1000 to the largest later sample, max oracle error over all checks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from .. import CacheSpec, KVCache, attend
from ..kv.reference import attention

from ..kv.reference import TOLERANCE as TOL  # vs the float32 originals
WIN = 1000                                                    # tokens per latency median


@dataclass(frozen=True)
class StreamConfig:
    tokens: int = 1_000_000
    layers: int = 2
    batch: int = 1
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    window: int = 512
    sinks: int = 4
    dtype: str = "float16"
    backend: str = "cpu"
    check_every: int = 997       # odd, so checks land on every phase of the ring
    rss_every: int = 1000
    block: int = 4096            # tokens of random K/V/q generated at once
    seed: int = 0


def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def stream(cfg: StreamConfig, log=sys.stderr) -> dict:
    """Run the stream; returns the summary dict plus per-1000-token latency medians and RSS samples."""
    if cfg.tokens < 2 * WIN:
        raise ValueError(f"tokens must be >= {2 * WIN} to compare latency at 1k with the end (got {cfg.tokens})")
    spec = CacheSpec(batch=cfg.batch, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype,
                     window=cfg.window, sinks=cfg.sinks)
    B, Hq, Hkv, D, NL = cfg.batch, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.layers
    rng = np.random.default_rng(cfg.seed)
    kb = np.empty((cfg.block, NL, B, Hkv, 1, D), np.float32)   # [block, layer, B, Hkv, 1, D] random K rows
    vb = np.empty_like(kb)                                      # same for V
    qb = np.empty((cfg.block, NL, B, Hq, 1, D), np.float32)    # [block, layer, B, Hq, 1, D] random queries
    lat = np.full(cfg.tokens, np.nan)                           # [tokens] seconds per token, touched now
    n_rss = cfg.tokens // cfg.rss_every + 1
    rss_pos = np.full(n_rss, -1, np.int64)                      # [samples] token position of each sample
    rss_val = np.full(n_rss, -1, np.int64)                      # [samples] bytes

    _warm_up(spec, cfg)                                         # JIT compile outside the measurement
    caches = [KVCache(spec) for _ in range(NL)]
    storage = [(id(c.k), id(c.v), c.nbytes) for c in caches]
    sink_hist = [[] for _ in range(NL)]                         # per layer: (k, v) [B, Hkv, D] of tokens < n_s
    win_hist = [deque(maxlen=cfg.window) for _ in range(NL)]    # per layer: (pos, k, v) of the last n_c tokens
    outs = [None] * NL
    max_err, checks, bad = 0.0, 0, []
    ns = 0
    t_start = time.perf_counter()
    for i in range(cfg.tokens):
        j = i % cfg.block
        if j == 0:
            for buf in (kb, vb, qb):
                rng.standard_normal(dtype=np.float32, out=buf)
        t = time.perf_counter()
        for layer in range(NL):                 # the decode step: write the token, then attend
            caches[layer].append(kb[j, layer], vb[j, layer])
            outs[layer] = attend(qb[j, layer], caches[layer], backend=cfg.backend)[0]
        lat[i] = time.perf_counter() - t
        for layer in range(NL):                 # history beside the cache, for the oracle
            row = (kb[j, layer, :, :, 0].copy(), vb[j, layer, :, :, 0].copy())   # [B, Hkv, D] each
            if i < cfg.sinks:
                sink_hist[layer].append(row)
            win_hist[layer].append((i,) + row)
        if i % cfg.check_every == 0 or i == cfg.tokens - 1:
            for layer in range(NL):
                err = _oracle_error(outs[layer], qb[j, layer], i, sink_hist[layer], win_hist[layer], cfg)
                checks += 1
                max_err = max(max_err, err)
                if not err <= TOL[cfg.dtype]:
                    bad.append((i, layer, err))
        if i % cfg.rss_every == 0:
            rss_pos[ns], rss_val[ns] = i, _rss()
            ns += 1
        if i and i % 100_000 == 0:
            el = time.perf_counter() - t_start
            print(f"  token {i:>9,}: {i / el:7.0f} tok/s so far, latency {np.median(lat[i - WIN:i]) * 1e6:6.1f} us "
                  f"(median of last {WIN}), RSS {rss_val[ns - 1] / 2**20:.1f} MiB, max oracle error {max_err:.2e}",
                  file=log, flush=True)
    elapsed = time.perf_counter() - t_start
    same_storage = all((id(c.k), id(c.v), c.nbytes) == s for c, s in zip(caches, storage))

    n_win = cfg.tokens // WIN
    windows = lat[:n_win * WIN].reshape(n_win, WIN)
    med = np.median(windows, axis=1)                            # [n_win] median latency per 1000 tokens
    p90 = np.percentile(windows, 90, axis=1)
    rss_pos, rss_val = rss_pos[:ns], rss_val[:ns]
    base = rss_val[np.searchsorted(rss_pos, WIN)]               # RSS at token 1000 (steady state)
    later = rss_val[rss_pos >= WIN]
    at_1k = float(np.median(lat[WIN:2 * WIN]))
    at_end = float(np.median(lat[-WIN:]))
    return {
        "config": asdict(cfg), "seconds": elapsed, "tokens_per_s": cfg.tokens / elapsed,
        "latency_1k_us": at_1k * 1e6, "latency_end_us": at_end * 1e6, "latency_ratio": at_end / at_1k,
        "latency_median_us": float(np.median(med)) * 1e6,       # of all 1000-token windows: the steady state
        "rss_1k_mib": base / 2**20, "rss_max_mib": later.max() / 2**20, "rss_end_mib": rss_val[-1] / 2**20,
        "rss_growth_pct": 100 * (later.max() - base) / base,
        "max_oracle_error": max_err, "tolerance": TOL[cfg.dtype], "checks": checks, "failed_checks": bad[:20],
        "cache_bytes_per_layer": storage[0][2], "storage_never_reallocated": same_storage,
        "latency_window_medians_us": (med * 1e6).round(3).tolist(),
        "latency_window_p90_us": (p90 * 1e6).round(3).tolist(),
        "rss_positions": rss_pos.tolist(), "rss_bytes": rss_val.tolist(),
    }


def _warm_up(spec, cfg) -> None:
    """Compile the kernels and reach the ring's steady state once, on throwaway caches."""
    c = KVCache(spec)
    x = np.ones((cfg.batch, cfg.kv_heads, 1, cfg.head_dim), np.float32)
    q = np.ones((cfg.batch, cfg.q_heads, 1, cfg.head_dim), np.float32)
    for _ in range(spec.slots + 8):
        c.append(x, x)
        attend(q, c, backend=cfg.backend)


def _oracle_error(out, q, i, sinks, window, cfg) -> float:
    """max |out - oracle| / max |oracle| for token i over all sequences; the oracle sees sinks + window."""
    rows = sinks + [(k, v) for p, k, v in window if p >= cfg.sinks]
    pos = np.array(list(range(len(sinks))) + [p for p, _, _ in window if p >= cfg.sinks])
    k = np.stack([r[0] for r in rows], axis=2)                  # [B, Hkv, n, D]
    v = np.stack([r[1] for r in rows], axis=2)
    err = 0.0
    for b in range(cfg.batch):
        ref, _ = attention(q[b], k[b], v[b], [i], window=cfg.window, sinks=cfg.sinks, k_pos=pos)
        err = max(err, float(np.abs(out[b].astype(np.float64) - ref).max() / np.abs(ref).max()))
    return err


def summary_line(r: dict) -> str:
    c = r["config"]
    return (f"stream: {c['tokens']:,} tokens x {c['layers']} layers, GQA {c['q_heads']}/{c['kv_heads']} "
            f"d={c['head_dim']} {c['dtype']}, window {c['window']} + {c['sinks']} sinks, {c['backend']}: "
            f"latency at {c['tokens'] // 1000}k / at 1k = {r['latency_ratio']:.3f} "
            f"({r['latency_end_us']:.1f} / {r['latency_1k_us']:.1f} us per token; median of all "
            f"{WIN}-token windows {r['latency_median_us']:.1f} us); "
            f"RSS growth {r['rss_growth_pct']:+.2f}% ({r['rss_1k_mib']:.1f} -> max {r['rss_max_mib']:.1f} MiB); "
            f"max oracle error {r['max_oracle_error']:.2e} (tol {r['tolerance']:g}) over {r['checks']} checks, "
            f"{len(r['failed_checks'])} failed; cache {r['cache_bytes_per_layer']} B/layer, "
            f"{'never reallocated' if r['storage_never_reallocated'] else 'REALLOCATED'}; "
            f"{r['tokens_per_s']:.0f} tok/s overall")


def plot(r: dict, path: str) -> bool:
    """Latency (median and p90 per 1000 tokens) and RSS vs position. False if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    med = np.array(r["latency_window_medians_us"])
    x = (np.arange(len(med)) + 0.5) * WIN
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    a.fill_between(x, med, r["latency_window_p90_us"], color="C0", alpha=0.25, lw=0, label="p90")
    a.plot(x, med, "C0", lw=0.8, label=f"median per {WIN} tokens")
    a.set_ylim(0, 2 * np.percentile(med, 99))
    a.set_ylabel("latency per token (us)")
    a.legend(fontsize=8)
    a.set_title(summary_line(r).split(": latency")[0] + f"\nlatency at end / at 1k = {r['latency_ratio']:.3f} "
                f"({r['latency_end_us']:.1f} / {r['latency_1k_us']:.1f} us per token)", fontsize=8)
    b.plot(r["rss_positions"], np.array(r["rss_bytes"]) / 2**20, "C1", lw=0.8)
    b.set_ylim(0, 1.2 * max(r["rss_bytes"]) / 2**20)
    b.set_ylabel("process RSS (MiB)")
    b.set_xlabel("token position")
    b.set_title(f"RSS growth {r['rss_growth_pct']:+.2f}%, max oracle error {r['max_oracle_error']:.2e}",
                fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = StreamConfig()
    for name in ("tokens", "layers", "batch", "q_heads", "kv_heads", "head_dim", "window", "sinks",
                 "check_every", "rss_every", "block", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--backend", default=d.backend)
    p.add_argument("--threads", type=int, default=1,
                   help="Numba threads (default 1: one token's work is tiny, a parallel launch costs more)")
    p.add_argument("--out", default="out/stream", help="folder for stream.json and stream.png")


def run_args(args) -> int:
    """Run the stream described by parsed ``args`` (the ``streamattn stream`` subcommand)."""
    if args.threads:
        import numba
        numba.set_num_threads(args.threads)
    cfg = StreamConfig(**{k: getattr(args, k) for k in asdict(StreamConfig()) if hasattr(args, k)})
    print(f"streaming {cfg.tokens:,} tokens ({args.threads} Numba thread(s))...", file=sys.stderr, flush=True)
    r = stream(cfg)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stream.json"), "w") as f:
        json.dump(r, f)
    png = os.path.join(args.out, "stream.png")
    drew = plot(r, png)
    print(summary_line(r))
    print(f"wrote {os.path.join(args.out, 'stream.json')}" + (f" and {png}" if drew else ""), file=sys.stderr)
    return 0 if not r["failed_checks"] and r["storage_never_reallocated"] else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m streamattn.bench.stream", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
