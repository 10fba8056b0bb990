"""Read a GGUF model file: metadata -> :class:`~streamattn.models.config.ModelConfig`, tensors -> packed or
float32 weights.

Built on llama.cpp's own ``gguf`` package (its type tables; ``gguf.quants.dequantize`` for Q4_1, Q8_0,
Q4_K, Q5_0, Q6_K, ... on the float32 path); the container is read by :mod:`streamattn.gguf.reader`
(GGUFReader's results, read in one pass; measured: docs/perf/2026-12-01.md). Matrices stay in their block formats by
default (:mod:`streamattn.quant.weights`, one packed copy); ``weights="f32"`` is the float32 reference.

What a file holds depends on its architecture, and all of that is the architecture's file
(:data:`streamattn.models.architectures.ARCHITECTURES`: its metadata -> config, its tensors and their
shapes; the facts about the files it relies on, see docs/DESIGN.md §16). This module reads, validates
and lays out whatever the architecture names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import gguf.quants
from gguf.constants import Keys

from streamattn.kv.backends.gpu_gemv import GGUFMatrix
from streamattn.kv.backends.gpu_source import GEMV_TYPES
from streamattn.runtime.files import ModelFileError
from streamattn.gguf.metadata import Metadata, check_tensor_names, read_metadata
from streamattn.gguf.reader import GGUFFile
from streamattn.models.architectures import ARCHITECTURES
from streamattn.models.config import Architecture, ModelConfig, tensor_name
from streamattn.quant.arrange import fuse, in_one_buffer, packed_in_order, place
from streamattn.quant.weights import UnsupportedWeightType, check_type, pack


@dataclass
class GGUFModel:
    """A loaded model file: config, weights, and the raw metadata (for the tokenizer).

    ``weights`` maps GGUF tensor names to arrays in GGUF's numpy layout: matrices are
    ``[out_features, in_features]``, e.g. ``blk.0.attn_q.weight: [n_heads*head_dim, d_model]``; float32
    arrays, except matrices as :class:`streamattn.quant.weights.QWeight` when ``weights_kind == "quant"``.
    """

    path: str
    config: ModelConfig
    weights: dict = field(repr=False)
    metadata: dict = field(repr=False)
    weights_kind: str = "f32"
    fused: dict = field(default_factory=dict, repr=False)   # (part names, in row order) -> one matrix (arrange.fuse)


def architecture_of(md: dict, path: str = "<metadata>") -> Architecture:
    """The :class:`~streamattn.models.config.Architecture` of a file's metadata, or ModelFileError."""
    arch = md.get(Keys.General.ARCHITECTURE)
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ModelFileError(f"{path}: architecture {arch!r} is not supported; supported: "
                             f"{', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def config_from_metadata(md: dict, path: str = "<metadata>") -> ModelConfig:
    """Build a :class:`~streamattn.models.config.ModelConfig` from GGUF metadata (a dict as returned by
    :func:`~streamattn.gguf.metadata.read_metadata`), by the file's architecture.

    Raises
    ------
    ModelFileError
        Unsupported architecture, missing keys, RoPE scaling this engine does not implement, or a key of
        the architecture (``{arch}.*``) that it does not read (:meth:`Metadata.check_all_read`).
    """
    arch = architecture_of(md, path)
    m = Metadata(md, arch.name, path)
    try:
        config = arch.config(m)
    except ValueError as e:
        if isinstance(e, ModelFileError):
            raise
        raise ModelFileError(f"{path}: inconsistent metadata: {e}") from e
    m.check_all_read()
    return config


def open_container(path: str) -> GGUFFile:
    """The file's container (:class:`~streamattn.gguf.reader.GGUFFile`), or ModelFileError naming what is
    wrong with it (missing, a directory, not GGUF, truncated or corrupt)."""
    if not os.path.exists(path):
        raise ModelFileError(f"{path}: no such file; give --model PATH.gguf or run "
                             "`streamattn pull smollm2-135m`")
    if os.path.isdir(path):
        raise ModelFileError(f"{path}: is a directory, expected a .gguf file")
    from streamattn.runtime.files import BadFile, open_regular
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


WEIGHT_KINDS = ("quant", "f32")                  # what a user picks (--weights)
LOAD_KINDS = WEIGHT_KINDS + ("gguf",)            # and the GPU's, picked by the backend (options.file_weights)


def load_header(path: str) -> tuple:
    """(metadata, ModelConfig) of a GGUF file without reading any tensor (for checks before a load)."""
    path = os.fspath(path)
    md = read_metadata(open_container(path), path)
    return md, config_from_metadata(md, path)


def load_gguf(path: str, *, progress: Callable[[int, int, str], None] | None = None,
              weights: str = "quant", tokenizer: bool = True, packed_cache=None) -> GGUFModel:
    """Load a GGUF model: validate, read the config, keep matrices packed (or dequantize to float32).

    Parameters
    ----------
    path : str
        The ``.gguf`` file.
    progress : callable(done, total, tensor_name), optional
        Called after each tensor is read.
    weights : {"quant", "f32", "gguf"}
        "quant": matrices stay in their GGUF block formats (:class:`~streamattn.quant.weights.QWeight`;
        1-D tensors such as norms are float32); "f32": every tensor dequantized to float32 (the
        reference path); "gguf": the GPU's (``Transformer.to(cupy)``): matrices of a type the packed
        GEMV kernels read (``gpu_source.GEMV_TYPES``) kept as the file's bytes
        (:class:`~streamattn.kv.backends.gpu_gemv.GGUFMatrix`, not fused), every other tensor float32.
    tokenizer : bool
        Refuse a file whose tokenizer :meth:`~streamattn.text.tokenizer.Tokenizer.from_metadata` would
        refuse (:meth:`~streamattn.text.tokenizer.Tokenizer.check_metadata`), before any tensor is read
        (default); False: the file is used without its tokenizer (a fixture with placeholder tokens).
    packed_cache : None, True, False or a folder
        Where ``weights="quant"`` keeps the packed matrices on disk, mapped by every process that loads
        this file (:mod:`streamattn.gguf.packed_cache`). None: ``$STREAMATTN_PACKED_CACHE`` (``off``: no
        cache), else ``packed/`` beside the pulled models, for files of at least ``packed_cache.MIN_BYTES``;
        True: the same folder for any file; a folder: that one, for any file; False: packed in memory.
        A cached file that is stale or damaged is rebuilt; a folder that cannot be written warns and
        packs in memory. The weights are the same bits either way.

    Returns
    -------
    GGUFModel
        ``weights[name]``: matrices ``[out_features, in_features]``.

    Raises
    ------
    ModelFileError
        Missing file, not GGUF, truncated, corrupt (non-finite weights), unsupported architecture, a
        tokenizer that would be refused (``tokenizer=True``), or (``weights="quant"``) a matrix of a GGUF
        type without a packed kernel.

    Examples
    --------
    >>> m = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # doctest: +SKIP
    >>> m.config.n_layers, m.weights["blk.0.attn_q.weight"].shape
    (30, (576, 576))
    """
    if weights not in LOAD_KINDS:
        raise ValueError(f"weights must be one of {LOAD_KINDS} (got {weights!r})")
    path = os.fspath(path)
    reader = open_container(path)
    md = read_metadata(reader, path)
    arch = architecture_of(md, path)
    config = config_from_metadata(md, path)
    check_tensor_names(config.n_layers, (t.name for t in reader.tensors), path)
    # shapes checked, and tensors the model does not use left unread, before any tensor's bytes are read
    order = _check_tensors(arch, config, {t.name: tuple(int(n) for n in reversed(t.shape))
                                          for t in reader.tensors}, path)
    if tokenizer:
        from streamattn.text.tokenizer import Tokenizer
        try:
            Tokenizer.check_metadata(md)
        except ValueError as e:
            raise ModelFileError(f"{path}: {e}") from e
    used = set(order)
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}     # ggml order: [cols, rows]
    header = reader.data[:reader.header_size]
    # only the tensors' views of the file map outlive the reader (GGUFReader's field objects, the
    # tokenizer's ~100k strings as numpy parts, took ~160 MB for SmolLM2; the metadata is in md now)
    tensors = [(t.name, t.tensor_type, tuple(int(n) for n in t.shape), t.data) for t in reader.tensors
               if t.name in used]
    file_map = reader.data
    del reader
    if weights == "quant":                    # a matrix type without a kernel: refused before any is packed
        for name, qtype, shape, _ in tensors:
            if len(shape) == 2 and qtype.name not in ("F32", "F16", "BF16"):
                try:
                    check_type(name, qtype.name)
                except UnsupportedWeightType as e:
                    raise ModelFileError(f"{path}: {e}") from e
    total = len(tensors)
    # matrices packed below, in the order a forward pass reads them; odd float rows are kept float32
    packs = {name for name, qtype, shape, _ in tensors if weights == "quant" and len(shape) == 2
             and not (qtype.name in ("F32", "F16", "BF16") and shape[0] % 16)}
    out = {}
    read = []

    def tick(name):
        read.append(name)
        if progress is not None:
            progress(len(read), total, name)

    for name, qtype, shape, data in tensors:
        if name in packs:
            out[name] = None
            continue
        if weights == "gguf" and len(shape) == 2 and qtype.name in GEMV_TYPES:
            w = GGUFMatrix(qtype.name, (shape[1], shape[0]), np.array(data, np.uint8, order="C", copy=True))
            if not _finite_blocks(data, qtype):
                raise ModelFileError(f"{path}: tensor {name!r} holds NaN or inf; the file is corrupt "
                                     "- re-download it")
            _drop_pages(file_map)
        else:
            try:
                w = np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32, order="C", copy=True)
            except Exception as e:  # noqa: BLE001
                raise ModelFileError(f"{path}: tensor {name!r} of type {qtype.name} cannot be "
                                     f"dequantized ({e})") from e
            if not np.isfinite(w).all():
                raise ModelFileError(f"{path}: tensor {name!r} holds NaN or inf after dequantization; the "
                                     "file is corrupt - re-download it")
        out[name] = w
        tick(name)
    groups = [names for i in range(config.n_layers) for names in arch.layer_tensors(i).values()
              if len(names) > 1 and len(shapes[names[0]]) == 2 and weights != "gguf"]
    fused = fuse(out, [g for g in groups if not any(n in packs for n in g)])
    if packs:
        packed = _packed(path, header, {t[0]: t for t in tensors if t[0] in packs}, file_map, order,
                         [g for g in groups if all(n in packs for n in g)], packed_cache, tick)
        place(out, fused, packed, {name: shapes[name][1] for name in packs})
        for name in packs.difference(read):       # mapped from the disk cache, not read one by one
            tick(name)
    del tensors, file_map
    return GGUFModel(path=path, config=config, weights=out, metadata=md, weights_kind=weights, fused=fused)


