"""A whole model on the GPU: the packed path against the CPU float32 path, then decode speed at real sizes.

Questions: does a model whose matrices stay the file's blocks on the device (``--device gpu``) give the CPU
float32 path's logits and greedy ids, and how close does its decode step come to the device's copy
bandwidth at the shapes people run?

1. ``check``: a 4-layer Llama-shaped GGUF written here (tests/_model_util.write_tiny_gguf) with one packed
   type per tensor kind (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K); the GPU model (weights="gguf", packed
   GEMV kernels, float32 sums) against the CPU path over float32 dequantized weights: the largest logit
   difference relative to the largest logit (limit 1e-3) and greedy ids over ``--steps`` (32) steps, the
   GPU model fed its own ids from a device argmax (never read back nor uploaded), as the timed runs are.
2. ``speed``: GGUFs with the exact shapes and tensor-type mix of Llama-3.2-1B and Llama-3.1-8B Q4_K_M
   (scripts/make_real_size_gguf.py), written on the machine with a placeholder vocabulary (a decode step's
   cost does not depend on the tokens' strings; no network is needed). Decode tok/s at batch 1 and 16 after
   a short prompt, median of ``--repeats`` timed runs of ``--tokens`` steps each (the device synchronized
   around each run), and the weight bytes one step reads (every matrix but the embedding, whose B rows are
   gathered) over the step time as a % of a device-to-device copy's bandwidth measured in the same run.

Prints a table and writes JSON. Needs CuPy and a CUDA device; with ``--fake`` it runs the check on the
tests' fake CuPy (the CUDA emulation, no device: wiring only, minutes a step at real sizes, so ``speed`` is
skipped there).

Usage: python benchmarks/gpu_model.py [--json out/gpu_model.json] [--models 1b 8b] [--batches 1 16]
    [--steps 32] [--tokens 32] [--repeats 3] [--dir /tmp/gpu_model] [--skip-speed] [--graphs]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))                  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "tests"))        # the fixture writer of the tests (write_tiny_gguf)
sys.path.insert(0, str(ROOT / "scripts"))      # make_real_size_gguf

#: one packed type per tensor kind: all seven GEMV types in one model
CHECK_TYPES = dict(attn_q="Q4_K", attn_k="Q6_K", attn_v="Q8_0", attn_output="Q5_K", ffn_gate="Q4_0",
                   ffn_up="Q4_1", ffn_down="Q6_K", token_embd="Q5_0")
SPEED_MODELS = {"1b": "llama-3.2-1b", "8b": "llama-3.1-8b"}
PLACEHOLDER_TOKENS = 256


#: the check's model: 4 layers on a device; 1 layer of the smallest shapes the types allow on the emulation
CHECK_SHAPES = {False: dict(n_layers=4, d_model=512, n_heads=4, n_kv_heads=2, head_dim=128, d_ff=1024, vocab=512),
                True: dict(n_layers=1, d_model=256, n_heads=2, n_kv_heads=1, head_dim=128, d_ff=256, vocab=48)}


def check(cp, path: Path, steps: int, small: bool = False, graphs: bool = False) -> dict:
    """The GPU model against the CPU float32 path on a GGUF written at ``path``: worst relative logit error
    and whether ``steps`` greedy ids agree; ``graphs``: the GPU model's decode steps as CUDA graphs
    (``Transformer.cuda_graphs``)."""
    from _model_util import write_tiny_gguf
    from streamattn.gguf.loader import load_gguf
    from streamattn.models.transformer import Transformer

    shape = CHECK_SHAPES[small]
    write_tiny_gguf(str(path), arch="llama", quant=CHECK_TYPES, matrix_scale=0.05, **shape)
    cpu = Transformer(load_gguf(str(path), weights="f32", tokenizer=False))
    gpu = Transformer(load_gguf(str(path), weights="gguf", tokenizer=False)).to(cp)
    gpu.cuda_graphs = graphs
    cc = cpu.new_caches(batch=1, max_chunk=8)
    gc = gpu.new_caches(batch=1, max_chunk=8)
    prompt = [i % shape["vocab"] for i in (3, 17, 5, 40, 9, 301, 77, 12)]
    fa = fb = np.array([prompt])
    worst, a_ids, b_ids = 0.0, [], []
    for _ in range(steps):
        a = cpu.forward(fa, cc, backend="cpu", last_only=True)[0]
        logits = gpu.forward(fb, gc, backend="gpu", last_only=True)                     # [1, vocab] device
        b = logits[0].get() if hasattr(logits, "get") else np.asarray(logits[0])
        worst = max(worst, float(np.abs(a - b).max() / np.abs(a).max()))
        a_ids.append(int(a.argmax()))
        b_ids.append(int(b.argmax()))
        fa, fb = np.array([[a_ids[-1]]]), logits.argmax(axis=-1).reshape(1, 1)   # the GPU's ids stay there
    return {"steps": steps, "worst_rel_err": worst, "ids_equal": a_ids == b_ids, "device_ids": True,
            "ok": worst <= 1e-3 and a_ids == b_ids}


def placeholder_vocab(path: Path) -> Path:
    """A vocabulary-only GGUF of PLACEHOLDER_TOKENS tokens (make_real_size_gguf pads it to the model's rows)."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(PLACEHOLDER_TOKENS)])
    w.add_token_types([1] * PLACEHOLDER_TOKENS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def step_bytes(model) -> int:
    """Weight bytes one decode step reads: every packed or float matrix but the token embedding."""
    from streamattn.kv.backends.gpu_gemv import GGUFMatrix
    total = 0
    for lw in model.layers:
        for v in vars(lw).values():
            for p in v if isinstance(v, tuple) else (v,):
                if isinstance(p, GGUFMatrix):
                    total += int(p.blocks.nbytes)
                elif hasattr(p, "nbytes") and getattr(p, "ndim", 0) >= 1:
                    total += int(p.nbytes)
    out = model.output
    total += int(out.blocks.nbytes) if isinstance(out, GGUFMatrix) else int(getattr(out, "nbytes", 0))
    return total


def speed(cp, path: Path, batches: list, tokens: int, repeats: int, copy_gbs: float, graphs: bool = False) -> list:
    from streamattn.gguf.loader import load_gguf
    from streamattn.models.transformer import Transformer

    t0 = time.perf_counter()
    model = Transformer(load_gguf(str(path), weights="gguf", tokenizer=False)).to(cp)
    model.cuda_graphs = graphs
    cp.cuda.Device().synchronize()
    load_s = time.perf_counter() - t0
    nbytes = step_bytes(model)
    rows = []
    for batch in batches:
        times = []
        for _ in range(repeats + 1):                       # the first run compiles and warms: not timed
            caches = model.new_caches(batch=batch, max_chunk=16)
            rng = np.random.default_rng(0)
            model.forward(rng.integers(0, 256, (batch, 16)), caches, backend="gpu", last_only=True)
            nxt = rng.integers(0, 256, (batch, 1))
            cp.cuda.Device().synchronize()
            t = time.perf_counter()
            for _ in range(tokens):
                logits = model.forward(nxt, caches, backend="gpu", last_only=True)
                nxt = logits.argmax(axis=-1).reshape(batch, 1)   # greedy on the device: ids not read back
            cp.cuda.Device().synchronize()
            times.append((time.perf_counter() - t) / tokens)
            del caches
        step = statistics.median(times[1:])
        gbs = nbytes / step / 1e9
        rows.append({"model": path.stem, "batch": batch, "graphs": graphs, "step_ms": 1e3 * step,
                     "tok_s": batch / step, "weight_bytes": nbytes, "weights_gb_s": gbs,
                     "pct_copy": 100 * gbs / copy_gbs,
                     "load_s": load_s, "runs": times[1:]})
        print(f"{path.stem:24s} B={batch:<3d} {1e3 * step:8.2f} ms/step {batch / step:9.1f} tok/s "
              f"{gbs:7.1f} GB/s {100 * gbs / copy_gbs:5.1f}% of copy", flush=True)
    del model
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--models", nargs="+", default=list(SPEED_MODELS), choices=list(SPEED_MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--steps", type=int, default=32, help="greedy steps of the check")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per timed run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where the fixtures are written (default: a temp dir)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--graphs", action="store_true", help="decode steps as CUDA graphs (Transformer.cuda_graphs)")
    ap.add_argument("--fake", action="store_true", help="the tests' fake CuPy (no device): the check only")
    args = ap.parse_args(argv)
    if args.fake:
        import cupy as cp                       # tests/fake_cupy on PYTHONPATH
        args.skip_speed = True
    else:
        from streamattn.kv.backends import gpu
        if not gpu.available():
            print("gpu_model: no CUDA device through CuPy", file=sys.stderr)
            return 2
        import cupy as cp
    work = args.dir or Path(tempfile.mkdtemp(prefix="gpu_model_"))
    work.mkdir(parents=True, exist_ok=True)
    result = {"check": check(cp, work / "check.gguf", args.steps, small=args.fake, graphs=args.graphs)}
    c = result["check"]
    print(f"check: {c['steps']} greedy steps (ids from a device argmax), ids equal {c['ids_equal']}, "
          f"worst logit error {c['worst_rel_err']:.2e} of the largest (limit 1e-3): "
          f"{'ok' if c['ok'] else 'FAILED'}", flush=True)
    if not args.skip_speed:
        from gpu_decode import copy_bandwidth
        from make_real_size_gguf import MODELS, write_model
        copy_gbs = copy_bandwidth(cp, 1 << 30, 20)
        result["copy_gb_s"] = copy_gbs
        print(f"device-to-device copy: {copy_gbs:.0f} GB/s", flush=True)
        vocab = placeholder_vocab(work / "vocab.gguf")
        result["speed"] = []
        for m in args.models:
            path = work / f"{SPEED_MODELS[m]}-q4_k_m.gguf"
            if not path.exists():
                t = time.perf_counter()
                write_model(MODELS[SPEED_MODELS[m]], "q4_k_m", path, vocab)
                print(f"{path.name}: written in {time.perf_counter() - t:.0f} s", flush=True)
            result["speed"] += speed(cp, path, args.batches, args.tokens, args.repeats, copy_gbs, args.graphs)
            path.unlink()                       # (the 8B file is 4.9 GB)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
