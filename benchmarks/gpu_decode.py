"""GPU decode bandwidth: split-K decode (+ merge) vs a device-to-device copy measured in the same run.

Question: how close does one decode step come to the memory bandwidth the device shows on a plain copy,
and how much faster do quantized K/V rows (q8_0, q4_0: 1.0625 / 0.5625 bytes a value against float16's 2)
make it? For L in {4k, 32k, 128k}, B in {1, 16}, GQA 32/8, head_dim 128, float16, bfloat16, q8_0 and q4_0
storage, each (L, B) point's kinds timed back to back:
- correctness first: sequence 0 of every config against a float32 CuPy reference over the stored values
  (quantized rows dequantized: streamattn.kv.storage.dequantize);
- the launches the backend makes (decode, merge) are captured once and replayed, so host-side Python
  does not enter the timing; a spin kernel holds the GPU while the replays are queued;
- median over >= 50 launches, each between two CUDA events, rotating over enough cache copies that
  each launch starts with a cold L2;
- achieved GB/s = K+V bytes read (2 * L * kv_heads * row bytes * B) / time, and its % of the copy
  bandwidth ((read + written bytes) / time of a large cudaMemcpy D2D);
- per point, each kind's tok/s against float16's (issue 28 asks q8_0 >= 1.7x float16 at L = 32k).
Prints two tables, writes JSON. Needs CuPy and a CUDA device; no network.

Usage: python benchmarks/gpu_decode.py [--json out/gpu_decode.json] [--launches 60] [--lengths ...] [--batches ...]
    [--dtypes float16 bfloat16 q8_0 q4_0]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from streamattn.kv.backends import gpu, gpu_plan  # noqa: E402
from streamattn.kv.reference import TOLERANCE  # noqa: E402
from streamattn.kv.spec import BLOCK_BYTES, QBLOCK, QUANTIZED, row_width  # noqa: E402
from streamattn.kv.storage import dequantize  # noqa: E402

DTYPES = ("float16", "bfloat16", "q8_0", "q4_0")
# q8_0 / q4_0 block scales are drawn as c * (|N(0, 1)| + 1/2): stored values of about unit size, as the
# float kinds' N(0, 1) values (an int8 times ~1/64, a nibble minus 8 times ~1/4)
QUANT_SCALE = {"q8_0": 1 / 64, "q4_0": 1 / 4}

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def fill(cp, shape, dtype: str):
    """Random storage of ``dtype`` for a cache [batch, kv_heads, slots, head_dim], one sequence at a time:
    normal values as float16 or bfloat16 (uint16 bits), or uint8 rows of q8_0 / q4_0 blocks with random
    quants and float16 scales of :data:`QUANT_SCALE` (written on the device: no host quantizer)."""
    if dtype in QUANTIZED:
        batch, heads, slots, head_dim = shape
        nb, nbytes = head_dim // QBLOCK, BLOCK_BYTES[dtype]
        out = cp.empty((batch, heads, slots, nb * nbytes), cp.uint8)
        for b in range(batch):
            blocks = cp.random.randint(0, 256, size=(heads, slots, nb, nbytes), dtype=cp.uint8)
            d = cp.abs(cp.random.standard_normal((heads, slots, nb, 1), dtype=cp.float32)) + 0.5
            blocks[..., :2] = (d * QUANT_SCALE[dtype]).astype(cp.float16).view(cp.uint8)
            out[b] = blocks.reshape(heads, slots, nb * nbytes)
        return out
    out = cp.empty(shape, cp.float16 if dtype == "float16" else cp.uint16)
    for b in range(shape[0]):
        x = cp.random.standard_normal(shape[1:], dtype=cp.float32)
        if dtype == "float16":
            out[b] = x.astype(cp.float16)
        else:  # round to nearest even, keep the top 16 bits
            u = x.view(cp.uint32)
            out[b] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)
    return out


def to_float(cp, a, dtype: str, head_dim: int):
    if dtype in QUANTIZED:
        return dequantize(a, dtype, head_dim, xp=cp)
    if dtype == "float16":
        return a.astype(cp.float32)
    return (a.astype(cp.uint32) << 16).view(cp.float32)


def check(cp, q, k, v, out, lse, dtype, scale) -> float:
    """Relative error of sequence 0 against a float32 reference (causal, every key visible)."""
    group = q.shape[1] // k.shape[1]
    head_dim = q.shape[3]
    kf = cp.repeat(to_float(cp, k[0], dtype, head_dim), group, axis=0)  # [q_heads, L, d]
    vf = cp.repeat(to_float(cp, v[0], dtype, head_dim), group, axis=0)
    s = cp.einsum("hd,hld->hl", q[0, :, 0].astype(cp.float32), kf) * scale  # [q_heads, L]
    m = s.max(axis=1, keepdims=True)
    w = cp.exp(s - m)
    ref = cp.einsum("hl,hld->hd", w, vf) / w.sum(axis=1, keepdims=True)
    ref_lse = cp.log(w.sum(axis=1)) + m[:, 0]
    err = float(cp.abs(out[0, :, 0].astype(cp.float32) - ref).max() / cp.abs(ref).max())
    err_lse = float(cp.abs(lse[0, :, 0] - ref_lse).max() / cp.abs(ref_lse).max())
    return max(err, err_lse)


def copy_bandwidth(cp, nbytes: int, launches: int) -> float:
    """(read + written bytes) / median time of a D2D cudaMemcpy, in GB/s."""
    src = cp.empty(nbytes, cp.uint8)
    dst = cp.empty(nbytes, cp.uint8)
    src.fill(1)
    times = []
    for _ in range(launches):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        dst.data.copy_from_device_async(src.data, nbytes)
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    return 2 * nbytes / float(np.median(times)) / 1e9


def bench_config(cp, spin, *, length, batch, dtype, launches, l2_bytes, sm_count, q_heads, kv_heads, head_dim):
    scale = head_dim ** -0.5
    cache_bytes = 2 * batch * kv_heads * length * (row_width(dtype, head_dim) if dtype in QUANTIZED else 2 * head_dim)
    # rotate: every launch starts L2-cold (3x the L2 in copies; up to 64: q4_0 at 4k is 4.7 MB a copy)
    sets = max(2, min(64, math.ceil(3 * l2_bytes / cache_bytes)))
    lengths = np.full(batch, length)
    counts = np.ones(batch, np.int64)
    plans = []
    for i in range(sets):
        k = fill(cp, (batch, kv_heads, length, head_dim), dtype)  # [batch, kv_heads, slots, head_dim]
        v = fill(cp, (batch, kv_heads, length, head_dim), dtype)
        q = cp.random.standard_normal((batch, q_heads, 1, head_dim), dtype=cp.float32).astype(cp.float16)
        captured = []

        def capture(name, grid, block, args, captured=captured):
            captured.append((gpu.kernel(name, cp.cuda.Device().id), tuple(grid), tuple(block), tuple(args)))
            gpu.launch(name, grid, block, args)

        out, lse = gpu_plan.attend_with(cp, capture, q, k, v, lengths, counts, window=0, sinks=0, scale=scale,
                                        sm_count=sm_count)
        if i == 0:
            err = check(cp, q, k, v, out, lse, dtype, scale)
            tol = max(TOLERANCE[dtype], TOLERANCE["float16"])  # out comes back in q's dtype, float16
            if not err <= tol:
                raise AssertionError(f"decode L={length} B={batch} {dtype}: error {err:.2e} > {tol}")
        plans.append((captured, k, v, q, out, lse))
    splits = plans[0][0][0][1][0]
    for captured, *_ in plans[:2]:  # warm-up
        for fn, grid, block, args in captured:
            fn(grid, block, args)
    cp.cuda.Device().synchronize()
    events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(launches)]
    spin((1,), (1,), (np.int64(2_000_000_000 // 10),))  # ~0.1 s at 2 GHz: the queue fills meanwhile
    for i, (a, b) in enumerate(events):
        captured = plans[i % sets][0]
        a.record()
        for fn, grid, block, args in captured:
            fn(grid, block, args)
        b.record()
    events[-1][1].synchronize()
    times = [cp.cuda.get_elapsed_time(a, b) * 1e-3 for a, b in events]
    median = float(np.median(times))
    del plans
    cp.get_default_memory_pool().free_all_blocks()
    return dict(length=length, batch=batch, dtype=dtype, splits=int(splits), cache_sets=sets,
                bytes=cache_bytes, median_us=median * 1e6, min_us=min(times) * 1e6, gbps=cache_bytes / median / 1e9,
                error=err)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="out/gpu_decode.json", help="where to write the results")
    parser.add_argument("--launches", type=int, default=60, help="timed launches per config (>= 50)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072], help="cache lengths L")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="batch sizes B")
    parser.add_argument("--heads", default="32/8", help="q_heads/kv_heads")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    parser.add_argument("--copy-bytes", type=int, default=2 << 30, help="size of the D2D copy probe")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES,
                        help="K/V storage kinds, timed back to back per (L, B)")
    args = parser.parse_args(argv)
    q_heads, kv_heads = (int(x) for x in args.heads.split("/"))
    if not gpu.available():
        print("gpu_decode: no CUDA device through CuPy", file=sys.stderr)
        return 2
    import cupy as cp

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    sm_count, l2_bytes = gpu.sm_count(dev.id), int(dev.attributes["L2CacheSize"])
    spin = cp.RawKernel(_SPIN, "spin")
    started = time.time()
    copy_before = copy_bandwidth(cp, args.copy_bytes, 20)
    rows = []
    for length in args.lengths:
        for batch in args.batches:
            for dtype in args.dtypes:
                rows.append(bench_config(cp, spin, length=length, batch=batch, dtype=dtype, launches=args.launches,
                                         l2_bytes=l2_bytes, sm_count=sm_count, q_heads=q_heads,
                                         kv_heads=kv_heads, head_dim=args.head_dim))
    copy_after = copy_bandwidth(cp, args.copy_bytes, 20)
    copy_bw = max(copy_before, copy_after)
    print(f"{name}: {sm_count} SMs, L2 {l2_bytes >> 20} MiB; D2D copy {copy_before:.0f} / {copy_after:.0f} GB/s "
          f"(before / after); GQA {q_heads}/{kv_heads}, head_dim {args.head_dim}")
    print(f"{'dtype':9s} {'L':>7s} {'B':>3s} {'splits':>6s} {'median us':>10s} {'GB/s':>8s} {'% copy':>7s} {'err':>9s}")
    for r in rows:
        r["pct_of_copy"] = 100 * r["gbps"] / copy_bw
        print(f"{r['dtype']:9s} {r['length']:7d} {r['batch']:3d} {r['splits']:6d} {r['median_us']:10.1f} "
              f"{r['gbps']:8.0f} {r['pct_of_copy']:6.1f}% {r['error']:9.1e}")
    base = {(r["length"], r["batch"]): r["median_us"] for r in rows if r["dtype"] == "float16"}
    if base:
        others = [d for d in args.dtypes if d != "float16"]
        print(f"tok/s against float16, same run:\n{'L':>7s} {'B':>3s}  " + "  ".join(f"{d:>9s}" for d in others))
        for (length, batch), f16 in base.items():
            cells = []
            for d in others:
                r = next(r for r in rows if (r["length"], r["batch"], r["dtype"]) == (length, batch, d))
                r["vs_float16"] = f16 / r["median_us"]
                cells.append(f"{r['vs_float16']:8.2f}x")
            print(f"{length:7d} {batch:3d}  " + "  ".join(cells))
    result = dict(device=name, sm_count=sm_count, l2_bytes=l2_bytes, copy_gbps_before=copy_before,
                  copy_gbps_after=copy_after, copy_note=f"(read + written bytes) / median time of a {args.copy_bytes} B D2D memcpy",
                  q_heads=q_heads, kv_heads=kv_heads, head_dim=args.head_dim, launches=args.launches,
                  seconds=time.time() - started, rows=rows)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
