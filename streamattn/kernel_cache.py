"""Numba's on-disk cache keys a compiled function on its own source file only, not on the LLVM IR it
inlines nor on other compiled functions it calls: after such a file changes (a git pull, an edit), the
cached code would still run the old version. :func:`drop_when_changed` keeps a stamp of those files
beside the cache and clears the cache once when the stamp differs (the CPU attention kernels,
streamattn/backends/cpu.py; the packed matmuls, streamattn/quant/matmul.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def drop_when_changed(files, marker: str, cache_dir, clear) -> None:
    """Call ``clear(directory)`` and record the new stamp when the sha256 of ``files`` differs from the one
    in ``directory / marker`` (``directory = cache_dir()``). Does nothing where the cache is not
    writable or Numba's internals moved (the cache then only misses)."""
    try:
        stamp = hashlib.sha256(b"".join(Path(f).read_bytes() for f in files)).hexdigest()
        directory = Path(cache_dir())
        path = directory / marker
        if not path.exists() or path.read_text() != stamp:
            clear(directory)
            path.write_text(stamp)
    except (OSError, AttributeError, IndexError):
        pass
