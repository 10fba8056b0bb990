"""Random-weight GGUFs with the exact shapes, tensor-type mix and real vocabularies of released models.

    PYTHONPATH=. python scripts/make_real_size_gguf.py --models llama-3.2-1b --types q4_k_m --out /work/fixtures
    PYTHONPATH=. python scripts/make_real_size_gguf.py --models all --types all --out /work/fixtures

What a load, a decode step or a peer benchmark costs depends on the sizes, the tensor types and the
vocabulary, not on the weights' values; the real files are not on PyPI. Each fixture holds:

- the model's shapes (:data:`MODELS`, from each model's published config.json), its tied or untied output,
  Qwen2's q/k/v biases, and for Llama-3.x a ``rope_freqs.weight`` of the llama3 RoPE divisors computed as
  llama.cpp's converter computes them (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors);
- the tensor types of llama.cpp's ``llama-quantize`` for the file type (src/llama-quant.cpp,
  llama_tensor_get_type): Q4_K_M = Q4_K, with Q6_K for the output matrix (the token embedding when it is
  tied) and for ``attn_v`` / ``ffn_down`` of layer i of n where ``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2``
  (use_more_bits); Q4_0 = Q4_0 with a Q6_K output matrix; Q8_0 = Q8_0 everywhere; norms, biases and RoPE
  divisors F32;
- the real tokenizer: every ``tokenizer.*`` key of llama.cpp's vocabulary-only GGUF of the family
  (``models/ggml-vocab-llama-bpe.gguf``, ``ggml-vocab-qwen2.gguf`` in the llama.cpp tree vendored by the
  llama-cpp-python sdist; fetched with pip as scripts/install_llamacpp_native.sh does, into the same
  ``.peer/llamacpp-native/sdist``), padded to the model's embedding rows with ``[PADi]`` tokens of type
  UNUSED as llama.cpp's converter pads (get_vocab_base).

Weights are random block bytes with small float16 block scales (finite, |w| below ~0.05), seeded by
``--seed`` and the tensor's name, generated and written one tensor at a time in row chunks (gguf's
GGUFWriter: the tensor table first, then each tensor's data), so even the 8B file never sits in memory.
``--tiny`` writes the same code path at toy sizes (4 layers, d_model 256; the tests use it).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import tarfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SDIST_VERSION = "0.3.36"          # scripts/install_llamacpp_native.sh's default llama-cpp-python


@dataclass(frozen=True)
class ModelSpec:
    """One released model's sizes (its config.json) and the llama.cpp vocabulary file of its family."""

    arch: str                     # "llama" | "qwen2"
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int                    # embedding rows (config.json vocab_size)
    tied: bool                    # no output.weight: the embedding is the output matrix
    rope_base: float
    rms_eps: float
    context: int
    vocab_file: str               # llama.cpp models/ggml-vocab-<...>.gguf
    llama3_rope: tuple | None = None   # (factor, low_freq_factor, high_freq_factor, original context)


MODELS = {
    "llama-3.2-1b": ModelSpec("llama", "Llama-3.2-1B (random weights)", 16, 2048, 32, 8, 64, 8192, 128256, True,
                              500000.0, 1e-5, 131072, "ggml-vocab-llama-bpe.gguf", (32.0, 1.0, 4.0, 8192)),
    "llama-3.2-3b": ModelSpec("llama", "Llama-3.2-3B (random weights)", 28, 3072, 24, 8, 128, 8192, 128256, True,
                              500000.0, 1e-5, 131072, "ggml-vocab-llama-bpe.gguf", (32.0, 1.0, 4.0, 8192)),
    "llama-3.1-8b": ModelSpec("llama", "Llama-3.1-8B (random weights)", 32, 4096, 32, 8, 128, 14336, 128256, False,
                              500000.0, 1e-5, 131072, "ggml-vocab-llama-bpe.gguf", (8.0, 1.0, 4.0, 8192)),
    "qwen2.5-1.5b": ModelSpec("qwen2", "Qwen2.5-1.5B (random weights)", 28, 1536, 12, 2, 128, 8960, 151936, True,
                              1000000.0, 1e-6, 32768, "ggml-vocab-qwen2.gguf"),
    "qwen2.5-7b": ModelSpec("qwen2", "Qwen2.5-7B (random weights)", 28, 3584, 28, 4, 128, 18944, 152064, False,
                            1000000.0, 1e-6, 32768, "ggml-vocab-qwen2.gguf"),
}

