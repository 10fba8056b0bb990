"""Phi-3 (phi3): metadata -> :class:`~streamattn.models.config.ModelConfig`, and its layer's tensors.

The llama block with the projections stored fused, as HF's Phi3 holds them: ``attn_qkv`` (q rows, then
k, then v) and ``ffn_up`` (gate rows, then up: ``2 * feed_forward_length`` rows), which are the layer's
``wqkv`` and ``wgu`` as they are. RoPE over the two halves of each head ("neox", rows not permuted).

``phi3.attention.sliding_window`` > 0 (Phi-3-mini: 2047; the converter writes 0 for none, Phi-4) slides
every layer with that window n_c, as HF's Phi3 does; llama.cpp currently ignores it (its loader warns),
so the two differ past the window.

Long-context files (Phi-3-*-128k, Phi-3.5: su/longrope) hold two sets of per-frequency divisors,
``rope_factors_long`` and ``rope_factors_short``, and ``phi3.rope.scaling.attn_factor``, which multiplies
cos and sin. The transformer picks one set once per model, by the context it is run for (long above
``phi3.rope.scaling.original_context_length``; default: the file's ``context_length``, as llama.cpp),
never per sequence length as HF does (docs/DESIGN.md §21). Partial RoPE (Phi-4-mini,
``rope.dimension_count`` < head size) is refused by name.
"""

from __future__ import annotations

from gguf.constants import MODEL_TENSOR as T, Keys

from streamattn.models.config import (OUTPUT, ROPE_LONG, ROPE_SHORT, Architecture, ModelConfig, block_shapes,
                                      common_fields, optional_window)


def config(md) -> ModelConfig:
    """``md``: a :class:`streamattn.gguf.metadata.Metadata` of a phi3 file."""
    c = common_fields(md, longrope=True)
    window = optional_window(md)
    base = md.real(Keys.Rope.FREQ_BASE, 10_000.0)
    return ModelConfig(**c, rope_base=base, rope_base_local=base, rope_style="neox",
                       layer_windows=(window,) * c["n_layers"], embed_scale=1.0, activation="silu",
                       qk_norm=False, post_norms=False)


def shapes(c: ModelConfig) -> dict:
    """:func:`~streamattn.models.config.block_shapes` plus the fused tensors."""
    return {**block_shapes(c), T.ATTN_QKV: (c.q_dim + 2 * c.kv_dim, c.d_model), T.FFN_UP: (2 * c.d_ff, c.d_model)}


PHI3 = Architecture(
    name="phi3", config=config, shapes=shapes,
    layer=dict(attn_norm=T.ATTN_NORM, wqkv=T.ATTN_QKV, wo=T.ATTN_OUT, ffn_norm=T.FFN_NORM, wgu=T.FFN_UP,
               wdown=T.FFN_DOWN),
    optional=(OUTPUT, ROPE_LONG, ROPE_SHORT), pairs=((ROPE_LONG, ROPE_SHORT),))
