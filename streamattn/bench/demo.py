"""Streaming decode on random q/k/v: every step checked against the float64 oracle, the ring shown wrapping.

    python -m streamattn.bench.demo [--steps 40] [--window 8] [--sinks 2] [--dtype float16]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from .. import CacheSpec, KVCache, attend
from ..kv.reference import TOLERANCE, attention


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streamattn.bench.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--sinks", type=int, default=2)
    ap.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args(argv)

    spec = CacheSpec(batch=1, kv_heads=2, head_dim=64, dtype=args.dtype, window=args.window, sinks=args.sinks)
    cache = KVCache(spec)
    rng = np.random.default_rng(0)
    hist_k, hist_v = [], []
    print(f"{spec.mode} cache: {spec.slots} slots = sinks {spec.sinks} + window {spec.window}, "
          f"{cache.nbytes} bytes for ever; GQA 8/2, head_dim 64, {args.dtype}, backend {args.backend}")
    print(" step  slot  positions held (slot order)                      max rel err   lse err   ms")
    worst = 0.0
    for step in range(args.steps):
        k, v = rng.standard_normal((2, 1, 2, 1, 64)).astype(np.float32)
        q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
        slot = int(cache.slots_of(cache.lengths)[0])
        t = time.perf_counter()
        cache.append(k, v)
        out, lse = attend(q, cache, backend=args.backend)
        ms = (time.perf_counter() - t) * 1e3
        hist_k.append(k[0])
        hist_v.append(v[0])
        ref, ref_lse = attention(q[0], np.concatenate(hist_k, 1), np.concatenate(hist_v, 1), [step],
                                 window=spec.window, sinks=spec.sinks)
        err = float(np.abs(out[0] - ref).max() / np.abs(ref).max())
        worst = max(worst, err)
        held = cache.temporal_view(0)[2]
        by_slot = {int(s): int(p) for s, p in zip(cache.slots_of(held), held)}
        shown = " ".join(f"{by_slot.get(s, '-'):>3}" for s in range(cache.slots))
        print(f"{step:5d}  {slot:4d}  [{shown:<47}]  {err:10.2e}  {abs(lse - ref_lse).max():8.1e}  {ms:5.2f}")
    print(f"worst relative error over {args.steps} steps: {worst:.2e} (tolerance for {args.dtype}: "
          f"{TOLERANCE[args.dtype]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