def _packed(path: str, header, tensors: dict, file_map, order, groups, option, done) -> list:
    """The packed matrices of ``tensors`` (name -> (name, type, shape, data)) as ``(key, QWeight)`` pairs in
    the order a forward pass reads them: mapped from the disk cache (built first when it is missing,
    stale or damaged), or packed into one buffer in memory where there is no cache."""
    from streamattn.gguf import packed_cache
    from streamattn.quant.kernels import LANES

    def pack_one(name):
        _, qtype, shape, data = tensors[name]
        try:
            w = pack(name, qtype.name, data, (shape[1], shape[0]))
        except UnsupportedWeightType as e:
            raise ModelFileError(f"{path}: {e}") from e
        if not w.finite():
            raise ModelFileError(f"{path}: tensor {name!r} holds NaN or inf; the file is corrupt "
                                 "- re-download it")
        _drop_pages(file_map)
        done(name)
        return w

    def build():
        return packed_in_order([n for n in order if n in tensors], groups, pack_one)

    def check(pairs):                          # each matrix once, in the shape the file's tensor table gives
        names = [n for key, _ in pairs for n in (key if isinstance(key, tuple) else (key,))]
        if sorted(names) != sorted(tensors):
            return f"holds {len(names)} matrices, the model {len(tensors)}"
        for key, w in pairs:
            parts = key if isinstance(key, tuple) else (key,)
            shape = (sum(tensors[n][2][1] for n in parts), tensors[parts[0]][2][0])
            if w.shape != shape or any(tensors[n][2][0] != shape[1] for n in parts):
                return f"{key} is {w.shape}, the file's tensors {shape}"
        return None

    where = packed_cache.folder(option, file_map.nbytes)
    if where is not None:
        want = packed_cache.key(path, header, LANES)
        got = packed_cache.load(where, path, want, build, source=file_map, lanes=LANES, check=check)
        if got is not None:
            return got
    return in_one_buffer(build())


