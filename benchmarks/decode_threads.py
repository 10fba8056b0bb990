"""A real-size model's decode step on one and two threads: tok/s against the read ceiling, and its parts.

    PYTHONPATH=. python benchmarks/decode_threads.py [--model /work/fixtures/llama-3.2-1b-q4_k_m.gguf]
        [--rounds 5] [--steps 24] [--threads 1,2] [--compare-mixed] [--parts]

Decode steps straight through ``Transformer.forward`` (no engine, so no thread chooser: each count is the
count), after a 64-token prompt, greedy, float16 cache; in one process, thread counts and variants
alternated (the order flips every round), the read ceiling probed at each count in every round
(:class:`streamattn.bench.ceiling.Ceiling`), ``/proc/loadavg`` printed before and after. The memory wall is
the ceiling over the weight bytes a step reads (every layer's matrices and the output head).

``--compare-mixed`` adds the variant ``array groups``: matrices held as row groups of different kinds (Llama's
Q4_K_M: a Q6_K v beside Q4_K q and k) routed as before the compiled layer took them, the layer as array code,
one activation quantization per group (its RMSNorm numpy's, so its logits differ from the compiled layer's in
the last bits; the variant is timed, not compared). ``--parts`` first times each matmul of a step alone (every
layer's, cycled so that the weights come from memory) at each count, and an empty parallel region.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from numba import njit, prange

from streamattn.bench.ceiling import Ceiling
from streamattn.gguf.loader import load_gguf
from streamattn.models import array_ops, compiled
from streamattn.models.transformer import Transformer
from streamattn.quant import matmul as qm
from streamattn.runtime.threads import set_threads

_PIECES, _MATRIX = array_ops._int_pieces, compiled._matrix


def _route(variant: str, tf) -> None:
    """Route row groups of mixed kinds as ``variant`` says ("current" or "array groups")."""
    old = variant == "array groups"
    array_ops._int_pieces = (lambda w: False) if old else _PIECES
    compiled._matrix = (lambda w, plan: None if isinstance(w, tuple) else _MATRIX(w, plan)) if old else _MATRIX
    tf._compiled = None                                    # bound again under the routing


def _nbytes(w) -> int:
    if isinstance(w, tuple):
        return sum(map(_nbytes, w))
    return w.nbytes


def weight_bytes(tf) -> int:
    return sum(_nbytes(getattr(lw, n)) for lw in tf.layers for n in ("wqkv", "wo", "wgu", "wdown")) + \
        _nbytes(tf.output)


def regions(tf) -> str:
    """The matmuls' parallel regions of a two-thread decode step through the compiled layers: one a matrix
    (row groups of mixed kinds: one over all its groups, split by bytes), against one a row group (as
    before, and as the array code's ``Matmuls.pieces`` still runs them). A matrix of one kind: Numba's
    static schedule, half of its interleaved groups a thread; of mixed kinds: half of its bytes a thread,
    cut at an interleaved group (the kinds' groups differ in bytes, so not half the groups)."""
    mats = [getattr(lw, n) for lw in tf.layers for n in ("wqkv", "wo", "wgu", "wdown")] + [tf.output]
    groups = lambda w: w.qs.shape[0]                                     # noqa: E731
    per = ["+".join(str(groups(p)) for p in w) for w in mats[:4 * 2] if isinstance(w, tuple)]
    by_group = sum(len(w) if isinstance(w, tuple) else 1 for w in mats)
    return (f"matmul regions a step: {len(mats)} one a matrix, {by_group} one a row group; interleaved groups "
            f"of the mixed matrices of layers 0-1: {', '.join(per)}")


def decode(tf, steps: int) -> tuple:
    """Seconds of each of ``steps`` greedy decode steps after a 64-token prompt, and the calling thread's CPU
    seconds of each (on one thread the step's work without the time the host took the CPU away)."""
    caches = tf.new_caches(batch=1, max_chunk=64, dtype="float16")
    tf.forward((np.arange(64)[None] * 7 + 3) % 5000, caches)
    ts, cpu, tok = [], [], 11
    for _ in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        logits = tf.forward(np.array([[tok]]), caches, last_only=True)
        ts.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
        tok = int(logits[0].argmax())
    return ts, cpu


@njit(parallel=True)
def _empty_region(a):
    for i in prange(a.shape[0]):
        a[i] += 1.0


def parts(tf, counts, rounds: int) -> None:
    """Each matmul of a step alone (median over rounds of every layer's, cycled), per thread count."""
    c, rng = tf.config, np.random.default_rng(0)
    flat = lambda w: list(w) if isinstance(w, tuple) else [w]  # noqa: E731
    modes = {"wqkv": qm.NORM, "wo": qm.PLAIN, "wgu": qm.NORM, "wdown": qm.SILU}
    calls, sizes = {}, {}
    for name, mode in modes.items():
        ws = [p for lw in tf.layers for p in flat(getattr(lw, name))]
        sizes[name] = sum(_nbytes(getattr(lw, name)) for lw in tf.layers) / c.n_layers
        calls[name] = (mode, ws, c.n_layers)
    calls["head"], sizes["head"] = (qm.NORM, [tf.output], 1), _nbytes(tf.output)
    res, ea = {}, np.zeros(2)
    for r in range(rounds):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            set_threads(n)
            for name, (mode, ws, per) in calls.items():
                x = rng.standard_normal((1, ws[0].shape[1] * (2 if mode == qm.SILU else 1)), dtype=np.float32)
                nw = np.ones(x.shape[1], np.float32)
                for w in ws[:1]:
                    tf.matmuls._fused(mode, x, nw, 1e-5, w)                     # compiled, bound
                t = time.perf_counter()
                for w in ws:
                    tf.matmuls._fused(mode, x, nw, 1e-5, w)
                res.setdefault((name, n), []).append((time.perf_counter() - t) / per)
            _empty_region(ea)
            t = time.perf_counter()
            for _ in range(1000):
                _empty_region(ea)
            res.setdefault(("empty", n), []).append((time.perf_counter() - t) / 1000)
    for n in counts:
        total = 0.0
        for name in calls:
            s = statistics.median(res[name, n])
            total += s * (1 if name == "head" else c.n_layers)
            print(f"  {n} thr {name:6s} {sizes[name] / 1e6:7.2f} MB {s * 1e3:7.3f} ms "
                  f"{sizes[name] / s / 1e9:5.1f} GB/s")
        print(f"  {n} thr all matmuls of a step {total * 1e3:.1f} ms ({weight_bytes(tf) / total / 1e9:.1f} GB/s); "
              f"an empty parallel region {statistics.median(res['empty', n]) * 1e6:.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/work/fixtures/llama-3.2-1b-q4_k_m.gguf")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--compare-mixed", action="store_true")
    ap.add_argument("--parts", action="store_true")
    args = ap.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    tf = Transformer(load_gguf(args.model, tokenizer=False))
    wbytes = weight_bytes(tf)
    variants = ["current"] + (["array groups"] if args.compare_mixed else [])
    print(f"{args.model}: {wbytes / 1e6:.1f} MB of weights a step; load {open('/proc/loadavg').read().strip()}")
    print(regions(tf))
    if args.parts:
        parts(tf, counts, args.rounds)
    for n in counts:                                        # warm-up: every variant compiled at every count
        set_threads(n)
        for v in variants:
            _route(v, tf)
            decode(tf, 2)
    ceiling, res, loads = Ceiling(256 << 20), {}, [open("/proc/loadavg").read().split()[:3]]
    for r in range(args.rounds):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            set_threads(n)
            res.setdefault(("ceiling", n), []).append(ceiling.probe())
            for v in (variants if r % 2 == 0 else variants[::-1]):
                _route(v, tf)
                ts, cpu = decode(tf, args.steps)
                res.setdefault((v, n), []).append(len(ts) / sum(ts))
                res.setdefault(("cpu", v, n), []).append(statistics.median(cpu))
        loads.append(open("/proc/loadavg").read().split()[:3])
        print(f"round {r}: " + ", ".join(f"{k[0]} t{k[1]} {x[-1]:.1f}" for k, x in res.items() if len(k) == 2)
              + f"; load {loads[-1]}", flush=True)
    _route("current", tf)
    for n in counts:
        gbps = statistics.median(res["ceiling", n])
        wall = gbps * 1e9 / wbytes
        print(f"{n} thread(s): ceiling {gbps:.1f} GB/s, wall {wall:.1f} tok/s; " + "; ".join(
            f"{v} {statistics.median(res[v, n]):.1f} tok/s ({100 * statistics.median(res[v, n]) / wall:.0f}%; runs "
            + ", ".join(f"{x:.1f}" for x in res[v, n])
            + f"; main thread's CPU {1e3 * statistics.median(res['cpu', v, n]):.1f} ms a step)" for v in variants))
    print(f"load average {loads[0]} -> {loads[-1]}")


if __name__ == "__main__":
    main()
