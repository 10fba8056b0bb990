"""GGUF metadata -> ModelConfig, and the loader's errors on bad files."""

import os
import shutil

import numpy as np
import pytest

from _model_util import gguf_reader, need_smollm2, smollm2_path, write_tiny_gguf
from streamattn.gguf.loader import config_from_metadata, load_gguf
from streamattn.gguf.metadata import ModelFileError, read_metadata
from streamattn.models.config import ModelConfig


@need_smollm2
def test_smollm2_metadata_to_config():
    md = read_metadata(gguf_reader(smollm2_path()), smollm2_path())
    c = config_from_metadata(md)
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim) == ("llama", 30, 576, 9, 3, 64)
    assert (c.d_ff, c.vocab_size, c.rope_base, c.rope_style) == (1536, 49152, 1e5, "interleaved")
    assert c.norm_eps == pytest.approx(1e-5) and c.attn_scale == pytest.approx(1 / 8)
    assert c.layer_windows == (None,) * 30 and c.embed_scale == 1.0 and not c.qk_norm
    assert md["tokenizer.chat_template"].startswith("{% for message in messages %}")


def gemma_md(**over):
    md = {"general.architecture": "gemma3", "gemma3.block_count": 18, "gemma3.embedding_length": 640,
          "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
          "gemma3.attention.key_length": 256, "gemma3.feed_forward_length": 2048,
          "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.rope.freq_base": 1e6,
          "gemma3.attention.sliding_window": 512, "gemma3.context_length": 32768,
          "tokenizer.ggml.tokens": ["x"] * 262144, "tokenizer.ggml.bos_token_id": 2,
          "tokenizer.ggml.eos_token_id": 1}
    md.update(over)
    return md


def test_gemma3_metadata_to_config():
    c = config_from_metadata(gemma_md())
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (18, 4, 1, 256, 262144)
    # five sliding layers of 512 for every global one: layers 5, 11, 17 are global
    assert [i for i, w in enumerate(c.layer_windows) if w is None] == [5, 11, 17]
    assert set(w for w in c.layer_windows if w is not None) == {512}
    assert (c.rope_base, c.rope_base_local, c.rope_style) == (1e6, 1e4, "neox")
    assert c.embed_scale == pytest.approx(np.sqrt(640)) and c.attn_scale == pytest.approx(1 / 16)
    assert c.qk_norm and c.post_norms and c.activation == "gelu_tanh"


def gemma2_md(**over):
    """Gemma-2 2B's metadata as llama.cpp's converter writes it (26 layers, 8/4 heads of 256)."""
    md = {"general.architecture": "gemma2", "gemma2.block_count": 26, "gemma2.embedding_length": 2304,
          "gemma2.attention.head_count": 8, "gemma2.attention.head_count_kv": 4,
          "gemma2.attention.key_length": 256, "gemma2.attention.value_length": 256,
          "gemma2.feed_forward_length": 9216, "gemma2.attention.layer_norm_rms_epsilon": 1e-6,
          "gemma2.attention.sliding_window": 4096, "gemma2.attn_logit_softcapping": 50.0,
          "gemma2.final_logit_softcapping": 30.0, "gemma2.context_length": 8192,
          "tokenizer.ggml.tokens": ["x"] * 256000, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}
    md.update(over)
    return md


def test_gemma2_metadata_to_config():
    c = config_from_metadata(gemma2_md())
    assert c.layer_windows == (4096, None) * 13                     # even layers slide, odd ones are global
    assert (c.attn_softcap, c.final_softcap, c.rope_base, c.rope_base_local, c.rope_style) == (
        50.0, 30.0, 1e4, 1e4, "neox")
    assert c.attn_scale == pytest.approx(1 / 16) and c.embed_scale == pytest.approx(np.sqrt(2304))
    assert c.post_norms and not c.qk_norm and c.activation == "gelu_tanh"
    # 27B (46 layers, d_model 4608, 32 heads of 128): queries scaled by 1/sqrt(4608 / 32 = 144), as llama.cpp
    big = gemma2_md(**{"gemma2.block_count": 46, "gemma2.embedding_length": 4608, "gemma2.attention.head_count": 32,
                       "gemma2.attention.head_count_kv": 16, "gemma2.attention.key_length": 128,
                       "gemma2.attention.value_length": 128})
    assert config_from_metadata(big).attn_scale == pytest.approx(1 / 12)
    # what the file leaves out takes llama.cpp's defaults; a pattern key says which layers slide
    bare = gemma2_md()
    for k in ("gemma2.attn_logit_softcapping", "gemma2.final_logit_softcapping", "gemma2.attention.sliding_window"):
        del bare[k]
    c = config_from_metadata(bare)
    assert (c.attn_softcap, c.final_softcap, c.layer_windows[0]) == (50.0, 30.0, 4096)
    c = config_from_metadata(gemma2_md(**{"gemma2.attention.sliding_window_pattern": 3}))
    assert c.layer_windows[:6] == (4096, 4096, None) * 2
    flags = [i % 4 == 0 for i in range(26)]
    c = config_from_metadata(gemma2_md(**{"gemma2.attention.sliding_window_pattern": flags}))
    assert [w is not None for w in c.layer_windows] == flags


