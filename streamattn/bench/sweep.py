"""Attention throughput over a KV cache, beside the machine's read ceiling probed in the same run.

    python -m streamattn.bench.sweep --quick                  # < 2 minutes on a 2-core host
    python -m streamattn.bench.sweep                          # every suite: table, out/bench/bench.json, bench.png
    python -m streamattn.bench.sweep --suite decode --impl cpu,numpy --threads 2

For every point: the implementation's output is checked against the float64 oracle on a slice (sequence
0, first and last KV head's query group, newest <= 64 queries) BEFORE timing; then warm-up calls, then
the median of many timed calls, each on the next of >= 2 caches whose total exceeds the L3 (64 MiB), so
K and V come from memory as they do in a model with many layers. Achieved GB/s = bytes of K and V the
queries must read / median time; "% ceil" divides it by the read ceiling (a Numba parallel sum over
1 GiB, ``streamattn.bench.ceiling``; on a GPU a device copy) probed right before and right after the point,
the better of the two: on shared hosts the ceiling is bimodal (docs/PERF.md), so a ceiling measured
minutes earlier says little.

The points and suites live in streamattn/bench/suites.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

import numpy as np

from .. import KVCache, attend
from ..kv import backends
from ..runtime.arrays import to_host
from . import peers
from . import report as benchreport
from ..kv.rotation import rotate
from ..kv.reference import TOLERANCE as TOL  # same numbers as tests/oracle.py; here vs the stored values
from ..kv.storage import to_storage
from .suites import Point, available_impls, select, suite

ROTATE_BYTES = 64 << 20          # rotate caches until this much K+V: 2x the 32 MiB L3 of this machine kind
CHECK_ROWS = 64                  # newest queries compared with the oracle before timing


# -- building caches ----------------------------------------------------------------------------------

def build(point: Point, rng, device: str = "cpu", rotate_bytes: int = ROTATE_BYTES):
    """Caches to rotate through (>= 2, > ``rotate_bytes`` in all, <= 256) and the queries [B, Hq, T, D] float32.

    Every cache holds the same random K/V as if ``point.length`` tokens had been appended (a window ring
    full), written with ``KVCache.write_sequence``, with the newest T tokens pending as queries.
    """
    spec = point.spec()
    first = KVCache(spec, device=device)
    n = point.L if spec.window is None else first.slots
    rows = [to_storage(rng.standard_normal((spec.batch, spec.kv_heads, n, spec.head_dim), dtype=np.float32),
                       spec.dtype, np) for _ in "kv"]
    caches = []
    while len(caches) < 2 or (len(caches) * first.nbytes < rotate_bytes and len(caches) < 256):
        c = first if not caches else KVCache(spec, device=device)
        for b in range(spec.batch):
            c.write_sequence(b, rows[0][b], rows[1][b], length=point.length, last_count=point.T)
        caches.append(c)
    q = rng.standard_normal((spec.batch, point.q_heads, point.T, spec.head_dim), dtype=np.float32)
    return caches, (first.xp.asarray(q) if device == "gpu" else q)


def runner(point: Point, caches, q):
    """fn(i) -> out of the i-th call (on cache i mod n); blocks until the result exists."""
    scale = 1.0 / float(np.sqrt(point.head_dim))
    if point.impl in ("cpu", "gpu"):
        sync = _gpu_sync if point.impl == "gpu" else (lambda: None)

        def run(i):
            out = attend(q, caches[i % len(caches)], backend=point.impl)[0]
            sync()
            return out
        return run
    peer = {"numpy": peers.numpy_attention, "torch": peers.torch_attention}[point.impl]
    c0 = caches[0]
    S = point.L if point.mode == "causal" else c0.slots    # causal storage beyond L was never written
    mask = peers.visibility(c0.lengths, point.T, slots=c0.slots, sinks=c0.spec.sinks, window=c0.spec.window)
    views = [(c.k[:, :, :S], c.v[:, :, :S]) for c in caches]
    mask = np.ascontiguousarray(mask[:, :, :S])
    return lambda i: peer(q, *views[i % len(views)], mask, scale=scale, kind=point.dtype)


def _gpu_sync():
    import cupy
    cupy.cuda.runtime.deviceSynchronize()


def oracle_error(point: Point, out, cache, q) -> float:
    """max |out - oracle| / max |oracle| over sequence 0, first and last KV head's group, newest queries.

    The oracle is the reference backend (float64 over what the ring holds), on those slices only; a
    ``rotate_k`` cache holds keys in the rotated frame, so its queries are scored as ``q @ H``, as
    :func:`streamattn.attend` does.
    """
    out = to_host(out, copy=False)
    spec, G, T = cache.spec, point.q_heads // point.kv_heads, point.T
    if spec.rotate_k:
        q = rotate(q, cache.xp)
    c = min(T, CHECK_ROWS)
    err = 0.0
    for h in sorted({0, spec.kv_heads - 1}):
        heads = slice(h * G, (h + 1) * G)
        ref, _ = backends.reference_backend(
            q[:1, heads, T - c:], cache.k[:1, h:h + 1], cache.v[:1, h:h + 1], cache.lengths[:1], np.array([c]),
            window=spec.window or 0, sinks=spec.sinks, scale=1.0 / np.sqrt(spec.head_dim), kind=spec.dtype)
        ref = ref[0].astype(np.float64)
        got = out[0, heads, T - c:].astype(np.float64)
        err = max(err, float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)))
    return err


# -- timing -------------------------------------------------------------------------------------------

def time_calls(fn, *, warmup: int = 3, min_reps: int = 10, max_reps: int = 500, min_time: float = 0.3):
    """Median seconds of ``fn(i)`` over >= min_reps calls and >= min_time seconds (<= max_reps), after warm-up."""
    for i in range(warmup):
        fn(i)
    times = []
    start = time.perf_counter()
    i = warmup
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < min_time):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
        i += 1
    return float(np.median(times)), times


def time_step(step, *, tokens_per_call: int, warmup: int = 2, min_reps: int = 5, min_time: float = 1.0) -> dict:
    """End-to-end hook: tokens/s of any blocking callable ``step()`` that processes ``tokens_per_call`` tokens.

    The model engine plugs in here: ``step`` = one decode step of the whole batch (tokens_per_call = batch)
    or one prefill (tokens_per_call = batch * prompt length). See :func:`end_to_end`.
    """
    med, times = time_calls(lambda i: step(), warmup=warmup, min_reps=min_reps, min_time=min_time)
    return {"median_s": med, "tokens_per_s": tokens_per_call / med, "reps": len(times)}


def end_to_end(make_engine, *, contexts=(512, 4096, 16384), batches=(1, 8), caches=("full", "window"),
               prefill_warmup: int = 1, prefill_reps: int = 3):
    """Prefill and decode tokens/s of a real model over contexts x batches x cache kinds.

    ``make_engine(context=, batch=, cache=)`` returns ``(prefill, decode)``: ``prefill()`` runs a prompt of
    ``context`` tokens per sequence from an empty cache, ``decode()`` one token per sequence after it;
    both block until done; return None for a combination the model does not allow. Each prefill is
    timed ``prefill_reps`` times after ``prefill_warmup`` untimed calls (long prompts: 0 and 1, after a
    short warm-up of your own); decode steps run on the last prefill's caches.
    """
    rows = []
    for cache in caches:
        for context in contexts:
            for batch in batches:
                engine = make_engine(context=context, batch=batch, cache=cache)
                if engine is None:
                    continue
                prefill, decode = engine
                row = {"cache": cache, "context": context, "batch": batch}
                row["prefill"] = time_step(prefill, tokens_per_call=batch * context, warmup=prefill_warmup,
                                           min_reps=prefill_reps, min_time=0)
                row["decode"] = time_step(decode, tokens_per_call=batch)
                rows.append(row)
    return rows


def make_ceiling(device: str, nbytes: int):
    if device == "gpu":
        return _GpuCopyCeiling(nbytes)
    from .ceiling import Ceiling
    return Ceiling(nbytes)


class _GpuCopyCeiling:
    """Device copy bandwidth, (read + written bytes) / time of a device-to-device copy."""

    def __init__(self, nbytes: int):
        import cupy
        self.a = cupy.ones(nbytes // 4, cupy.float32)
        self.b = cupy.empty_like(self.a)

    def probe(self, repeats: int = 3) -> float:
        import cupy
        best = 0.0
        for _ in range(repeats):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            self.b[...] = self.a
            stop.record()
            stop.synchronize()
            best = max(best, 2 * self.a.nbytes / (cupy.cuda.get_elapsed_time(start, stop) * 1e-3) / 1e9)
        return best


def measure(point: Point, caches, q, ceiling, *, warmup=3, min_reps=10, max_reps=500, min_time=0.3) -> dict:
    """Check, then time one point; the ceiling is probed right before and right after it."""
    row = asdict(point)
    row["bytes_read"] = point.bytes_read
    fn = runner(point, caches, q)
    err = oracle_error(point, fn(0), caches[0], q)
    row["oracle_error"], row["tolerance"] = err, TOL[point.dtype]
    if not err <= TOL[point.dtype]:
        row["status"] = "WRONG"
        return row
    if point.phase == "recompute":      # seconds per call; the checked call above was the warm-up
        warmup, min_reps, min_time = 0, 3, 0.0
    row["loadavg_1min"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None   # other jobs on the host
    before = ceiling.probe(2)
    readers = dict(getattr(ceiling, "last", {}))         # (reader, threads) -> GB/s: which reader set the ceiling
    med, times = time_calls(fn, warmup=warmup, min_reps=min_reps, max_reps=max_reps, min_time=min_time)
    after = ceiling.probe(2)
    for key, gbps in getattr(ceiling, "last", {}).items():
        readers[key] = max(readers.get(key, 0.0), gbps)
    row["ceiling_readers"] = {f"{reader}/{threads}": gbps for (reader, threads), gbps in readers.items()}
    row.update(status="ok", median_s=med, reps=len(times), p10_s=float(np.percentile(times, 10)),
               p90_s=float(np.percentile(times, 90)), tokens_per_s=point.new_tokens / med,
               gbps=point.bytes_read / med / 1e9, gbps_p10=point.bytes_read / float(np.percentile(times, 10)) / 1e9,
               ceiling_before=before, ceiling_after=after,
               ceiling_gbps=max(before, after), caches=len(caches))
    row["pct_ceiling"] = 100 * row["gbps"] / row["ceiling_gbps"]
    return row


def run(points, *, device_of=lambda impl: "gpu" if impl == "gpu" else "cpu", ceiling_bytes=1 << 30,
        rotate_bytes=ROTATE_BYTES, seed=0, log=sys.stderr, **timing) -> list[dict]:
    """Measure ``points``; caches are built once per configuration and shared by its implementations."""
    rng = np.random.default_rng(seed)
    ceilings, rows = {}, []
    configs = {}
    for p in points:
        configs.setdefault((p.config(), device_of(p.impl)), []).append(p)
    done = 0
    for (cfg, device), group in configs.items():
        if device not in ceilings:
            print(f"probing the {device} read ceiling ({ceiling_bytes >> 20} MiB)...", file=log, flush=True)
            ceilings[device] = make_ceiling(device, ceiling_bytes)
        caches, q = build(cfg, rng, device, rotate_bytes)
        for p in group:
            done += 1
            row = measure(p, caches, q, ceilings[device], **timing)
            rows.append(row)
            print(f"[{done}/{len(points)}] {_label(p):<52} " + (
                f"{row['gbps']:7.2f} GB/s  {row['pct_ceiling']:5.1f}% of {row['ceiling_gbps']:.1f}"
                if row["status"] == "ok" else f"WRONG: error {row['oracle_error']:.3g} > {row['tolerance']}"),
                file=log, flush=True)
        del caches, q
    return rows


def _label(p) -> str:
    p = p if isinstance(p, dict) else asdict(p)
    t = f" T={p['T']}" if p["phase"] == "prefill" else ""
    return (f"{p['impl']:<6}{p['phase']:<10}{p['mode']:<7}B={p['batch']} {p['q_heads']}/{p['kv_heads']} "
            f"d={p['head_dim']} {p['dtype']} L={p['L']}{t}")


# -- command line -------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the small suite, short timings (< 2 min on 2 cores)")
    p.add_argument("--suite", default=None,
                   help="quick, decode, modes, batch, prefill, recompute or full (default full; quick with --quick)")
    p.add_argument("--impl", default=None, help="comma list of cpu,gpu,numpy,torch (default: all available)")
    p.add_argument("--where", default=None, metavar="FIELD=V[|V..],...",
                   help="keep the suite's points whose fields match, e.g. 'L=16384,head_dim=64,dtype=float32|float16'")
    p.add_argument("--threads", type=int, default=None, help="Numba threads (default: all cores)")
    p.add_argument("--out", default="out/bench", help="folder for bench.json and bench.png")
    p.add_argument("--min-time", type=float, default=None, help="seconds of timed calls per point")
    p.add_argument("--ceiling-mib", type=int, default=1024, help="buffer the ceiling probe sums")


def run_args(args) -> int:
    """Run the benchmark described by parsed ``args`` (the ``streamattn bench`` subcommand)."""
    if args.threads:
        import numba
        numba.set_num_threads(args.threads)
    name = args.suite or ("quick" if args.quick else "full")
    impls = args.impl.split(",") if args.impl else available_impls()
    min_time = args.min_time if args.min_time is not None else (0.15 if name == "quick" else 0.4)
    points = select(suite(name, impls), args.where)
    info = benchreport.machine()
    print(f"streamattn bench: suite {name}, {len(points)} points, impls {','.join(impls)}, "
          f"{info['numba_threads']} Numba threads, {info['cpu']}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    rows = run(points, ceiling_bytes=args.ceiling_mib << 20, min_time=min_time,
               max_reps=100 if name == "quick" else 500)
    info["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    info["seconds"] = time.perf_counter() - t0
    print(benchreport.table(rows))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"machine": info, "suite": name, "points": rows}, f, indent=1)
    png = os.path.join(args.out, "bench.png")
    drew = benchreport.plot(rows, png)
    print(f"wrote {os.path.join(args.out, 'bench.json')}" + (f" and {png}" if drew else "") +
          f" in {info['seconds']:.0f} s", file=sys.stderr)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m streamattn.bench.sweep", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
