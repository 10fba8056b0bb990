"""K-quants held in their files' bytes against the layouts before them: bytes per weight and decode GEMV time.

    PYTHONPATH=. python benchmarks/kquant_layout.py [--runs 7] [--types Q6_K,Q4_K] [--routes host,avx2] [--tag a]

Llama-3.2-1B's shapes: the tied output head, 128256 x 2048 Q6_K, and an ffn_down, 2048 x 8192 Q4_K. Each is
random valid blocks (gguf-py cannot quantize K-quants): random quant and sub-block scale bytes, float16
super-block scales uniform in [0.001, 0.021]. ``pack`` gives the new layout ("q6k", "q4k": the file's bytes
interleaved by rows); :func:`streamattn.quant.weights.widen_k` gives the layout before ("q8" / "q4": the
sub-block scales multiplied out into float planes, float32 where float16 is not exact: these values).

Per type and route ("host": this CPU's lanes and integer dot product; "avx2": 8 lanes and ``vpmaddubsw``,
what an AVX2-only CPU runs): the bytes each layout holds (``QWeight.nbytes`` over the padded rows, exact)
against the file's; then one-thread ``x @ W.T`` of one activation row (a decode step), the two layouts
alternated ``--runs`` times (which goes first alternates too; the last-level cache flushed before each
call, as the rest of a decode step would), after a check that both give the same bits
and match ``gguf.quants.dequantize`` on a few rows. Prints medians, GB/s of each layout's own bytes, a
one-thread read ceiling probed before and after, and the load average (the host is shared); writes
benchmarks/results/kquant_layout_<date><tag>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import gguf
import numba
import numpy as np
from gguf.quants import dequantize

from streamattn.bench.ceiling import Ceiling
from streamattn.quant import kernels
from streamattn.quant.matmul import qmatmul, quantize_activations
from streamattn.quant.weights import pack, widen_k

OUT = Path(__file__).resolve().parent / "results"
#: type -> (rows, cols, bytes per 256-column block, offsets of its float16 super-block scales)
SHAPES = {"Q6_K": (128256, 2048, 210, (208,)), "Q4_K": (2048, 8192, 144, (0, 2))}


def blocks(type_name: str, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes per row]: random blocks of ``type_name`` with finite, small float16 scales."""
    rows, cols, size, at = SHAPES[type_name]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for a in at:
        d = (rng.random((rows, cols // 256)) * 0.02 + 0.001).astype(np.float16)
        b[..., a:a + 2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    return b.reshape(rows, -1)


def per_weight(w, cols: int) -> float:
    """Bytes held per weight, over the rows the planes hold (the last group's padding included)."""
    return w.nbytes / (w.qs.shape[0] * w.lanes * cols)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--types", default="Q6_K,Q4_K")
    ap.add_argument("--routes", default="host,avx2")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    args = ap.parse_args(argv)
    numba.set_num_threads(1)
    ceiling = Ceiling()
    record = {"date": datetime.date.today().isoformat(), "runs": args.runs, "load_before": os.getloadavg(),
              "cpu": {"lanes": kernels.LANES, "vnni": kernels.LANES_VNNI}, "results": []}
    print(f"load average {record['load_before']}; this CPU: {kernels.LANES} lanes, VNNI {kernels.LANES_VNNI}")
    for type_name in args.types.split(","):
        rows, cols, size, _ = SHAPES[type_name]
        raw = blocks(type_name)
        qt = gguf.GGMLQuantizationType[type_name]
        check_rows = np.array([0, 1, rows // 2, rows - 1])
        want = dequantize(raw[check_rows], qt).astype(np.float64)
        x = np.random.default_rng(1).standard_normal((1, cols)).astype(np.float32)
        acts = quantize_activations(x)
        for route in args.routes.split(","):
            lanes, vnni = (kernels.LANES, kernels.LANES_VNNI) if route == "host" else (8, False)
            new = pack("w", type_name, raw, (rows, cols), lanes=lanes)
            old = widen_k(new)
            layouts = {"new": new, "old": old}

            def call(w):
                return qmatmul(x, w, acts=acts, parallel=False, group_rows=1, vnni=vnni)
            outs = {name: call(w) for name, w in layouts.items()}
            assert np.array_equal(outs["new"], outs["old"]), "the layouts disagree"
            xq, xd, *_ = acts
            xdq = (xq.reshape(1, -1, 32) * xd[:, :, None].astype(np.float64)).reshape(1, cols)
            np.testing.assert_allclose(outs["new"][0, check_rows], (xdq @ want.T)[0], rtol=1e-4,
                                       atol=1e-4 * np.abs(want).max())
            times = {name: [] for name in layouts}
            probe = ceiling.probe(1)
            for run in range(args.runs):
                for name in (("new", "old") if run % 2 == 0 else ("old", "new")):
                    ceiling.evict()               # from memory, as in a decode step (Q4_K's 9-13 MB fit the L3)
                    t = time.perf_counter()
                    call(layouts[name])
                    times[name].append(time.perf_counter() - t)
            probe = max(probe, ceiling.probe(1))
            res = {"type": type_name, "shape": [rows, cols], "route": route, "lanes": lanes, "vnni": vnni,
                   "file_bytes_per_weight": size / 256, "ceiling_gbps_1thread": probe}
            for name, w in layouts.items():
                med = statistics.median(times[name])
                res[name] = {"kind": w.kind, "bytes_per_weight": per_weight(w, cols), "nbytes": w.nbytes,
                             "median_ms": med * 1e3, "times_ms": [t * 1e3 for t in times[name]],
                             "gbps": w.nbytes / med / 1e9}
            record["results"].append(res)
            print(f"{type_name} {rows}x{cols} {route} (lanes {lanes}, vnni {vnni}): file {size / 256:.4f} B/w; "
                  + "; ".join(f"{n} {res[n]['kind']} {res[n]['bytes_per_weight']:.4f} B/w "
                              f"{res[n]['median_ms']:.2f} ms ({res[n]['gbps']:.1f} GB/s)" for n in layouts)
                  + f"; new/old time {res['new']['median_ms'] / res['old']['median_ms']:.3f}; "
                  f"1-thread ceiling {probe:.1f} GB/s")
            del new, old, layouts
    record["load_after"] = os.getloadavg()
    print(f"load average {record['load_after']}")
    OUT.mkdir(exist_ok=True)
    path = OUT / f"kquant_layout_{record['date']}{args.tag}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
