"""Gemma-2: metadata -> :class:`~streamattn.models.config.ModelConfig`, and its layer's tensors.

The llama block with four sandwich norms (before and after attention, before and after the MLP), a
GELU(tanh)-gated MLP, the embedding scaled by sqrt(d_model), one RoPE base over the two halves of each
head ("neox", rows not permuted), norm weights stored already shifted (1 + w, as for Gemma-3), the output
matrix tied to the embedding, and soft-capping: every scaled attention score s becomes c * tanh(s / c)
before the mask and the softmax (``gemma2.attn_logit_softcapping``, 50 in the released models), every
logit z becomes c * tanh(z / c) (``gemma2.final_logit_softcapping``, 30). Layers alternate: even layers
slide (``gemma2.attention.sliding_window``, 4096), odd ones attend globally.

What the file does not say, we take from llama.cpp (src/models/gemma2.cpp), so that its files run as it
runs them: the caps default to 50 and 30, the window to 4096, and the pattern to 2 (one sliding layer,
then one global; an integer ``attention.sliding_window_pattern`` n makes layer i slide where
i % n < n - 1, an array of booleans names them). The query scale 1/sqrt(query_pre_attn_scalar) is not
in the file either: llama.cpp uses 1/sqrt(head_dim), except for the 46-layer model (Gemma-2 27B, whose
query_pre_attn_scalar is d_model / n_heads = 144), and so do we (docs/DESIGN.md §20).
"""

from __future__ import annotations

import math
import numbers

from gguf.constants import MODEL_TENSOR as T, Keys

from streamattn.runtime.files import ModelFileError
from streamattn.models.config import Architecture, ModelConfig, common_fields

ATTN_SOFTCAP, FINAL_SOFTCAP = 50.0, 30.0   # llama.cpp's defaults (llama-hparams.h), Gemma-2's own values
WINDOW = 4096                              # llama.cpp's n_swa default for gemma2
PATTERN = 2                                # one sliding layer, then one global
LAYERS_27B = 46                            # llama.cpp's LLM_TYPE_27B: queries scaled by d_model / n_heads


def sliding_layers(md, n_layers: int) -> tuple:
    """Per layer: does it slide? From ``{arch}.attention.sliding_window_pattern`` (an integer n: layer i
    slides where i % n < n - 1, n = 0 all; or one boolean per layer), default :data:`PATTERN`, as
    llama.cpp's ``set_swa_pattern``."""
    key = Keys.Attention.SLIDING_WINDOW_PATTERN
    pattern = md.get(key, PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != n_layers or not all(isinstance(p, bool) for p in pattern):
            raise ModelFileError(f"{md.path}: metadata key {md.key(key)!r} must be an integer or {n_layers} booleans, "
                                 f"one per layer (got {str(pattern)[:60]!r})")
        return tuple(pattern)
    if isinstance(pattern, bool) or not isinstance(pattern, numbers.Integral) or not 0 <= pattern <= n_layers:
        raise ModelFileError(f"{md.path}: metadata key {md.key(key)!r} must be an integer in 0..{n_layers} or one "
                             f"boolean per layer (got {str(pattern)[:40]!r})")
    n = int(pattern)
    return tuple(n == 0 or i % n < n - 1 for i in range(n_layers))


def config(md) -> ModelConfig:
    """``md``: a :class:`streamattn.gguf.metadata.Metadata` of a gemma2 file."""
    c = common_fields(md)
    n, window = c["n_layers"], md.integer(Keys.Attention.SLIDING_WINDOW, WINDOW)
    base = md.real(Keys.Rope.FREQ_BASE, 10_000.0)
    query_scalar = c["d_model"] // c["n_heads"] if n == LAYERS_27B else c["head_dim"]
    c["attn_scale"] = 1.0 / math.sqrt(query_scalar)
    return ModelConfig(**c, rope_base=base, rope_base_local=md.real(Keys.Rope.FREQ_BASE_SWA, base), rope_style="neox",
                       layer_windows=tuple(window if s else None for s in sliding_layers(md, n)),
                       embed_scale=math.sqrt(c["d_model"]), activation="gelu_tanh", qk_norm=False, post_norms=True,
                       attn_softcap=md.real(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, ATTN_SOFTCAP),
                       final_softcap=md.real(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, FINAL_SOFTCAP))


GEMMA2 = Architecture(
    name="gemma2", config=config,
    layer=dict(attn_norm=T.ATTN_NORM, wqkv=(T.ATTN_Q, T.ATTN_K, T.ATTN_V), wo=T.ATTN_OUT,
               ffn_norm=T.FFN_NORM, wgu=(T.FFN_GATE, T.FFN_UP), wdown=T.FFN_DOWN,
               post_attn_norm=T.ATTN_POST_NORM, post_ffw_norm=T.FFN_POST_NORM))
