"""The Python (and numpy glue) of one decode step: issue 13's "Python overhead per token" figure.

    PYTHONPATH=. python benchmarks/python_overhead.py [--model smollm2-135m] [--steps 300] [--array-layers]

Times ``Transformer.forward`` of one token (1 thread, float16 cache, packed weights) twice in one process:
as it runs, and with every compiled call it makes replaced by a stub: the compiled layers
(streamattn.models.compiled) by a compiled function that does nothing (so Numba's dispatch of their
arguments still counts), and what the array layers and the logits call (the matmul drivers, the cache
write + attention, the heads/RoPE kernel) by stubs that return a ready array of the right shape. What the
second takes is what a step spends outside compiled code, with its data hot. ``--array-layers`` runs every
layer as array code (the path before the compiled layers). Medians of single steps.
"""

import argparse
import statistics
import time

import numpy as np

from streamattn.runtime.threads import set_threads


def _median_step(tf, caches, tok, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        tf.forward(tok, caches, last_only=True)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--array-layers", action="store_true", help="run every layer as array code (no compiled layers)")
    args = ap.parse_args()
    set_threads(1)
    from streamattn.kv.backends import cpu
    from numba import njit
    from streamattn.models import compiled, heads_kernel
    from streamattn.quant import matmul as qmatmul
    from streamattn.gguf.hub import resolve_model
    from streamattn.gguf.loader import load_gguf
    from streamattn.models.transformer import Transformer
    tf = Transformer(load_gguf(resolve_model(args.model, quiet=True)))
    tf.compile_layers = not args.array_layers
    c = tf.config
    caches = tf.new_caches(max_chunk=16, dtype="float16")
    tf.forward(np.array([[1, 2, 3]]), caches, last_only=True)           # compiled and warm
    tok = np.array([[4]])
    real = _median_step(tf, caches, tok, min(args.steps, 100))

    outs = {}

    def driver(mode, x, nw, eps, xq, xd, xs, xc, qs, scale, minv, out):
        n = qs.shape[0] * qmatmul.LANES
        return outs.setdefault((x.shape[0], n), np.zeros((x.shape[0], n), np.float32))
    o = np.zeros((1, c.n_heads, 1, c.head_dim), np.float32)
    lse = np.zeros((1, c.n_heads, 1), np.float32)
    kv = np.zeros((1, c.n_kv_heads, 1, c.head_dim), np.float32)

    class Stubbed(qmatmul.Matmuls):
        def drivers(self, w):
            return driver, driver
    tf.matmuls = Stubbed(tf.plan)                         # the model's matmul table, every driver a stub
    cpu.write_attend = lambda *a: (-1, o, lse, True)
    heads_kernel.heads_rope_alloc = lambda *a: (o, kv, kv)
    compiled.run_layer = njit(lambda x, w, at: True)          # what a call costs to enter, no work
    glue = _median_step(tf, caches, tok, args.steps)
    print(f"{c.name}: one decode step {real * 1e3:.2f} ms; with every compiled call stubbed "
          f"(Python and numpy glue) {glue * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
