"""What a model is, as data: :class:`ModelConfig` (its numbers and layer flags) and :class:`Architecture`
(what one architecture file declares: metadata -> config, and which GGUF tensors make each layer weight).

An architecture is one file in streamattn/models/ (``llama.py``, ``qwen2.py``, ``qwen3.py``, ``phi3.py``,
``gemma2.py``, ``gemma3.py``) defining an ``Architecture`` and one entry in
:data:`streamattn.models.architectures.ARCHITECTURES`. Tensor names come from gguf.constants
(``MODEL_TENSOR`` / ``TENSOR_NAMES``), metadata keys from its ``Keys``; the loader and the transformer read
both through the architecture and never branch on its name. What an architecture does not read is
refused: a ``{arch}.*`` key its config did not read, a tensor it does not name (docs/DESIGN.md §16).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable

from gguf.constants import MODEL_TENSOR, TENSOR_NAMES, Keys

from streamattn.runtime.files import ModelFileError

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
        Multiplies q·k (1/sqrt(head_dim), or Gemma-2's 1/sqrt(query_pre_attn_scalar)).
    embed_scale : float
        Multiplies the token embedding (sqrt(d_model) for gemma2/gemma3, 1 for llama).
    activation : {"silu", "gelu_tanh"}
        Gate activation of the gated MLP.
    qk_norm, post_norms : bool
        A per-head RMSNorm of q and k (gemma3, qwen3); norms after attention and after the MLP (gemma2,
        gemma3).
    context_length : int
    bos_id, eos_id : int
    name : str
    rope_linear : float
        Linear RoPE scaling (``rope.scaling.type = "linear"``): every inverse frequency divided by it
        (1: none). Per-dimension divisors (llama3 scaling; Phi-3's long/short factors) are tensors,
        ``rope_freqs.weight`` / ``rope_factors_{long,short}.weight``, applied by the transformer
        (:func:`streamattn.models.rope.inverse_frequencies`).
    rope_attn_factor : float
        Multiplies cos and sin of the global base's RoPE tables, so every q·k of a global layer by its
        square (``rope.scaling.attn_factor``: Phi-3 longrope's; ggml rope's ``mscale``); 1: none.
    rope_orig_context : int or None
        ``rope.scaling.original_context_length``: the context RoPE was trained at before scaling. Phi-3's
        long factors are used for a context above it, YaRN's ramp is placed by it (docs/DESIGN.md §21);
        None when the file is silent (then ``context_length``, as llama.cpp).
    rope_yarn : float or None
        YaRN's factor (``rope.scaling.type = "yarn"``): the global base's frequencies blended between
        unchanged and divided by it (:func:`streamattn.models.rope.yarn_divisors`), and ``rope_attn_factor``
        already multiplied by 1 + 0.1 ln(factor); None: no YaRN.
    attn_softcap, final_softcap : float or None
        Soft-capping (gemma2): every scaled attention score s becomes c * tanh(s / c) before the mask and
        the softmax (c = ``attn_softcap``), every output logit z becomes c * tanh(z / c) (c =
        ``final_softcap``); None: not capped.
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
    rope_linear: float = 1.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_attn_factor: float = 1.0
    rope_orig_context: int | None = None
    rope_yarn: float | None = None

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
        for f in ("norm_eps", "rope_base", "rope_base_local", "attn_scale", "embed_scale", "rope_linear",
                  "rope_attn_factor"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{f} must be a finite number > 0 (got {v!r})")
        for f in ("attn_softcap", "final_softcap"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise ValueError(f"{f} must be None (no cap) or a finite number > 0 (got {v!r})")
        y = self.rope_yarn
        if y is not None and (isinstance(y, bool) or not isinstance(y, (int, float)) or not math.isfinite(y) or y < 1):
            raise ValueError(f"rope_yarn must be None or a finite number >= 1 (got {self.rope_yarn!r})")
        if self.rope_orig_context is not None and (not isinstance(self.rope_orig_context, int)
                                                   or self.rope_orig_context < 1):
            raise ValueError(f"rope_orig_context must be None or a positive integer (got {self.rope_orig_context!r})")
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


def common_fields(md, *, longrope: bool = False, yarn: bool = False) -> dict:
    """The :class:`ModelConfig` fields that the llama-family files store under the same keys: sizes, norm
    eps, context, special tokens, name, the attention scale 1/sqrt(head_dim) and RoPE scaling
    (:func:`rope_scaling`, which ``longrope`` and ``yarn`` are passed to). ``md``: a
    :class:`streamattn.gguf.metadata.Metadata` (typed, bounded reads).

    Raises
    ------
    ModelFileError
        RoPE on part of a head (``rope.dimension_count`` < head_dim), values of another width than keys
        (``attention.value_length``), or RoPE scaling this engine does not implement.
    """
    n_layers = md.integer(Keys.LLM.BLOCK_COUNT)
    d_model = md.integer(Keys.LLM.EMBEDDING_LENGTH)
    n_heads = md.integer(Keys.Attention.HEAD_COUNT)
    head_dim = md.integer(Keys.Attention.KEY_LENGTH, d_model // n_heads)
    for key, what in ((Keys.Rope.DIMENSION_COUNT, "RoPE on part of each head"),
                      (Keys.Attention.VALUE_LENGTH, "values of another width than keys")):
        if md.integer(key, head_dim) != head_dim:
            raise ModelFileError(f"{md.path}: metadata key {md.key(key)!r} = {md.get(key)} differs from the "
                                 f"head size {head_dim}: {what} is not supported")
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
        attn_scale=1.0 / math.sqrt(head_dim), **rope_scaling(md, longrope=longrope, yarn=yarn),
    )


def optional_window(md):
    """Every layer's window n_c from ``{arch}.attention.sliding_window`` (keys incl. the current one, as
    HF's sliding mask), or None when the key is absent or 0 (llama.cpp's converter writes 0 for none)."""
    key = Keys.Attention.SLIDING_WINDOW
    window = md.get(key, 0)
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or not 0 <= window < 1 << 31:
        raise ModelFileError(f"{md.path}: metadata key {md.key(key)!r} must be an integer in 0..{(1 << 31) - 1} "
                             f"(0: no window; got {str(window)[:40]!r})")
    return int(window) or None


#: ``{arch}.rope.scaling.type`` values implemented. Llama-3.x scaling ("llama3" in HF configs) is not a
#: type in GGUF: llama.cpp's converter stores it as per-dimension divisors, the ``rope_freqs.weight``
#: tensor, which the architectures that accept it apply (:func:`streamattn.models.rope.inverse_frequencies`);
#: Phi-3's su/longrope is not a type either: two tensors of divisors and an attention factor.
ROPE_SCALINGS = ("none", "linear", "yarn")

#: YaRN keys llama.cpp's loader does not read (it runs its defaults): a file may hold them at those values.
_YARN_DEFAULTS = ((Keys.Rope.SCALING_YARN_BETA_FAST, 32.0), (Keys.Rope.SCALING_YARN_BETA_SLOW, 1.0),
                  (Keys.Rope.SCALING_YARN_EXT_FACTOR, 1.0))


def rope_scaling(md, *, longrope: bool = False, yarn: bool = False) -> dict:
    """The RoPE scaling fields of :class:`ModelConfig` from a file's ``{arch}.rope.scaling.*`` keys:
    ``rope_linear`` (1 when unscaled, else the factor every inverse frequency of the global layers is
    divided by, llama.cpp's ``freq_scale`` = 1/factor), ``rope_attn_factor``, ``rope_orig_context`` and
    ``rope_yarn``.

    ``longrope``: the architecture takes Phi-3's long/short factor tensors, whose attention factor
    (``rope.scaling.attn_factor``, sqrt(1 + ln(s) / ln(original context)) for a context s times the
    original) multiplies cos and sin, as ggml's rope ``mscale``. ``yarn``: the architecture takes YaRN
    (one RoPE base: llama, qwen2, qwen3), run as llama.cpp runs it (docs/DESIGN.md §21).

    Raises
    ------
    ModelFileError
        A scaling type other than :data:`ROPE_SCALINGS` (or yarn where not taken), a factor without a
        type, an attention factor other than 1 outside longrope and yarn, a YaRN factor below 1, or a
        YaRN key at a value llama.cpp would not run, each naming the key and its value.
    """
    kind = md.get(Keys.Rope.SCALING_TYPE, "none")
    factor = md.real(Keys.Rope.SCALING_FACTOR, 1.0)
    kinds = ROPE_SCALINGS if yarn else ("none", "linear")
    if longrope and kind == "longrope":          # converters other than Phi3MiniModel's name it
        kind = "none"
    if kind not in kinds:
        raise ModelFileError(f"{md.path}: RoPE scaling {str(kind)[:40]!r} ({md.key(Keys.Rope.SCALING_TYPE)}) "
                             f"is not supported for architecture {md.arch!r}; supported: {', '.join(kinds)}, "
                             "llama3 factors in rope_freqs.weight (llama), and Phi-3's longrope factors (phi3)")
    if kind == "none" and factor != 1.0:
        raise ModelFileError(f"{md.path}: metadata key {md.key(Keys.Rope.SCALING_FACTOR)!r} = {factor} without "
                             f"a scaling type; expected {md.key(Keys.Rope.SCALING_TYPE)} = 'linear' or factor 1")
    attn = md.real(Keys.Rope.SCALING_ATTN_FACTOR, 1.0)
    if attn != 1.0 and not (longrope or kind == "yarn"):
        raise ModelFileError(f"{md.path}: metadata key {md.key(Keys.Rope.SCALING_ATTN_FACTOR)!r} = {attn} is "
                             f"not supported for architecture {md.arch!r} without YaRN (only 1: RoPE tables "
                             "unscaled in magnitude; phi3 longrope files take it)")
    orig = md.integer(Keys.Rope.SCALING_ORIG_CTX_LEN, 0, top=(1 << 31) - 1) or None
    md.get(Keys.Rope.SCALING_FINETUNED, False)     # a note on training: no effect on the forward pass
    out = dict(rope_linear=factor if kind == "linear" else 1.0, rope_attn_factor=attn, rope_orig_context=orig)
    if kind == "yarn":
        if factor < 1.0:
            raise ModelFileError(f"{md.path}: metadata key {md.key(Keys.Rope.SCALING_FACTOR)!r} = {factor}: a YaRN "
                                 "factor below 1 is not supported (llama.cpp and HF scale its attention "
                                 "differently there)")
        # llama.cpp's loader reads none of these keys and runs its defaults; HF would run the file's values
        for key, default in _YARN_DEFAULTS:
            v = md.real(key, default)
            if v != default:
                raise ModelFileError(f"{md.path}: metadata key {md.key(key)!r} = {v} is not supported (only "
                                     f"{default:g}, the value llama.cpp runs)")
        mscale = 1.0 + 0.1 * math.log(factor)      # HF's default attention factor, llama.cpp's mscale
        v = md.get(Keys.Rope.SCALING_YARN_ATTN_FACTOR, mscale)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isclose(v, mscale, rel_tol=1e-6):
            raise ModelFileError(f"{md.path}: metadata key {md.key(Keys.Rope.SCALING_YARN_ATTN_FACTOR)!r} = "
                                 f"{str(v)[:40]} is not supported (only 1 + 0.1 ln(factor) = {mscale:.6g}, what "
                                 "llama.cpp runs)")
        if md.get(Keys.Rope.SCALING_YARN_LOG_MUL, 0.0) != 0.0:
            raise ModelFileError(f"{md.path}: metadata key {md.key(Keys.Rope.SCALING_YARN_LOG_MUL)!r} = "
                                 f"{str(md.get(Keys.Rope.SCALING_YARN_LOG_MUL))[:40]} is not supported (only 0)")
        out.update(rope_yarn=factor, rope_attn_factor=attn * mscale)
    return out


@dataclass(frozen=True)
class Bias:
    """The bias of a linear layer, next to its weight: ``Bias(MODEL_TENSOR.ATTN_Q)`` is
    ``blk.{i}.attn_q.bias``, of shape ``[out]``."""

    of: MODEL_TENSOR


def tensor_name(tensor, layer: int | None = None) -> str:
    """The GGUF name of a weight (a ``MODEL_TENSOR``) or a :class:`Bias`:
    ``tensor_name(MODEL_TENSOR.ATTN_Q, 3) == "blk.3.attn_q.weight"``, ``tensor_name(Bias(MODEL_TENSOR.ATTN_Q),
    3) == "blk.3.attn_q.bias"``."""
    t, suffix = (tensor.of, ".bias") if isinstance(tensor, Bias) else (tensor, ".weight")
    base = TENSOR_NAMES[t]
    return (base if layer is None else base.format(bid=layer)) + suffix


#: The tensors outside the blocks: the token embedding, the output norm, the output matrix (absent:
#: tied to the embedding), and RoPE's per-dimension frequency divisors (llama3 scaling, where accepted).
EMBEDDING, OUTPUT_NORM, OUTPUT, ROPE_FREQS = (MODEL_TENSOR.TOKEN_EMBD, MODEL_TENSOR.OUTPUT_NORM, MODEL_TENSOR.OUTPUT,
                                              MODEL_TENSOR.ROPE_FREQS)
#: Phi-3's su/longrope divisors: one set for a context above ``rope_orig_context``, one for a context within.
ROPE_LONG, ROPE_SHORT = MODEL_TENSOR.ROPE_FACTORS_LONG, MODEL_TENSOR.ROPE_FACTORS_SHORT


def block_shapes(c: ModelConfig) -> dict:
    """{MODEL_TENSOR: shape} of the tensors a llama-family file may hold, matrices ``[out, in]`` (a
    :class:`Bias` has the shape ``[out]`` of its weight's rows)."""
    d, T = c.d_model, MODEL_TENSOR
    return {EMBEDDING: (c.vocab_size, d), OUTPUT: (c.vocab_size, d), OUTPUT_NORM: (d,),
            ROPE_FREQS: (c.head_dim // 2,), ROPE_LONG: (c.head_dim // 2,), ROPE_SHORT: (c.head_dim // 2,),
            T.ATTN_NORM: (d,), T.ATTN_Q: (c.q_dim, d), T.ATTN_K: (c.kv_dim, d), T.ATTN_V: (c.kv_dim, d),
            T.ATTN_OUT: (d, c.q_dim), T.FFN_NORM: (d,), T.FFN_GATE: (c.d_ff, d), T.FFN_UP: (c.d_ff, d),
            T.FFN_DOWN: (d, c.d_ff), T.ATTN_Q_NORM: (c.head_dim,), T.ATTN_K_NORM: (c.head_dim,),
            T.ATTN_POST_NORM: (d,), T.FFN_POST_NORM: (d,)}


def _shape(shapes: dict, t) -> tuple:
    return shapes[t.of][:1] if isinstance(t, Bias) else shapes[t]


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
        (``MODEL_TENSOR``, or :class:`Bias` of one), or a tuple of tensors whose rows it holds in order
        (``wqkv``: q, k, v; ``wgu``: gate, up; ``bqkv``: their biases), multiplied as one matrix.
        ``qk_norm`` is (q-norm, k-norm), one row each, repeated per head. Fields left out are None (the
        layer has no such weight).
    optional : tuple of MODEL_TENSOR
        Tensors outside the blocks that a file may hold and the forward pass then uses (default: the
        output matrix, tied to the embedding when absent; llama-family files add :data:`ROPE_FREQS`).
        A file holding any tensor not named here or in ``layer`` is refused (the loader's check).
    shapes : callable(ModelConfig) -> {MODEL_TENSOR: shape}
        The shape of every tensor named in ``layer`` and ``optional`` (default :func:`block_shapes`).
    pairs : tuple of tuples of MODEL_TENSOR
        Optional tensors that only mean something together (phi3: the long and short RoPE factors): a
        file holding some of a pair and not all is refused before any tensor is read.
    """

    name: str
    config: Callable
    layer: dict
    optional: tuple = (OUTPUT,)
    shapes: Callable = field(default=block_shapes)
    pairs: tuple = ()

    def layer_tensors(self, i: int) -> dict:
        """{LayerWeights field: (GGUF tensor names of layer i, in row order)}."""
        return {f: tuple(tensor_name(t, i) for t in (ts if isinstance(ts, tuple) else (ts,)))
                for f, ts in self.layer.items()}

    def expected_shapes(self, c: ModelConfig, names) -> dict:
        """{tensor name: shape} that a file of config ``c`` must hold (``names``: the tensors it holds,
        for the optional ones), in the order a forward pass reads them: layer by layer, then the
        tensors outside the blocks (by name)."""
        shape = self.shapes(c)
        kinds = [t for ts in self.layer.values() for t in (ts if isinstance(ts, tuple) else (ts,))]
        out = {tensor_name(t, i): _shape(shape, t) for i in range(c.n_layers) for t in kinds}
        outside = [EMBEDDING, OUTPUT_NORM] + [t for t in self.optional if tensor_name(t) in names]
        for t in sorted(outside, key=tensor_name):
            out[tensor_name(t)] = shape[t]
        return out
