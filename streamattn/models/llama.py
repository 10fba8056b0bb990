"""The llama family (llama, SmolLM2, ...): metadata -> :class:`~streamattn.models.config.ModelConfig`, and
its layer's tensors.

Pre-norm blocks with a SiLU-gated MLP, one RoPE base, every layer global, or (files with
``llama.attention.sliding_window``) every layer sliding with that window, as HF's Mistral. llama.cpp's
converter does not write Mistral v0.1's window (4096): its files run global, as in llama.cpp, which is
exact up to 4096 positions; later Mistral models have no window. llama.cpp's converter stores the
``attn_q``/``attn_k`` rows permuted so that RoPE rotates *adjacent* pairs (2i, 2i+1) of each head
("interleaved", llama.cpp's ROPE_TYPE_NORM). We keep that order and rotate adjacent pairs; q·k is
unchanged by a permutation applied to both, so the cache and attention never need to know (docs/DESIGN.md
§16).

RoPE scaling: linear and YaRN (``llama.rope.scaling.*``, YaRN as llama.cpp runs it: docs/DESIGN.md §21)
and Llama-3.x's, which llama.cpp's converter precomputes into ``rope_freqs.weight``: one divisor per
frequency (1 for the high frequencies, ``factor`` for the low ones, a smooth blend between), as ggml's
rope ``freq_factors``. All are applied by the transformer
(:func:`streamattn.models.rope.inverse_frequencies`); any other scaling is refused by name.
"""

from __future__ import annotations

from gguf.constants import MODEL_TENSOR as T, Keys

from streamattn.models.config import OUTPUT, ROPE_FREQS, Architecture, ModelConfig, common_fields, optional_window


def config(md) -> ModelConfig:
    """``md``: a :class:`streamattn.gguf.metadata.Metadata` of a llama file."""
    c = common_fields(md, yarn=True)
    base = md.real(Keys.Rope.FREQ_BASE, 10_000.0)
    return ModelConfig(**c, rope_base=base, rope_base_local=base, rope_style="interleaved",
                       layer_windows=(optional_window(md),) * c["n_layers"], embed_scale=1.0, activation="silu",
                       qk_norm=False, post_norms=False)


LLAMA = Architecture(
    name="llama", config=config,
    layer=dict(attn_norm=T.ATTN_NORM, wqkv=(T.ATTN_Q, T.ATTN_K, T.ATTN_V), wo=T.ATTN_OUT,
               ffn_norm=T.FFN_NORM, wgu=(T.FFN_GATE, T.FFN_UP), wdown=T.FFN_DOWN),
    optional=(OUTPUT, ROPE_FREQS))