@pytest.mark.parametrize("key, value, match", [
    ("gemma2.attn_logit_softcapping", 0.0, "key gemma2.attn_logit_softcapping must be a finite number > 0"),
    ("gemma2.final_logit_softcapping", float("inf"), "gemma2.final_logit_softcapping must be a finite number"),
    ("gemma2.attention.sliding_window_pattern", [True, False], "must be an integer or 26 booleans"),
    ("gemma2.attention.sliding_window_pattern", -1, r"must be an integer in 0\.\.26"),
    ("gemma2.expert_count", 8, "metadata key 'gemma2.expert_count' = '8' is not implemented"),
])
def test_bad_gemma2_metadata_is_refused_by_key(key, value, match):
    with pytest.raises(ModelFileError, match=match):
        config_from_metadata(gemma2_md(**{key: value}), "m.gguf")


def test_unsupported_architecture_and_missing_key():
    with pytest.raises(ModelFileError, match="architecture 'mamba' is not supported"):
        config_from_metadata({"general.architecture": "mamba"}, "m.gguf")
    md = gemma_md()
    del md["gemma3.block_count"]
    with pytest.raises(ModelFileError, match="gemma3.block_count"):
        config_from_metadata(md, "m.gguf")
    with pytest.raises(ModelFileError, match="RoPE scaling 'yarn'"):
        config_from_metadata(gemma_md(**{"gemma3.rope.scaling.type": "yarn"}), "m.gguf")


@pytest.mark.parametrize("key, value, match", [
    ("gemma3.attn_logit_softcapping", 50.0, "metadata key 'gemma3.attn_logit_softcapping' = '50.0' is not "
                                            "implemented for architecture 'gemma3'"),
    ("gemma3.final_logit_softcapping", 30.0, "'gemma3.final_logit_softcapping'"),
    ("gemma3.expert_count", 8, "'gemma3.expert_count' = '8'"),
    ("gemma3.rope.scaling.type", "longrope", r"RoPE scaling 'longrope' \(gemma3.rope.scaling.type\)"),
    ("gemma3.rope.scaling.factor", 4.0, "'gemma3.rope.scaling.factor' = 4.0 without a scaling type"),
    ("gemma3.rope.scaling.attn_factor", 1.5, "'gemma3.rope.scaling.attn_factor' = 1.5 is not supported"),
    ("gemma3.rope.dimension_count", 128, "'gemma3.rope.dimension_count' = 128 differs from the head size 256"),
    ("gemma3.attention.value_length", 128, "'gemma3.attention.value_length' = 128 differs"),
])
def test_a_key_the_architecture_does_not_implement_is_refused(key, value, match):
    """Soft-capping, experts, other RoPE variants, partial RoPE: refused by name, never run without."""
    with pytest.raises(ModelFileError, match=match):
        config_from_metadata(gemma_md(**{key: value}), "m.gguf")


def test_keys_read_without_effect_and_linear_scaling():
    c = config_from_metadata(gemma_md(**{"gemma3.rope.dimension_count": 256, "gemma3.attention.value_length": 256,
                                         "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0,
                                         "gemma3.rope.freq_base_swa": 2e4}))
    assert (c.rope_linear, c.rope_base, c.rope_base_local) == (8.0, 1e6, 2e4)


def test_config_validation():
    base = config_from_metadata(gemma_md())
    kw = {f: getattr(base, f) for f in base.__dataclass_fields__}
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig(**{**kw, "n_kv_heads": 3})
    with pytest.raises(ValueError, match="layer_windows has 2 entries"):
        ModelConfig(**{**kw, "layer_windows": (None, 4)})
    with pytest.raises(ValueError, match="rope_style"):
        ModelConfig(**{**kw, "rope_style": "other"})