def _finite_blocks(data, qtype, rows: int = 256) -> bool:
    """Whether a quantized tensor's values are all finite, dequantized ``rows`` rows at a time (a bounded
    float32 copy: an 8B model's output head whole would be 2 GB)."""
    return all(np.isfinite(gguf.quants.dequantize(data[r:r + rows], qtype)).all() for r in range(0, len(data), rows))


def _drop_pages(file_map) -> None:
    """Let the kernel drop the file pages read so far: the packed copies are all that is used later, and
    pages of a mapped file count in the process's RSS while mapped (SmolLM2: 96 MB)."""
    mm = getattr(file_map, "_mmap", None)
    if mm is not None and hasattr(mm, "madvise"):
        import mmap
        mm.madvise(mmap.MADV_DONTNEED)


def _check_tensors(arch: Architecture, c: ModelConfig, shapes: dict, path: str) -> list:
    """ModelFileError unless the file holds every tensor the architecture names, in its shape, and no other
    (``shapes``: name -> shape, [out, in] for matrices); returns their names in the order a forward pass
    reads them. A tensor the architecture does not name (a bias, RoPE factors, a norm another variant
    has) would change the forward pass if it were used: ignoring it would run another model."""
    expect = arch.expected_shapes(c, shapes)
    extra = sorted(set(shapes) - set(expect))
    if extra:
        more = f" (and {len(extra) - 1} more: {', '.join(extra[1:4])})" if len(extra) > 1 else ""
        raise ModelFileError(f"{path}: tensor {extra[0]!r}{more} is not used by architecture {c.arch!r}; the "
                             "model would run without it, so it is refused rather than run approximately "
                             f"(tensors of layer 0: {', '.join(n for n in expect if n.startswith('blk.0.'))})")
    for pair in arch.pairs:
        names = [tensor_name(t) for t in pair]
        have = [n for n in names if n in shapes]
        if have and len(have) < len(names):
            raise ModelFileError(f"{path}: tensors {' and '.join(map(repr, names))} come as a set; the file "
                                 f"has only {', '.join(map(repr, have))}")
    for name, shape in expect.items():
        if name not in shapes:
            raise ModelFileError(f"{path}: tensor {name!r} is missing (architecture {c.arch}, "
                                 f"{c.n_layers} layers)")
        if shapes[name] != shape:
            raise ModelFileError(f"{path}: tensor {name!r} has shape {shapes[name]}, expected {shape}")
    return list(expect)
