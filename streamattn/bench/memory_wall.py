"""How far a decode step is from the memory wall: the bytes it must read over the read bandwidth.

    python -m streamattn.bench.memory_wall profile MODEL.gguf     # JSON: weight bytes, K/V bytes per key
    python -m streamattn.bench.memory_wall probe --threads 2      # JSON: read GB/s (streamattn.bench.ceiling)

A decode step must read, at the least:

- every packed weight matrix of the file once, as stored (the GGUF's own block bytes), and every norm
  vector; of ``token_embd`` one row (the token's embedding), except where the model has no
  ``output.weight`` (tied embeddings: SmolLM2, Gemma-3), whose logits read the whole of ``token_embd``
  as well: then the matrix once plus that row;
- the K/V the new token attends to: per layer 2 (K and V) × kv_heads × head_dim × 2 bytes (float16,
  llama.cpp's default ``type_k``/``type_v``) per visible key, and a token at position p (0-based) sees
  p + 1 keys, or min(p + 1, n_c) in a layer with a sliding window of n_c keys.

Any engine that runs the same file with float16 K/V has these bytes to move per token; ``bytes × tok/s /
read GB/s`` is the share of the memory wall it reaches (100% = memory-bound). The ceiling is a probe
of the same machine at the same thread count (:class:`streamattn.bench.ceiling.Ceiling`: the best of
its readers with 1..threads threads), taken in the same run: these hosts' bandwidth moves by 2× between
probes minutes apart (docs/DESIGN.md §30).

The arithmetic (:func:`step_bytes`, :func:`decode_bytes`) is standard library only, and the module
imports streamattn only inside :func:`profile` and :func:`probe`: benchmarks/peer_llamacpp.py loads it by
path and keeps Numba out of its own process (see resolve_path there), running those two in children.
"""

from __future__ import annotations

import argparse
import json
import sys

KV_BYTES = 2                # float16 K and V: llama.cpp's default cache type, ours with --cache-dtype float16


def profile(path: str, *, kv_bytes: int = KV_BYTES) -> dict:
    """What a decode step of the model in ``path`` reads, from the file's header and tensor table.

    Returns
    -------
    dict
        ``weights``: bytes of weights read per step (see the module docstring); ``kv_per_key``: per layer,
        bytes of K plus V per visible key; ``windows``: per layer, the sliding window n_c or None (full
        attention); ``tied``: whether the logits read ``token_embd``; ``file_bytes``: all tensor bytes.
    """
    from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

    from streamattn.gguf.loader import config_from_metadata, open_container
    from streamattn.gguf.metadata import read_metadata
    container = open_container(str(path))
    config = config_from_metadata(read_metadata(container, str(path)), str(path))
    embd, output = TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight", TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight"
    sizes = {t.name: int(t.n_bytes) for t in container.tensors}
    if embd not in sizes:
        raise ValueError(f"{path}: no {embd} tensor")
    rows = {t.name: int(t.shape[-1]) for t in container.tensors}       # ggml order: rows are the last dim
    tied = output not in sizes
    weights = sum(n for name, n in sizes.items() if name != embd) + sizes[embd] // rows[embd]
    if tied:
        weights += sizes[embd]
    kv = 2 * config.n_kv_heads * config.head_dim * kv_bytes
    return {"weights": weights, "kv_per_key": [kv] * config.n_layers, "windows": list(config.layer_windows),
            "tied": tied, "file_bytes": sum(sizes.values())}


def step_bytes(prof: dict, position: int) -> int:
    """Bytes the decode step of the token at ``position`` (0-based) reads: weights plus visible K/V."""
    if position < 0:
        raise ValueError(f"position must be >= 0 (got {position})")
    return prof["weights"] + sum(kv * (position + 1 if w is None else min(position + 1, w))
                                 for kv, w in zip(prof["kv_per_key"], prof["windows"]))


def decode_bytes(prof: dict, prompt_tokens: int, steps: int) -> float:
    """Mean bytes per step over a timed decode of ``steps`` steps after a prompt of ``prompt_tokens``:
    the first token comes out of the prefill, so the steps feed positions prompt_tokens ..
    prompt_tokens + steps - 1 (the engines' ``decode_steps`` = new tokens - 1)."""
    if prompt_tokens < 1 or steps < 1:
        raise ValueError(f"prompt_tokens and steps must be >= 1 (got {prompt_tokens}, {steps})")
    return sum(step_bytes(prof, p) for p in range(prompt_tokens, prompt_tokens + steps)) / steps


def share_of_wall(prof: dict, prompt_tokens: int, steps: int, tok_s: float, gbps: float) -> float:
    """Percent of the memory wall a decode at ``tok_s`` reaches: bytes per step × tok/s over ``gbps``."""
    return 100.0 * decode_bytes(prof, prompt_tokens, steps) * tok_s / (gbps * 1e9)


def probe(threads: int, nbytes: int = 1 << 30, repeats: int = 3) -> dict:
    """Read bandwidth with at most ``threads`` Numba threads (:class:`~streamattn.bench.ceiling.Ceiling`):
    ``{"threads", "gbps": best, "readers": {"<reader> t<threads>": GB/s}}``."""
    import numba

    from streamattn.bench.ceiling import Ceiling
    if not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"threads must be in 1..{numba.config.NUMBA_NUM_THREADS} (got {threads}); "
                         "set NUMBA_NUM_THREADS for more")
    numba.set_num_threads(threads)
    ceiling = Ceiling(nbytes)
    best = ceiling.probe(repeats)
    return {"threads": threads, "gbps": best,
            "readers": {f"{reader} t{t}": round(v, 2) for (reader, t), v in sorted(ceiling.last.items())}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("profile", help="weight and K/V bytes of a decode step of a GGUF model")
    a.add_argument("path")
    b = sub.add_parser("probe", help="read bandwidth at a thread count")
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--mb", type=int, default=1024, help="probe buffer, MiB (well above the last-level cache)")
    b.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    out = profile(args.path) if args.what == "profile" else probe(args.threads, args.mb << 20, args.repeats)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