#: --types -> (llama_ftype number for general.file_type, the default matrix type)
FILE_TYPES = {"q4_k_m": (15, "Q4_K"), "q4_0": (2, "Q4_0"), "q8_0": (7, "Q8_0")}

#: Bytes of one block, where its float16 scale(s) sit, and the scale written there: |w| stays below ~0.05
#: (Q4_K: d * 63 * 15 + dmin * 63; Q6_K: d * 128 * 32; Q4_0: d * 8; Q8_0: d * 128).
BLOCKS = {"Q4_K": (144, (0, 2), 4e-5), "Q6_K": (210, (208,), 1e-5), "Q4_0": (18, (0,), 5e-3),
          "Q8_0": (34, (0,), 3e-4)}
BLOCK_COLS = {"Q4_K": 256, "Q6_K": 256, "Q4_0": 32, "Q8_0": 32}


def tiny(spec: ModelSpec, vocab: int) -> ModelSpec:
    """The same model kind at toy sizes: 4 layers (attn_v / ffn_down of layers 2 and 3 Q6_K under Q4_K_M),
    d_model 256, 4 heads of 64 (2 KV), d_ff 512, ``vocab`` embedding rows (the vocabulary file's count)."""
    return replace(spec, name=spec.name + " tiny", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64,
                   d_ff=512, vocab=vocab)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get Q6_K under Q4_K_M (C integer division)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_plan(spec: ModelSpec, file_type: str) -> list:
    """[(name, numpy shape [out, in] or [n], GGML type name)] in the order written."""
    default = FILE_TYPES[file_type][1]
    big = "Q6_K" if file_type in ("q4_k_m", "q4_0") else default        # the output matrix
    d, hd, nl = spec.d_model, spec.head_dim, spec.n_layers
    q, kv = spec.n_heads * hd, spec.n_kv_heads * hd
    plan = [("token_embd.weight", (spec.vocab, d), big if spec.tied else default)]
    if spec.llama3_rope:
        plan.append(("rope_freqs.weight", (hd // 2,), "F32"))
    for i in range(nl):
        more = "Q6_K" if file_type == "q4_k_m" and use_more_bits(i, nl) else default
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (d,), "F32"), (b + "attn_q.weight", (q, d), default),
                 (b + "attn_k.weight", (kv, d), default), (b + "attn_v.weight", (kv, d), more)]
        if spec.arch == "qwen2":
            plan += [(b + "attn_q.bias", (q,), "F32"), (b + "attn_k.bias", (kv,), "F32"),
                     (b + "attn_v.bias", (kv,), "F32")]
        plan += [(b + "attn_output.weight", (d, q), default), (b + "ffn_norm.weight", (d,), "F32"),
                 (b + "ffn_gate.weight", (spec.d_ff, d), default), (b + "ffn_up.weight", (spec.d_ff, d), default),
                 (b + "ffn_down.weight", (d, spec.d_ff), more)]
    plan.append(("output_norm.weight", (d,), "F32"))
    if not spec.tied:
        plan.append(("output.weight", (spec.vocab, d), big))
    return plan


def llama3_rope_divisors(spec: ModelSpec) -> np.ndarray:
    """Per-frequency divisors of Llama-3.x RoPE scaling, as llama.cpp's converter stores them in
    rope_freqs.weight: 1 for wavelengths under original/high, ``factor`` above original/low, a smooth
    blend between (the formula of HF's ``_compute_llama3_parameters``)."""
    factor, low, high, orig = spec.llama3_rope
    freqs = 1.0 / spec.rope_base ** (np.arange(0, spec.head_dim, 2, dtype=np.float32) / spec.head_dim)
    out = []
    for f in freqs.astype(np.float64):
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")])


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator, chunk_bytes: int = 1 << 26) -> np.ndarray:
    """uint8 [rows, row bytes]: random block bytes, each block's float16 scale field(s) set to the type's
    small scale times a factor in [0.5, 1] (rounded to float16), so every value is finite and small."""
    size, at, scale = BLOCKS[qtype]
    nb = cols // BLOCK_COLS[qtype]
    out = np.empty((rows, nb * size), np.uint8)
    step = max(1, chunk_bytes // (nb * size))
    for r in range(0, rows, step):
        part = out[r:r + step]
        part[...] = np.frombuffer(rng.bytes(part.size), np.uint8).reshape(part.shape)
        blocks = part.reshape(-1, size)
        for a in at:
            d = (scale * rng.uniform(0.5, 1.0, blocks.shape[0])).astype("<f2")
            blocks[:, a:a + 2] = d.view(np.uint8).reshape(-1, 2)
    return out


def float_tensor(name: str, shape: tuple, spec: ModelSpec, rng: np.random.Generator) -> np.ndarray:
    if name == "rope_freqs.weight":
        return llama3_rope_divisors(spec)
    if name.endswith("norm.weight"):
        return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    return (0.02 * rng.standard_normal(shape)).astype(np.float32)            # biases


# ------------------------------------------------------------------------------------------ vocabulary
def vocab_path(file_name: str, sdist_dir: Path | None = None) -> Path:
    """llama.cpp's ``models/<file_name>`` taken out of the llama-cpp-python sdist (downloaded with pip into
    ``.peer/llamacpp-native/sdist`` as scripts/install_llamacpp_native.sh does, when it is not there yet)
    into ``.peer/llamacpp-native/vocab/``; an unpacked source tree of that script is used as it is."""
    sys.path.insert(0, str(ROOT / "streamattn" / "bench"))
    try:
        from peer_home import peer_home         # standard library only; a worktree uses its main checkout's
    finally:
        sys.path.pop(0)
    home = peer_home(ROOT) / "llamacpp-native"
    unpacked = home / "src" / "models" / file_name
    if unpacked.is_file():
        return unpacked
    out = home / "vocab" / file_name
    if out.is_file():
        return out
    sdist_dir = sdist_dir or home / "sdist"
    tarball = sdist_dir / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if not tarball.is_file():
        import subprocess
        print(f"downloading the llama-cpp-python {SDIST_VERSION} sdist with pip into {sdist_dir}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={SDIST_VERSION}", "-d", str(sdist_dir)], check=True)
    member = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/models/{file_name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tf:
        src = tf.extractfile(member)
        if src is None:
            raise FileNotFoundError(f"{member} is not in {tarball}")
        tmp = out.with_suffix(".part")
        tmp.write_bytes(src.read())
        tmp.replace(out)
    return out


def vocab_rows(path: Path) -> int:
    """How many tokens a GGUF's ``tokenizer.ggml.tokens`` holds."""
    from streamattn.gguf.reader import GGUFFile
    return len(GGUFFile(str(path)).metadata["tokenizer.ggml.tokens"])


def tokenizer_keys(path: Path, n_rows: int) -> list:
    """[(key, value, GGUFValueType, element type or None)] of every ``tokenizer.*`` key of a GGUF, the
    token list (and its types, and scores when present) padded to ``n_rows`` with [PADi] UNUSED tokens."""
    from gguf import GGUFValueType
    from streamattn.gguf.reader import GGUFFile
    f = GGUFFile(str(path))
    md, types = dict(f.metadata), f.types
    del f
    tokens = md["tokenizer.ggml.tokens"]
    if len(tokens) > n_rows:
        raise ValueError(f"{path.name} holds {len(tokens)} tokens, more than the model's {n_rows} embedding rows")
    pad = range(len(tokens), n_rows)
    md["tokenizer.ggml.tokens"] = tokens + [f"[PAD{i}]" for i in pad]
    if "tokenizer.ggml.token_type" in md:
        md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + [5] * len(pad)     # UNUSED
    if "tokenizer.ggml.scores" in md:
        md["tokenizer.ggml.scores"] = md["tokenizer.ggml.scores"] + [0.0] * len(pad)
    elem = {"tokenizer.ggml.tokens": GGUFValueType.STRING, "tokenizer.ggml.merges": GGUFValueType.STRING,
            "tokenizer.ggml.token_type": GGUFValueType.INT32, "tokenizer.ggml.scores": GGUFValueType.FLOAT32}
    out = []
    for key, value in md.items():
        if key.startswith("tokenizer."):
            vtype = GGUFValueType(types[key])
            out.append((key, value, vtype, elem.get(key) if vtype == GGUFValueType.ARRAY else None))
    return out


# ------------------------------------------------------------------------------------------ writing
def write_model(spec: ModelSpec, file_type: str, out: Path, vocab: Path, seed: int = 0, log=None) -> dict:
    """Write one fixture; returns {tensor name: GGML type name}."""
    import gguf
    from gguf import GGUFValueType, Keys
    plan = tensor_plan(spec, file_type)
    w = gguf.GGUFWriter(str(out), spec.arch)
    a = spec.arch
    w.add_name(spec.name)
    w.add_file_type(FILE_TYPES[file_type][0])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_uint32(Keys.LLM.CONTEXT_LENGTH.format(arch=a), spec.context)
    w.add_uint32(Keys.LLM.EMBEDDING_LENGTH.format(arch=a), spec.d_model)
    w.add_uint32(Keys.LLM.BLOCK_COUNT.format(arch=a), spec.n_layers)
    w.add_uint32(Keys.LLM.FEED_FORWARD_LENGTH.format(arch=a), spec.d_ff)
    w.add_uint32(Keys.Attention.HEAD_COUNT.format(arch=a), spec.n_heads)
    w.add_uint32(Keys.Attention.HEAD_COUNT_KV.format(arch=a), spec.n_kv_heads)
    w.add_float32(Keys.Rope.FREQ_BASE.format(arch=a), spec.rope_base)
    w.add_float32(Keys.Attention.LAYERNORM_RMS_EPS.format(arch=a), spec.rms_eps)
    if a == "llama":                         # what llama.cpp's converter writes for Llama-3.x
        w.add_uint32(Keys.Attention.KEY_LENGTH.format(arch=a), spec.head_dim)
        w.add_uint32(Keys.Attention.VALUE_LENGTH.format(arch=a), spec.head_dim)
        w.add_uint32(Keys.Rope.DIMENSION_COUNT.format(arch=a), spec.head_dim)
        w.add_uint32(Keys.LLM.VOCAB_SIZE.format(arch=a), spec.vocab)
    for key, value, vtype, elem in tokenizer_keys(vocab, spec.vocab):
        w.add_key_value(key, value, vtype, sub_type=elem)
    for name, shape, qtype in plan:
        if qtype == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            size = BLOCKS[qtype][0] * shape[1] // BLOCK_COLS[qtype]
            w.add_tensor_info(name, (shape[0], size), np.dtype(np.uint8), shape[0] * size,
                              raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, qtype in plan:
        rng = _rng(seed, name)
        if qtype == "F32":
            data = float_tensor(name, shape, spec, rng)
        else:
            data = random_blocks(qtype, shape[0], shape[1], rng)
        w.write_tensor_data(data)
        del data
        if log:
            log(name, qtype)
    w.close()
    return {name: qtype for name, _, qtype in plan}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b"], help=f"{', '.join(MODELS)} or all")
    ap.add_argument("--types", nargs="+", default=["q4_k_m"], help=f"{', '.join(FILE_TYPES)} or all")
    ap.add_argument("--out", type=Path, required=True, help="folder for <model>-<type>.gguf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=Path, default=None,
                    help="a GGUF whose tokenizer.* keys to use instead of llama.cpp's vocabulary file")
    ap.add_argument("--sdist-dir", type=Path, default=None, help="where the llama-cpp-python sdist is (or goes)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes, same code path (4 layers, d_model 256)")
    args = ap.parse_args(argv)
    models = list(MODELS) if args.models == ["all"] else args.models
    types = list(FILE_TYPES) if args.types == ["all"] else args.types
    for bad, known in ((set(models) - set(MODELS), MODELS), (set(types) - set(FILE_TYPES), FILE_TYPES)):
        if bad:
            ap.error(f"unknown {sorted(bad)[0]!r}; known: {', '.join(known)}, or all")
    args.out.mkdir(parents=True, exist_ok=True)
    for m in models:
        vocab = args.vocab or vocab_path(MODELS[m].vocab_file, args.sdist_dir)
        spec = tiny(MODELS[m], vocab_rows(vocab)) if args.tiny else MODELS[m]
        for t in types:
            path = args.out / f"{m}{'-tiny' if args.tiny else ''}-{t}.gguf"
            t0 = time.perf_counter()
            write_model(spec, t, path, vocab, args.seed)
            print(f"{path}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
