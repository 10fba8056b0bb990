"""Tiny seeded HF transformers models and our own GGUF writer for them (tests/test_hf_architectures.py).

The writer follows llama.cpp's convert_hf_to_gguf.py for the conventions a GGUF file carries: tensor
names from gguf's own HF -> GGUF table (``gguf.get_tensor_name_map``); llama's attn_q / attn_k rows
permuted per head so that RoPE pairs adjacent rows (the converter's ``LlamaModel.permute``; Qwen's rows
are not permuted); Llama-3.x RoPE scaling stored as ``rope_freqs.weight``, one divisor per frequency
(the converter's ``generate_extra_tensors``), Phi-3's longrope as ``rope_factors_{long,short}.weight`` and
``rope.scaling.attn_factor`` (its Phi3MiniModel), YaRN as ``rope.scaling.{type,factor,original_context_length}``;
Q8_0 matrices through ``gguf.quants.quantize``.
"""

from __future__ import annotations

import math

import numpy as np

#: HF model classes and GGUF architectures of the families built here.
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM"),
            "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM")}


def hf_model(arch: str, *, seed: int = 0, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
             head_dim: int | None = None, ffn: int = 256, vocab: int = 320, rope: dict | None = None,
             tied: bool = False, **extra):
    """A float32 HF causal LM of family ``arch`` with seeded random weights of a size that gives logits a
    wide spread (matrices ~ N(0, 1/in), norm weights 1 + N(0, 0.1²) (Gemma's, stored as w - 1: N(0, 0.1²)),
    biases N(0, 0.1²)), in eval mode."""
    import torch
    import transformers
    cfg_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[arch])
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
              max_position_embeddings=256, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
              rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    if head_dim is not None:
        kw["head_dim"] = head_dim
    kw.update(extra)                 # e.g. Phi-3's sliding_window
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((arch not in ("gemma2", "gemma3")) + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    model.config._attn_implementation = "eager"
    return model.eval()


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for llama attn_q/attn_k: per head, rows (i, i + hd/2) adjacent."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The converter's ``rope_freqs`` for HF rope parameters of type llama3: float32 [head_dim/2]."""
    base, factor = rope["rope_theta"], rope["factor"]
    lo, hi, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def write_gguf(model, path, *, quant: str | None = None, extra_kv: dict | None = None,
               drop_tensors: tuple = (), extra_tensors: dict | None = None) -> str:
    """Write an HF model made by :func:`hf_model` as GGUF: float32 tensors, or the matrices (2-D, columns a
    multiple of 32) as ``quant`` (e.g. "Q8_0"). ``extra_kv``: more metadata {key: value} (str, float, int);
    ``drop_tensors``: GGUF tensor names left out; ``extra_tensors``: {GGUF name: float32 array} added."""
    import gguf
    cfg = model.config
    arch = {"gemma3_text": "gemma3", "mistral": "llama"}.get(cfg.model_type, cfg.model_type)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    if arch == "gemma3":             # per layer type; the file holds the global one (local: 1e4, fixed)
        assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
        rope = rope["full_attention"]
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":             # what the converter's Gemma2Model writes
        w.add_sliding_window(cfg.sliding_window)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if arch == "phi3":                                   # the converter writes 0 for none
        w.add_sliding_window(cfg.sliding_window or 0)
    if cfg.model_type == "mistral" and cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    types = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32, int: gguf.GGUFValueType.UINT32}
    for k, v in (extra_kv or {}).items():
        w.add_key_value(k, v, types[type(v)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    tensors = {}
    for hf_name, p in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        a = p.detach().numpy().astype(np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            a = llama_permute(a, cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            a = a + 1                # the converter stores Gemma's norms as 1 + w
        tensors[name] = a
    if rope.get("rope_type") == "llama3":
        tensors[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"] = llama3_rope_factors(rope, head_dim)
    if rope.get("rope_type") == "yarn":              # the converter's TextModel.set_gguf_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "longrope":          # the converter's Phi3MiniModel
        orig = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        for t, key in ((gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, "long_factor"),
                       (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, "short_factor")):
            tensors[gguf.TENSOR_NAMES[t] + ".weight"] = np.array(rope[key], np.float32)
    tensors.update(extra_tensors or {})
    for name, a in tensors.items():
        if name in drop_tensors:
            continue
        if quant is not None and a.ndim == 2 and a.shape[1] % 32 == 0:
            qt = gguf.GGMLQuantizationType[quant]
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
