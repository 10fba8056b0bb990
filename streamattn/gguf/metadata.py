"""GGUF metadata as checked Python values: typed reads with bounds, applied before any tensor is read (see
docs/SECURITY.md), and the file's block count against the tensors it holds.

Keys are gguf.constants' templates (``Keys.LLM.BLOCK_COUNT`` = ``"{arch}.block_count"``), formatted with
the file's architecture by :class:`Metadata`.
"""

from __future__ import annotations

import math

import numpy as np
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES, Keys

from streamattn.runtime.files import ModelFileError


# Bounds of the integer metadata (inclusive): far above real models, low enough that a hostile value is
# refused before it sizes anything (block_count 1e7 would build tuples and dictionaries of that length).
LIMITS = {Keys.LLM.BLOCK_COUNT: (1, 1 << 12), Keys.LLM.EMBEDDING_LENGTH: (1, 1 << 17),
          Keys.Attention.HEAD_COUNT: (1, 1 << 12), Keys.Attention.HEAD_COUNT_KV: (1, 1 << 12),
          Keys.Attention.KEY_LENGTH: (1, 1 << 14), Keys.LLM.FEED_FORWARD_LENGTH: (1, 1 << 19),
          Keys.LLM.VOCAB_SIZE: (1, 1 << 24), Keys.LLM.CONTEXT_LENGTH: (1, 1 << 31),
          Keys.Attention.SLIDING_WINDOW: (1, 1 << 31)}
_INT32 = (1, 1 << 31)


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


class Metadata:
    """One file's metadata read as one architecture's: each read names its key, checks the value's type
    and bounds, and raises :class:`ModelFileError` naming the file and the key.

    Parameters
    ----------
    md : dict
        From :func:`read_metadata`.
    arch : str
        The file's ``general.architecture``: fills ``{arch}`` in the keys.
    path : str
        For the messages.
    """

    def __init__(self, md: dict, arch: str, path: str = "<metadata>"):
        self.md, self.arch, self.path = md, arch, path
        self.read = set()           # the keys read so far (formatted): see :meth:`check_all_read`

    def key(self, key: str) -> str:
        """A gguf.constants key template with this file's architecture."""
        return key.format(arch=self.arch)

    def get(self, key: str, default=None):
        """The raw value of ``key``; ``default`` when absent, or (no default) ModelFileError."""
        k = self.key(key)
        if k in self.md:
            self.read.add(k)
            return self.md[k]
        if default is None:
            raise ModelFileError(f"{self.path}: metadata key {k!r} is missing for architecture {self.arch!r}")
        return default

    def integer(self, key: str, default=None, *, top: int | None = None) -> int:
        """An integer in :data:`LIMITS` ``[key]`` (else 1..2**31), or in 0..``top`` when ``top`` is given."""
        k = self.key(key)
        v = self.get(key, default)
        lo, hi = LIMITS.get(key, _INT32) if top is None else (0, top)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
            raise ModelFileError(f"{self.path}: metadata key {k!r} must be an integer in {lo}..{hi} (got "
                                 f"{type(v).__name__} {str(v)[:40]!r})")
        return int(v)

    def real(self, key: str, default=None) -> float:
        """A finite number > 0."""
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v) or v <= 0:
            raise ModelFileError(f"{self.path}: metadata key {self.key(key)} must be a finite number > 0 (got "
                                 f"{type(v).__name__} {str(v)[:40]!r})")
        return float(v)

    def check_all_read(self) -> None:
        """ModelFileError naming the first key of this architecture (``{arch}.*``) that was not read.

        An architecture reads every key it implements, the ones without effect on the forward pass
        included (``context_length``); a key it did not read may change the forward pass (soft-capping,
        an expert count, a RoPE variant) and running without it would be silently wrong, so the file is
        refused instead."""
        prefix = self.arch + "."
        unread = sorted(k for k in self.md if k.startswith(prefix) and k not in self.read)
        if unread:
            k = unread[0]
            more = f" (and {len(unread) - 1} more: {', '.join(unread[1:4])})" if len(unread) > 1 else ""
            raise ModelFileError(
                f"{self.path}: metadata key {k!r} = {str(self.md[k])[:40]!r}{more} is not implemented for "
                f"architecture {self.arch!r}; it may change the forward pass, so the model is refused rather "
                f"than run approximately. Keys implemented: {', '.join(sorted(self.read))}")


def check_tensor_names(n_layers: int, names, path: str) -> None:
    """Before any tensor is read: the file's layer count agrees with the blocks it holds.

    Raises
    ------
    ModelFileError
        ``block_count`` names a layer with no tensors, or the file holds tensors of a layer past it.
    """
    names = set(names)
    for t in (MODEL_TENSOR.TOKEN_EMBD, MODEL_TENSOR.OUTPUT_NORM):
        key = TENSOR_NAMES[t] + ".weight"
        if key not in names:
            raise ModelFileError(f"{path}: tensor {key!r} is missing")
    prefix = TENSOR_NAMES[MODEL_TENSOR.ATTN_NORM].partition("{bid}")[0]         # "blk."
    blocks = {int(n.split(".")[1]) for n in names if n.startswith(prefix) and n.split(".")[1].isdigit()}
    want = set(range(n_layers))
    if blocks != want:
        extra = sorted(blocks - want)[:3]
        missing = sorted(want - blocks)[:3]
        raise ModelFileError(f"{path}: metadata says block_count={n_layers}, the file holds tensors of "
                             f"{len(blocks)} blocks" + (f" (missing blk.{missing[0]}...)" if missing else "")
                             + (f" (extra blk.{extra[0]}...)" if extra else ""))
