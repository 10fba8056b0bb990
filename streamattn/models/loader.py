"""Read a GGUF model file: metadata -> :class:`ModelConfig`, tensors -> packed or float32 weights.

Built on llama.cpp's own ``gguf`` package (its type tables; ``gguf.quants.dequantize`` for Q4_1, Q8_0,
Q4_K, Q5_0, Q6_K, ... on the float32 path); the container is read by :mod:`streamattn.models.gguf_read`
(GGUFReader's results, 50x faster on Gemma's vocabulary). Matrices stay in their block formats by
default (:mod:`streamattn.models.quant`, one packed copy); ``weights="f32"`` is the float32 reference.

Facts about the files this module relies on (see docs/DESIGN.md §10):

- llama: ``attn_q``/``attn_k`` rows are stored permuted by llama.cpp's converter so that RoPE rotates
  *adjacent* pairs (2i, 2i+1) of each head ("interleaved", llama.cpp's ROPE_TYPE_NORM). We keep that
  order and rotate adjacent pairs; q·k is unchanged by a permutation applied to both, so the cache and
  attention never need to know.
- gemma3: rows are not permuted; RoPE rotates the two halves of each head ("neox" style). Norm weights
  are stored already shifted (1 + w), so every RMSNorm is a plain ``x * w``. The file carries neither
  the local RoPE base, nor the sliding-window pattern, nor a chat template: llama.cpp hard-codes
  base 1e4 on local layers and one global layer in every 6; so do we (``GEMMA3_*`` constants below).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from streamattn.models.arrange import fuse, into_one_buffer
from streamattn.models.metadata_checks import LIMITS, ModelFileError, check_tensor_names

SUPPORTED_ARCHS = ("llama", "gemma3")
GEMMA3_ROPE_BASE_LOCAL = 10_000.0
GEMMA3_GLOBAL_EVERY = 6          # layers 5, 11, 17, ... are global; the others slide


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, read from GGUF metadata.

    Parameters
    ----------
    arch : {"llama", "gemma3"}
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
        gemma3's per-head RMSNorm of q and k; its norms after attention and after the MLP.
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
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"arch must be one of {SUPPORTED_ARCHS} (got {self.arch!r})")
        for f in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive integer (got {v!r})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE (got {self.head_dim})")
        if self.rope_style not in ("interleaved", "neox"):
            raise ValueError(f"rope_style must be 'interleaved' or 'neox' (got {self.rope_style!r})")
        if self.activation not in ("silu", "gelu_tanh"):
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


@dataclass
class GGUFModel:
    """A loaded model file: config, weights, and the raw metadata (for the tokenizer).

    ``weights`` maps GGUF tensor names to arrays in GGUF's numpy layout: matrices are
    ``[out_features, in_features]``, e.g. ``blk.0.attn_q.weight: [n_heads*head_dim, d_model]``; float32
    arrays, except matrices as :class:`streamattn.models.quant.QWeight` when ``weights_kind == "quant"``.
    """

    path: str
    config: ModelConfig
    weights: dict = field(repr=False)
    metadata: dict = field(repr=False)
    weights_kind: str = "f32"
    fused: dict = field(default_factory=dict, repr=False)   # "blk.{i}.attn_qkv.weight" ... (see arrange.FUSED)


def read_metadata(reader, path: str) -> dict:
    """All scalar/string/array metadata as plain Python values: a GGUFFile's, or a GGUFReader's decoded."""
    if hasattr(reader, "metadata"):
        return dict(reader.metadata)
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = f.contents()
        except Exception as e:  # noqa: BLE001 - any decode failure means a corrupt field
            raise ModelFileError(f"{path}: metadata field {key!r} cannot be decoded ({e}); the file is "
                                 "corrupt") from e
    return out


def config_from_metadata(md: dict, path: str = "<metadata>") -> ModelConfig:
    """Build a :class:`ModelConfig` from GGUF metadata (a dict as returned by :func:`read_metadata`).

    Raises
    ------
    ModelFileError
        Unsupported architecture, missing keys, or RoPE scaling this engine does not implement.
    """
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelFileError(f"{path}: architecture {arch!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHS)}")

    def get(key, default=None):
        k = f"{arch}.{key}"
        if k in md:
            return md[k]
        if default is None:
            raise ModelFileError(f"{path}: metadata key {k!r} is missing for architecture {arch!r}")
        return default

    def integer(key, default=None, *, top=None, full=False):
        k = key if full else f"{arch}.{key}"
        v = md.get(k, default) if full else get(key, default)
        lo, hi = LIMITS.get(key, (1, 1 << 31)) if top is None else (0, top)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
            raise ModelFileError(f"{path}: metadata key {k!r} must be an integer in {lo}..{hi} (got "
                                 f"{type(v).__name__} {str(v)[:40]!r})")
        return int(v)

    def real(key, default=None):
        v = get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v) or v <= 0:
            raise ModelFileError(f"{path}: metadata key {arch}.{key!s} must be a finite number > 0 (got "
                                 f"{type(v).__name__} {str(v)[:40]!r})")
        return float(v)

    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or (scaling == "linear" and get("rope.scaling.factor", 1.0) != 1.0):
        raise ModelFileError(f"{path}: RoPE scaling {scaling!r} is not supported (only unscaled RoPE)")
    n_layers = integer("block_count")
    d_model = integer("embedding_length")
    n_heads = integer("attention.head_count")
    head_dim = integer("attention.key_length", d_model // n_heads)
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = integer("vocab_size", len(tokens) if isinstance(tokens, list) else 0)
    common = dict(
        arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
        n_kv_heads=integer("attention.head_count_kv", n_heads), head_dim=head_dim,
        d_ff=integer("feed_forward_length"), vocab_size=vocab,
        norm_eps=real("attention.layer_norm_rms_epsilon"),
        context_length=integer("context_length", 2048),
        bos_id=integer("tokenizer.ggml.bos_token_id", 1, top=vocab - 1, full=True),
        eos_id=integer("tokenizer.ggml.eos_token_id", 2, top=vocab - 1, full=True),
        name=str(md.get("general.name", ""))[:200],
        attn_scale=1.0 / math.sqrt(head_dim),
    )
    try:
        if arch == "llama":
            base = real("rope.freq_base", 10_000.0)
            return ModelConfig(**common, rope_base=base, rope_base_local=base, rope_style="interleaved",
                               layer_windows=(None,) * n_layers, embed_scale=1.0, activation="silu",
                               qk_norm=False, post_norms=False)
        window = integer("attention.sliding_window")
        windows = tuple(None if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else window for i in range(n_layers))
        return ModelConfig(**common, rope_base=real("rope.freq_base", 1_000_000.0),
                           rope_base_local=GEMMA3_ROPE_BASE_LOCAL, rope_style="neox", layer_windows=windows,
                           embed_scale=math.sqrt(d_model), activation="gelu_tanh", qk_norm=True,
                           post_norms=True)
    except ValueError as e:
        if isinstance(e, ModelFileError):
            raise
        raise ModelFileError(f"{path}: inconsistent metadata: {e}") from e


def _open(path: str):
    from streamattn.models.gguf_read import GGUFFile

    if not os.path.exists(path):
        raise ModelFileError(f"{path}: no such file; give --model PATH.gguf or run "
                             "`streamattn pull smollm2-135m`")
    if os.path.isdir(path):
        raise ModelFileError(f"{path}: is a directory, expected a .gguf file")
    from streamattn.files import BadFile, open_regular
    try:
        fh = open_regular(path)     # a FIFO or a device is refused by name (reading one blocks or never ends)
    except BadFile as e:
        raise ModelFileError(str(e)) from None
    with fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (first bytes {magic!r}, expected b'GGUF')")
    try:
        return GGUFFile(path)       # checks every count and every tensor's end against the file's size
    except Exception as e:  # noqa: BLE001 - any parse failure of a damaged file
        raise ModelFileError(f"{path}: the GGUF container cannot be read ({type(e).__name__}: {e}); the "
                             "file is truncated or corrupt - re-download it") from e


WEIGHT_KINDS = ("quant", "f32")


def load_header(path: str) -> tuple:
    """(metadata, ModelConfig) of a GGUF file without reading any tensor (for checks before a load)."""
    path = os.fspath(path)
    md = read_metadata(_open(path), path)
    return md, config_from_metadata(md, path)


def load_gguf(path: str, *, progress: Callable[[int, int, str], None] | None = None,
              weights: str = "quant") -> GGUFModel:
    """Load a GGUF model: validate, read the config, keep matrices packed (or dequantize to float32).

    Parameters
    ----------
    path : str
        The ``.gguf`` file.
    progress : callable(done, total, tensor_name), optional
        Called after each tensor is read.
    weights : {"quant", "f32"}
        "quant": matrices stay in their GGUF block formats (:class:`~streamattn.models.quant.QWeight`;
        1-D tensors such as norms are float32); "f32": every tensor dequantized to float32 (the
        reference path).

    Returns
    -------
    GGUFModel
        ``weights[name]``: matrices ``[out_features, in_features]``.

    Raises
    ------
    ModelFileError
        Missing file, not GGUF, truncated, corrupt (non-finite weights), unsupported architecture, or
        (``weights="quant"``) a matrix of a GGUF type without a packed kernel.

    Examples
    --------
    >>> m = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # doctest: +SKIP
    >>> m.config.n_layers, m.weights["blk.0.attn_q.weight"].shape
    (30, (576, 576))
    """
    from gguf.quants import dequantize

    from streamattn.models.quant import UnsupportedWeightType, pack

    if weights not in WEIGHT_KINDS:
        raise ValueError(f"weights must be one of {WEIGHT_KINDS} (got {weights!r})")
    path = os.fspath(path)
    reader = _open(path)
    md = read_metadata(reader, path)
    config = config_from_metadata(md, path)
    check_tensor_names(config, (t.name for t in reader.tensors), path)
    # shapes checked, and tensors the model does not use left unread, before any tensor's bytes are read
    used = _check_tensors(config, {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors},
                          path)
    # only the tensors' views of the file map outlive the reader (GGUFReader's field objects, the
    # tokenizer's ~100k strings as numpy parts, took ~160 MB for SmolLM2; the metadata is in md now)
    tensors = [(t.name, t.tensor_type, tuple(int(n) for n in t.shape), t.data) for t in reader.tensors
               if t.name in used]
    file_map = reader.data
    del reader
    out = {}
    total = len(tensors)
    for i, (name, qtype, shape, data) in enumerate(tensors):
        floats_odd = qtype.name in ("F32", "F16", "BF16") and shape[0] % 16
        if weights == "quant" and len(shape) == 2 and not floats_odd:      # odd float rows: kept float32
            try:
                w = pack(name, qtype.name, data, (shape[1], shape[0]))
            except UnsupportedWeightType as e:
                raise ModelFileError(f"{path}: {e}") from e
            if not w.finite():
                raise ModelFileError(f"{path}: tensor {name!r} holds NaN or inf; the file is corrupt "
                                     "- re-download it")
            _drop_pages(file_map)
        else:
            try:
                w = np.array(dequantize(data, qtype), dtype=np.float32, order="C", copy=True)
            except Exception as e:  # noqa: BLE001
                raise ModelFileError(f"{path}: tensor {name!r} of type {qtype.name} cannot be "
                                     f"dequantized ({e})") from e
            if not np.isfinite(w).all():
                raise ModelFileError(f"{path}: tensor {name!r} holds NaN or inf after dequantization; the "
                                     "file is corrupt - re-download it")
        out[name] = w
        if progress is not None:
            progress(i + 1, total, name)
    del tensors, file_map
    fused = fuse(out, config.n_layers)
    if weights == "quant":
        into_one_buffer(out, fused, config.n_layers)
    return GGUFModel(path=path, config=config, weights=out, metadata=md, weights_kind=weights, fused=fused)


def _drop_pages(file_map) -> None:
    """Let the kernel drop the file pages read so far: the packed copies are all that is used later, and
    pages of a mapped file count in the process's RSS while mapped (SmolLM2: 96 MB)."""
    mm = getattr(file_map, "_mmap", None)
    if mm is not None and hasattr(mm, "madvise"):
        import mmap
        mm.madvise(mmap.MADV_DONTNEED)


