"""Qwen3 (dense): metadata -> :class:`~streamattn.models.config.ModelConfig`, and its layer's tensors.

The llama block without biases, plus a per-head RMSNorm of q and k before RoPE (weights stored plain,
eps the model's ``layer_norm_rms_epsilon``: the same op as Gemma-3's QK-norm), an explicit head size
(``qwen3.attention.key_length``, e.g. 128 with d_model 1024 and 16 heads), and RoPE over the two halves of
each head ("neox", rows not permuted). Small models tie the output matrix to the embedding. YaRN past
32k positions as llama.cpp runs it (docs/DESIGN.md §21).
"""

from __future__ import annotations

from gguf.constants import MODEL_TENSOR as T, Keys

from streamattn.models.config import Architecture, ModelConfig, common_fields


def config(md) -> ModelConfig:
    """``md``: a :class:`streamattn.gguf.metadata.Metadata` of a qwen3 file."""
    c = common_fields(md, yarn=True)
    base = md.real(Keys.Rope.FREQ_BASE, 10_000.0)
    return ModelConfig(**c, rope_base=base, rope_base_local=base, rope_style="neox",
                       layer_windows=(None,) * c["n_layers"], embed_scale=1.0, activation="silu",
                       qk_norm=True, post_norms=False)


QWEN3 = Architecture(
    name="qwen3", config=config,
    layer=dict(attn_norm=T.ATTN_NORM, wqkv=(T.ATTN_Q, T.ATTN_K, T.ATTN_V), wo=T.ATTN_OUT,
               ffn_norm=T.FFN_NORM, wgu=(T.FFN_GATE, T.FFN_UP), wdown=T.FFN_DOWN,
               qk_norm=(T.ATTN_Q_NORM, T.ATTN_K_NORM)))
