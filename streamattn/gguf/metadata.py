"""Bounds and cross-checks of GGUF metadata, applied before any tensor is read (see docs/SECURITY.md)."""

from __future__ import annotations



class ModelFileError(ValueError):
    """A model file is missing, truncated, corrupt or of an unsupported architecture (also
    ``streamattn.models.loader.ModelFileError``)."""


# Bounds of the integer metadata (inclusive): far above real models, low enough that a hostile value is
# refused before it sizes anything (block_count 1e7 would build tuples and dictionaries of that length).
LIMITS = {"block_count": (1, 1 << 12), "embedding_length": (1, 1 << 17), "attention.head_count": (1, 1 << 12),
          "attention.head_count_kv": (1, 1 << 12), "attention.key_length": (1, 1 << 14),
          "feed_forward_length": (1, 1 << 19), "vocab_size": (1, 1 << 24), "context_length": (1, 1 << 31),
          "attention.sliding_window": (1, 1 << 31)}


def check_tensor_names(config: "ModelConfig", names, path: str) -> None:
    """Before any tensor is read: the file's layer count agrees with the blocks it holds.

    Raises
    ------
    ModelFileError
        ``block_count`` names a layer with no tensors, or the file holds tensors of a layer past it.
    """
    names = set(names)
    for key in ("token_embd.weight", "output_norm.weight"):
        if key not in names:
            raise ModelFileError(f"{path}: tensor {key!r} is missing")
    blocks = {int(n.split(".")[1]) for n in names if n.startswith("blk.") and n.split(".")[1].isdigit()}
    want = set(range(config.n_layers))
    if blocks != want:
        extra = sorted(blocks - want)[:3]
        missing = sorted(want - blocks)[:3]
        raise ModelFileError(f"{path}: metadata says block_count={config.n_layers}, the file holds tensors of "
                             f"{len(blocks)} blocks" + (f" (missing blk.{missing[0]}...)" if missing else "")
                             + (f" (extra blk.{extra[0]}...)" if extra else ""))
