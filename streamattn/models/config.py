"""What a model is, as data: :class:`ModelConfig` (its numbers and layer flags) and :class:`Architecture`
(what one architecture file declares: metadata -> config, and which GGUF tensors make each layer weight).

An architecture is one file in streamattn/models/ (``llama.py``, ``gemma3.py``) defining an
``Architecture`` and one entry in :data:`streamattn.models.architectures.ARCHITECTURES`. Tensor names come
from gguf.constants (``MODEL_TENSOR`` / ``TENSOR_NAMES``), metadata keys from its ``Keys``; the loader and
the transformer read both through the architecture and never branch on its name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from gguf.constants import MODEL_TENSOR, TENSOR_NAMES, Keys

ROPE_STYLES = ("interleaved", "neox")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, read from GGUF metadata.

    Parameters
    ----------
    arch : str
        The architecture (a key of :data:`streamattn.models.architectures.ARCHITECTURES`).
    n_layers, d_model, n_heads, n_kv_heads, head_dim, d_ff, vocab_size : int
    norm_eps : float
        RMSNorm epsilon.
    rope_base : float
        RoPE base of global (full-attention) layers.
    rope_base_local : float
        RoPE base of sliding-window layers (equal to ``rope_base`` for llama).
    rope_style : {"interleaved", "neox"}
        Which dimensions RoPE pairs: adjacent (2i, 2i+1) or halves (i, i + head_dim/2).
    layer_windows : tuple of (int or None)
        Per layer: the model's own sliding window n_c (keys incl. the current one), None for global.
    attn_scale : float
        Multiplies q·k (1/sqrt(head_dim) for both families here).
    embed_scale : float
        Multiplies the token embedding (sqrt(d_model) for gemma3, 1 for llama).
    activation : {"silu", "gelu_tanh"}
        Gate activation of the gated MLP.
    qk_norm, post_norms : bool
        A per-head RMSNorm of q and k (gemma3); norms after attention and after the MLP (gemma3).
    context_length : int
    bos_id, eos_id : int
    name : str
    """

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    norm_eps: float
    rope_base: float
    rope_base_local: float
    rope_style: str
    layer_windows: tuple
    attn_scale: float
    embed_scale: float
    activation: str
    qk_norm: bool
    post_norms: bool
    context_length: int
    bos_id: int
    eos_id: int
    name: str = ""

    def __post_init__(self):
        if not isinstance(self.arch, str) or not self.arch:
            raise ValueError(f"arch must be a non-empty string (got {self.arch!r})")
        for f in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive integer (got {v!r})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE (got {self.head_dim})")
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(f"rope_style must be 'interleaved' or 'neox' (got {self.rope_style!r})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be 'silu' or 'gelu_tanh' (got {self.activation!r})")
        if len(self.layer_windows) != self.n_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries, expected n_layers="
                             f"{self.n_layers}")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ValueError(f"layer_windows entries must be None or >= 1 (got {self.layer_windows})")
        for f in ("norm_eps", "rope_base", "rope_base_local", "attn_scale", "embed_scale"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{f} must be a finite number > 0 (got {v!r})")
        if not isinstance(self.context_length, int) or self.context_length < 1:
            raise ValueError(f"context_length must be a positive integer (got {self.context_length!r})")
        if not (0 <= self.bos_id < self.vocab_size and 0 <= self.eos_id < self.vocab_size):
            raise ValueError(f"bos_id={self.bos_id}/eos_id={self.eos_id} outside vocab 0..{self.vocab_size - 1}")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def common_fields(md) -> dict:
    """The :class:`ModelConfig` fields that the llama-family files store under the same keys: sizes, norm
    eps, context, special tokens, name, and the attention scale 1/sqrt(head_dim). ``md``: a
    :class:`streamattn.gguf.metadata.Metadata` (typed, bounded reads). Refuses scaled RoPE."""
    md.unscaled_rope()
    n_layers = md.integer(Keys.LLM.BLOCK_COUNT)
    d_model = md.integer(Keys.LLM.EMBEDDING_LENGTH)
    n_heads = md.integer(Keys.Attention.HEAD_COUNT)
    head_dim = md.integer(Keys.Attention.KEY_LENGTH, d_model // n_heads)
    tokens = md.md.get(Keys.Tokenizer.LIST)
    vocab = md.integer(Keys.LLM.VOCAB_SIZE, len(tokens) if isinstance(tokens, list) else 0)
    return dict(
        arch=md.arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
        n_kv_heads=md.integer(Keys.Attention.HEAD_COUNT_KV, n_heads), head_dim=head_dim,
        d_ff=md.integer(Keys.LLM.FEED_FORWARD_LENGTH), vocab_size=vocab,
        norm_eps=md.real(Keys.Attention.LAYERNORM_RMS_EPS),
        context_length=md.integer(Keys.LLM.CONTEXT_LENGTH, 2048),
        bos_id=md.integer(Keys.Tokenizer.BOS_ID, 1, top=vocab - 1),
        eos_id=md.integer(Keys.Tokenizer.EOS_ID, 2, top=vocab - 1),
        name=str(md.md.get(Keys.General.NAME, ""))[:200],
        attn_scale=1.0 / math.sqrt(head_dim),
    )


def tensor_name(tensor: MODEL_TENSOR, layer: int | None = None) -> str:
    """The GGUF name of a weight: ``tensor_name(MODEL_TENSOR.ATTN_Q, 3) == "blk.3.attn_q.weight"``."""
    base = TENSOR_NAMES[tensor]
    return (base if layer is None else base.format(bid=layer)) + ".weight"


#: The tensors outside the blocks: the token embedding, the output norm, and the output matrix (absent:
#: tied to the embedding).
EMBEDDING, OUTPUT_NORM, OUTPUT = MODEL_TENSOR.TOKEN_EMBD, MODEL_TENSOR.OUTPUT_NORM, MODEL_TENSOR.OUTPUT


def block_shapes(c: ModelConfig) -> dict:
    """{MODEL_TENSOR: shape} of the tensors a llama-family file may hold, matrices ``[out, in]``."""
    d, T = c.d_model, MODEL_TENSOR
    return {EMBEDDING: (c.vocab_size, d), OUTPUT: (c.vocab_size, d), OUTPUT_NORM: (d,),
            T.ATTN_NORM: (d,), T.ATTN_Q: (c.q_dim, d), T.ATTN_K: (c.kv_dim, d), T.ATTN_V: (c.kv_dim, d),
            T.ATTN_OUT: (d, c.q_dim), T.FFN_NORM: (d,), T.FFN_GATE: (c.d_ff, d), T.FFN_UP: (c.d_ff, d),
            T.FFN_DOWN: (d, c.d_ff), T.ATTN_Q_NORM: (c.head_dim,), T.ATTN_K_NORM: (c.head_dim,),
            T.ATTN_POST_NORM: (d,), T.FFN_POST_NORM: (d,)}


@dataclass(frozen=True)
class Architecture:
    """One architecture, as its file declares it.

    Parameters
    ----------
    name : str
        Its ``general.architecture`` in GGUF.
    config : callable(Metadata) -> ModelConfig
        Its metadata -> config (the keys it reads, its layer flags).
    layer : dict
        :class:`~streamattn.models.layer.LayerWeights` field -> the GGUF tensor that holds it
        (``MODEL_TENSOR``), or a tuple of tensors whose rows it holds in order (``wqkv``: q, k, v; ``wgu``:
        gate, up), multiplied as one matrix. ``qk_norm`` is (q-norm, k-norm), one row each, repeated per
        head. Fields left out are None (the layer has no such weight).
    shapes : callable(ModelConfig) -> {MODEL_TENSOR: shape}
        The shape of every tensor named in ``layer`` (default :func:`block_shapes`).
    """

    name: str
    config: Callable
    layer: dict
    shapes: Callable = field(default=block_shapes)

    def layer_tensors(self, i: int) -> dict:
        """{LayerWeights field: (GGUF tensor names of layer i, in row order)}."""
        return {f: tuple(tensor_name(t, i) for t in (ts if isinstance(ts, tuple) else (ts,)))
                for f, ts in self.layer.items()}

    def expected_shapes(self, c: ModelConfig, names) -> dict:
        """{tensor name: shape} that a file of config ``c`` must hold (``names``: the tensors it holds,
        for the optional output matrix), in the order a forward pass reads them: layer by layer, then the
        tensors outside the blocks (by name)."""
        shape = self.shapes(c)
        kinds = [t for ts in self.layer.values() for t in (ts if isinstance(ts, tuple) else (ts,))]
        out = {tensor_name(t, i): shape[t] for i in range(c.n_layers) for t in kinds}
        outside = [EMBEDDING, OUTPUT_NORM] + ([OUTPUT] if tensor_name(OUTPUT) in names else [])
        for t in sorted(outside, key=tensor_name):
            out[tensor_name(t)] = shape[t]
        return out
