"""How much q4_0 error reaches the attention scores under each key transform? (issue 28: q4_0 K/V perplexity)

    PYTHONPATH=. python benchmarks/kv_rotation_error.py [--text out/texts/python311_tutorial_howto.txt]
        [--tokens 2048] [--out benchmarks/results/kv_rotation_error_DATE.txt]

SmolLM2's post-RoPE queries and keys of every layer over --tokens tokens of the text (float32 cache, the
attention hook), then per transform T: keys k -> q4_0(k T) T^-1, and per layer and query head the RMS
of the score error q.(k_hat - k) over all (query, key) pairs divided by the std of the scores q.k, averaged
over layers and heads (and the worst layer-head). Also the keys' relative squared error. Transforms: none;
block Walsh-Hadamard of 32 (streamattn.kv.rotation, the cache's); one Hadamard over all 64; each with fixed
random signs first; and the cache's blocks with a q4_0 scale searched per block for the least squared
error (same format, other bytes). Nothing here changes what the cache stores: it measures what would.
"""

import argparse
import datetime
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from streamattn.kv.rotation import hadamard                                        # noqa: E402
from streamattn.kv.storage import dequantize, quantize                             # noqa: E402


def collect(text_path, tokens):
    from _model_util import smollm2_path
    from streamattn.gguf.loader import load_gguf
    from streamattn.models.transformer import Transformer
    from streamattn.text.tokenizer import Tokenizer
    m = load_gguf(smollm2_path())
    tf, tok = Transformer(m), Tokenizer.from_metadata(m.metadata)
    ids = tok.encode(open(text_path).read()[:tokens * 20])[:tokens]
    caches = tf.new_caches(batch=1, max_chunk=256, dtype="float32")
    qs, ks = {}, {}

    def hook(layer, q, k, v, out):
        qs.setdefault(layer, []).append(np.asarray(q)[0])
        ks.setdefault(layer, []).append(np.asarray(k)[0])
    for s in range(0, len(ids), 256):
        tf.forward(np.array([ids[s:s + 256]]), caches, attn_hook=hook)
    return [(np.concatenate(qs[i], 1), np.concatenate(ks[i], 1)) for i in sorted(qs)]   # [Hq, L, D], [Hk, L, D]


def q4(x):
    return dequantize(quantize(x.astype(np.float32), "q4_0")[0], "q4_0", x.shape[-1])


def q4_searched(x, steps=21):
    """q4_0 blocks whose scale is xm / -8 times the factor in 0.80..1.00 of least squared error."""
    xb = x.reshape(-1, 32).astype(np.float32)
    xm = xb[np.arange(len(xb)), np.abs(xb).argmax(1)]
    best, out = None, None
    for f in np.linspace(0.80, 1.0, steps):
        d = (xm / -8.0 * f).astype(np.float16).astype(np.float32)[:, None]
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        y = (np.clip(np.floor(xb * inv + 8.5), 0, 15) - 8) * d
        e = ((y - xb) ** 2).sum(1)
        if best is None:
            best, out = e, y
        else:
            better = e < best
            best, out = np.where(better, e, best), np.where(better[:, None], y, out)
    return out.reshape(x.shape)


def sylvester(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="out/texts/python311_tutorial_howto.txt")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default=f"out/kv_rotation_error_{datetime.date.today()}.txt")
    args = ap.parse_args(argv)
    layers = collect(args.text, args.tokens)
    D = layers[0][1].shape[-1]
    signs = np.diag(np.random.default_rng(0).choice([-1.0, 1.0], D))
    cases = [("none", np.eye(D), q4), ("blocks of 32 (the cache's)", hadamard(D), q4),
             (f"one Hadamard of {D}", sylvester(D), q4), ("signs, blocks of 32", signs @ hadamard(D), q4),
             (f"signs, one of {D}", signs @ sylvester(D), q4),
             ("blocks of 32, scale searched", hadamard(D), q4_searched),
             (f"signs, one of {D}, scale searched", signs @ sylvester(D), q4_searched)]
    lines = [f"# {' '.join(sys.argv)}  ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{len(layers)} layers, {layers[0][1].shape[1]} tokens)",
             f"{'transform':36s} {'key rel sq err':>14s} {'score err/std':>13s} {'worst head':>10s}"]
    for name, T, quant in cases:
        key_err, score_err = [], []
        for q, k in layers:
            k_hat = quant(k @ T) @ T.T
            key_err.append(((k_hat - k) ** 2).sum() / (k ** 2).sum())
            group = q.shape[0] // k.shape[0]
            for h in range(q.shape[0]):
                s, s_hat = q[h] @ k[h // group].T, q[h] @ k_hat[h // group].T
                score_err.append(np.sqrt(((s_hat - s) ** 2).mean()) / s.std())
        lines.append(f"{name:36s} {np.mean(key_err):14.5f} {np.mean(score_err):13.5f} {np.max(score_err):10.4f}")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