def _check_tensors(c: ModelConfig, w: dict, path: str) -> set:
    """``w``: name -> shape ([out, in] for matrices). The names the model uses, each of the right shape."""
    expect = {"token_embd.weight": (c.vocab_size, c.d_model), "output_norm.weight": (c.d_model,)}
    for i in range(c.n_layers):
        p = f"blk.{i}."
        expect.update({
            p + "attn_norm.weight": (c.d_model,), p + "ffn_norm.weight": (c.d_model,),
            p + "attn_q.weight": (c.q_dim, c.d_model), p + "attn_k.weight": (c.kv_dim, c.d_model),
            p + "attn_v.weight": (c.kv_dim, c.d_model), p + "attn_output.weight": (c.d_model, c.q_dim),
            p + "ffn_gate.weight": (c.d_ff, c.d_model), p + "ffn_up.weight": (c.d_ff, c.d_model),
            p + "ffn_down.weight": (c.d_model, c.d_ff)})
        if c.qk_norm:
            expect[p + "attn_q_norm.weight"] = expect[p + "attn_k_norm.weight"] = (c.head_dim,)
        if c.post_norms:
            expect[p + "post_attention_norm.weight"] = expect[p + "post_ffw_norm.weight"] = (c.d_model,)
    if "output.weight" in w:
        expect["output.weight"] = (c.vocab_size, c.d_model)
    for name, shape in expect.items():
        if name not in w:
            raise ModelFileError(f"{path}: tensor {name!r} is missing (architecture {c.arch}, "
                                 f"{c.n_layers} layers)")
        if w[name] != shape:
            raise ModelFileError(f"{path}: tensor {name!r} has shape {w[name]}, expected {shape}")
    return set(expect)
