"""Gemma-3: metadata -> :class:`~streamattn.models.config.ModelConfig`, and its layer's tensors.

The llama block plus a per-head RMSNorm of q and k, norms after attention and after the MLP, a
GELU(tanh)-gated MLP, the embedding scaled by sqrt(d_model), and five sliding-window layers for every
global one. Rows are not permuted: RoPE rotates the two halves of each head ("neox" style). Norm weights
are stored already shifted (1 + w), so every RMSNorm is a plain ``x * w``. The file carries neither the
sliding-window pattern nor a chat template, and older files not the local RoPE base (newer converters
write ``gemma3.rope.freq_base_swa``): llama.cpp hard-codes base 1e4 on local layers and one global layer
in every 6; so do we (the constants below; docs/DESIGN.md §16).
"""

from __future__ import annotations

import math

from gguf.constants import MODEL_TENSOR as T, Keys

from streamattn.models.config import Architecture, ModelConfig, common_fields

ROPE_BASE_LOCAL = 10_000.0
GLOBAL_EVERY = 6          # layers 5, 11, 17, ... are global; the others slide


def config(md) -> ModelConfig:
    """``md``: a :class:`streamattn.gguf.metadata.Metadata` of a gemma3 file."""
    c = common_fields(md)
    n, window = c["n_layers"], md.integer(Keys.Attention.SLIDING_WINDOW)
    windows = tuple(None if (i + 1) % GLOBAL_EVERY == 0 else window for i in range(n))
    return ModelConfig(**c, rope_base=md.real(Keys.Rope.FREQ_BASE, 1_000_000.0),
                       rope_base_local=md.real(Keys.Rope.FREQ_BASE_SWA, ROPE_BASE_LOCAL), rope_style="neox", layer_windows=windows,
                       embed_scale=math.sqrt(c["d_model"]), activation="gelu_tanh", qk_norm=True,
                       post_norms=True)


GEMMA3 = Architecture(
    name="gemma3", config=config,
    layer=dict(attn_norm=T.ATTN_NORM, wqkv=(T.ATTN_Q, T.ATTN_K, T.ATTN_V), wo=T.ATTN_OUT,
               ffn_norm=T.FFN_NORM, wgu=(T.FFN_GATE, T.FFN_UP), wdown=T.FFN_DOWN,
               qk_norm=(T.ATTN_Q_NORM, T.ATTN_K_NORM), post_attn_norm=T.ATTN_POST_NORM,
               post_ffw_norm=T.FFN_POST_NORM))
