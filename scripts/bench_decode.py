"""End-to-end decode speed on SmolLM2-135M and where a decode step's time goes.

    PYTHONPATH=. python scripts/bench_decode.py [--tokens 256] [--repeats 3] [--model PATH]
                                                [--weights quant|f32|both]

Greedy decode of N new tokens after a short prompt (EOS ignored, so every run decodes N tokens), with
the packed GGUF weights ("quant", the default) or dequantized float32 weights ("f32"); "both" loads the
two and alternates their runs in this one process. The read-bandwidth ceiling is probed right beside
each run (docs/PERF.md). The breakdown replays one decode step's parts at the final cache length: all weight matmuls
(incl. the lm_head), all layers' attention calls, the sampler; the rest of the measured step is Python
and elementwise work (norms, RoPE, activations, reshapes).
"""

import argparse
import statistics
import sys
import time

import numpy as np

from streamattn.bench.ceiling import Ceiling
from streamattn.engine.generate import Generator
from streamattn.gguf.loader import load_gguf
from streamattn.gguf.hub import resolve_model
from streamattn.models.array_ops import linear
from streamattn.models.transformer import Transformer
from streamattn.engine.sampling import SamplingParams, sample
from streamattn.runtime.threads import set_threads
from streamattn.text.tokenizer import Tokenizer
from streamattn import attend


def best_of(fn, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", default="The history of Rome")
    ap.add_argument("--threads", type=int, default=1, help="OpenBLAS + Numba threads (streamattn/runtime/threads.py)")
    ap.add_argument("--weights", choices=("quant", "f32", "both"), default="quant")
    args = ap.parse_args()
    set_threads(args.threads)
    path = resolve_model(args.model, quiet=True)
    kinds = ("quant", "f32") if args.weights == "both" else (args.weights,)
    gens = {}
    for kind in kinds:
        m = load_gguf(path, weights=kind)
        tf, tok = Transformer(m), Tokenizer.from_metadata(m.metadata)
        gens[kind] = Generator(tf, tok, prefill_chunk=16)
        list(gens[kind].stream(args.prompt, max_tokens=16, ignore_eos=True))    # warm-up (JIT, caches)
    ceiling = Ceiling(256 << 20)
    rates, ceils, steps = {k: [] for k in kinds}, [], {k: [] for k in kinds}
    for _ in range(args.repeats):
        ceils.append(ceiling.probe())
        for kind, gen in gens.items():                                           # alternated
            list(gen.stream(args.prompt, max_tokens=args.tokens, ignore_eos=True))
            st = gen.stats.decode_steps_s
            rates[kind].append(len(st) / sum(st))
            steps[kind].append(statistics.median(st))
    print(f"threads {args.threads}; ceiling probes {', '.join(f'{x:.0f}' for x in ceils)} GB/s")
    for kind, gen in gens.items():
        tf = gen.model
        c = tf.config
        wbytes = sum(_nbytes(a) for lw in tf.layers for a in (lw.wqkv, lw.wo, lw.wgu, lw.wdown)) + _nbytes(tf.output)
        print(f"[{kind}] model {c.name}: {c.n_layers} layers, weight bytes read per token {wbytes / 1e6:.0f} MB")
        print(f"[{kind}] decode {args.tokens} tokens after {len(tok.encode(args.prompt))} prompt tokens: "
              f"{statistics.median(rates[kind]):.1f} tok/s (runs: {', '.join(f'{r:.1f}' for r in rates[kind])})")
        breakdown(tf, gen, statistics.median(steps[kind]), wbytes, ceiling, kind)
    return 0


def _nbytes(w):
    return sum(p.nbytes for p in w) if isinstance(w, tuple) else w.nbytes


def breakdown(tf, gen, step, wbytes, ceiling, kind):
    """Print where one decode step of ``step`` seconds goes, at the caches' final length."""
    c = tf.config
    x = np.random.default_rng(0).standard_normal((1, c.d_model)).astype(np.float32)
    a = np.random.default_rng(1).standard_normal((1, c.q_dim)).astype(np.float32)
    h = np.random.default_rng(2).standard_normal((1, c.d_ff)).astype(np.float32)

    def matmuls():
        for lw in tf.layers:
            linear(np, x, lw.wqkv, tf.matmuls)
            linear(np, a, lw.wo, tf.matmuls)
            linear(np, x, lw.wgu, tf.matmuls)
            linear(np, h, lw.wdown, tf.matmuls)
        linear(np, x, tf.output, tf.matmuls)

    q = np.random.default_rng(3).standard_normal((1, c.n_heads, 1, c.head_dim)).astype(np.float32)

    def attention():
        for cache in gen.caches:
            attend(q, cache, backend="cpu", scale=c.attn_scale)

    logits = np.random.default_rng(4).standard_normal(c.vocab_size).astype(np.float32)
    rng = np.random.default_rng(0)
    t_mm = best_of(matmuls, 20)
    t_att = best_of(attention, 20)
    t_smp = best_of(lambda: sample(logits, SamplingParams(), rng, []), 50)
    rest = step - t_mm - t_att - t_smp
    L = int(gen.caches[0].lengths[0])
    print(f"[{kind}] one decode step (median) {step * 1e3:.2f} ms at length {L}:")
    for name, t in ((f"weight matmuls ({c.n_layers} layers + lm_head)", t_mm),
                    (f"attention ({c.n_layers} layers, L={L})", t_att),
                    ("sampling (greedy)", t_smp), ("python + elementwise (rest)", rest)):
        print(f"  {name:40s} {t * 1e3:7.2f} ms  {100 * t / step:5.1f}%")
    print(f"  matmul bandwidth {wbytes / t_mm / 1e9:.1f} GB/s (ceiling probe {ceiling.probe():.0f} GB/s)")


if __name__ == "__main__":
    sys.exit(main())
