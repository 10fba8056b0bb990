"""Qwen2 (Qwen2, Qwen2.5): metadata -> :class:`~streamattn.models.config.ModelConfig`, and its layer's tensors.

The llama block with a bias on the q, k and v projections (none on the output projection), RoPE over the
two halves of each head ("neox": llama.cpp's converter does not permute Qwen's rows), the base from
``qwen2.rope.freq_base``. Small models tie the output matrix to the embedding (no ``output.weight``).
The file carries no sliding window: HF's ``use_sliding_window`` is off in every released Qwen2 model,
and llama.cpp runs every layer global too. YaRN (``qwen2.rope.scaling.type = "yarn"``: Qwen2.5 past 32k
positions) is run as llama.cpp runs it (docs/DESIGN.md §21).
"""

from __future__ import annotations

from gguf.constants import MODEL_TENSOR as T, Keys

from streamattn.models.config import Architecture, Bias, ModelConfig, common_fields


def config(md) -> ModelConfig:
    """``md``: a :class:`streamattn.gguf.metadata.Metadata` of a qwen2 file."""
    c = common_fields(md, yarn=True)
    base = md.real(Keys.Rope.FREQ_BASE, 10_000.0)
    return ModelConfig(**c, rope_base=base, rope_base_local=base, rope_style="neox",
                       layer_windows=(None,) * c["n_layers"], embed_scale=1.0, activation="silu",
                       qk_norm=False, post_norms=False)


QWEN2 = Architecture(
    name="qwen2", config=config,
    layer=dict(attn_norm=T.ATTN_NORM, wqkv=(T.ATTN_Q, T.ATTN_K, T.ATTN_V),
               bqkv=(Bias(T.ATTN_Q), Bias(T.ATTN_K), Bias(T.ATTN_V)), wo=T.ATTN_OUT,
               ffn_norm=T.FFN_NORM, wgu=(T.FFN_GATE, T.FFN_UP), wdown=T.FFN_DOWN))