def test_tiny_gguf_loads(tmp_path):
    m = load_gguf(write_tiny_gguf(tmp_path / "t.gguf"), weights="f32")
    assert m.config.arch == "gemma3" and m.config.layer_windows == (4, 4, 4, 4, 4, None)
    assert m.weights["blk.0.attn_q.weight"].shape == (64, 32)
    assert all(w.dtype == np.float32 for w in m.weights.values())
    q = load_gguf(write_tiny_gguf(tmp_path / "t.gguf"))                 # default: matrices stay packed
    assert q.weights_kind == "quant" and q.weights["blk.0.attn_q.weight"].kind == "f32"
    np.testing.assert_array_equal(q.weights["blk.0.attn_q.weight"].dequantize(), m.weights["blk.0.attn_q.weight"])
    with pytest.raises(ValueError, match="weights must be one of"):
        load_gguf(write_tiny_gguf(tmp_path / "t.gguf"), weights="q4")


def test_missing_not_gguf_truncated_corrupt(tmp_path):
    with pytest.raises(ModelFileError, match="nope.gguf: no such file"):
        load_gguf(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelFileError, match="junk.gguf: not a GGUF file"):
        load_gguf(junk)
    good = write_tiny_gguf(tmp_path / "good.gguf")
    cut = tmp_path / "cut.gguf"
    shutil.copy(good, cut)
    os.truncate(cut, os.path.getsize(good) - 1000)
    with pytest.raises(ModelFileError, match="cut.gguf: .*truncated"):
        load_gguf(cut)
    with pytest.raises(ModelFileError, match="mamba.gguf: architecture 'mamba' is not supported"):
        load_gguf(write_tiny_gguf(tmp_path / "mamba.gguf", arch="mamba"))
    with pytest.raises(ModelFileError, match="bad.gguf: tensor 'blk.2.ffn_up.weight' holds NaN"):
        load_gguf(write_tiny_gguf(tmp_path / "bad.gguf", nan_tensor="blk.2.ffn_up.weight"))


@pytest.mark.parametrize("weights", ["f32", "quant"])
@pytest.mark.parametrize("key, value", [("tokenizer.ggml.pre", "falcon3"), ("tokenizer.ggml.model", "bert")])
def test_a_refused_tokenizer_is_refused_before_tensors_are_read(tmp_path, monkeypatch, key, value, weights):
    """The tokenizer's refusal, with its own message, comes before any tensor is read (and so before the
    weights' memory): a reader of tensors that fails the test is patched in."""
    import gguf.quants
    from streamattn.gguf import loader
    from streamattn.gguf.metadata import read_metadata
    from streamattn.gguf.reader import GGUFFile
    from streamattn.text.tokenizer import Tokenizer
    path = write_tiny_gguf(tmp_path / "m.gguf", override={key: value})
    with pytest.raises(ValueError) as built:
        Tokenizer.from_metadata(read_metadata(GGUFFile(path), path))
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: pytest.fail("a tensor was read"))
    monkeypatch.setattr(loader, "pack", lambda *a: pytest.fail("a tensor was read"))
    with pytest.raises(ModelFileError) as refused:
        load_gguf(path, weights=weights)
    assert str(refused.value) == f"{path}: {built.value}" and repr(value) in str(refused.value)


# -- hostile metadata (issue 17 item 8) --------------------------------------------------------------
@pytest.mark.parametrize("key,value,match", [
    ("gemma3.block_count", 10_000_000, r"'gemma3.block_count' must be an integer in 1..4096 \(got int '10000000'\)"),
    ("gemma3.block_count", 7, r"block_count=7, the file holds tensors of 6 blocks \(missing blk.6"),
    ("gemma3.block_count", 5, r"block_count=5, the file holds tensors of 6 blocks \(extra blk.5"),
    ("gemma3.attention.head_count", 0, r"'gemma3.attention.head_count' must be an integer in 1..4096 \(got int '0'\)"),
    ("gemma3.embedding_length", "32", r"'gemma3.embedding_length' must be an integer in .* \(got str '32'\)"),
    ("gemma3.attention.layer_norm_rms_epsilon", float("nan"),
     r"gemma3.attention.layer_norm_rms_epsilon must be a finite number > 0 \(got float 'nan'\)"),
    ("gemma3.context_length", -5, r"'gemma3.context_length' must be an integer in 1..\d+ \(got int '-5'\)"),
    ("tokenizer.ggml.eos_token_id", 64, r"'tokenizer.ggml.eos_token_id' must be an integer in 0..63"),
])
def test_hostile_metadata_is_refused_by_key_before_tensors_are_read(tmp_path, monkeypatch, key, value, match):
    import gguf.quants
    path = write_tiny_gguf(tmp_path / "m.gguf", override={key: value})
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: pytest.fail("a tensor was read"))
    with pytest.raises(ModelFileError, match=rf"m.gguf: .*{match}"):
        load_gguf(path)
