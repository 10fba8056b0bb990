"""Numba's on-disk cache keys a compiled function on its own source file only, not on the LLVM IR it
inlines nor on other compiled functions it calls: after such a file changes (a git pull, an edit), the
cached code would still run the old version. :func:`drop_when_changed` keeps a stamp of those files
beside the cache and clears the cache once when the stamp differs (the CPU attention kernels,
streamattn/backends/cpu.py; the packed matmuls, streamattn/quant/matmul.py).

:func:`variant` names each compiled copy of a closure apart; :func:`lock_cache_saves` makes the saves of
processes sharing a cache directory take turns."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

try:
    import fcntl
except ImportError:                 # not POSIX: saves stay unlocked
    fcntl = None


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


def lock_cache_saves() -> bool:
    """Serialise Numba's cache saves across processes: each save holds an exclusive ``flock`` on a file
    beside the function's index (``<index>.lock``). Returns whether the lock is in place.

    Why: a save reads the index, picks the first data-file number no entry uses, then writes the index
    and the data. Two processes compiling different specialisations of one function at once (pytest
    workers, Ray workers, two CLIs after an upgrade) both pick the same number; the index then names
    one's key beside the other's code, and a later process loads the wrong machine code under that
    key — seen here as ``'descr' is NULL`` when a packed-matmul driver of one weight kind ran with
    another kind's environment (docs/DESIGN.md §14). Loads need no lock: the data file is written to
    a temporary name and renamed, and an entry whose file is not there yet is a cache miss."""
    if fcntl is None:
        return False
    try:
        from numba.core import caching
        cls = caching.IndexDataCacheFile
        save = cls.save
    except (ImportError, AttributeError):    # numba's internals moved: saves stay as they are
        return False
    if getattr(save, "locked_by_streamattn", False):
        return True

    def locked_save(self, key, data):
        try:
            fd = os.open(f"{self._index_path}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        except (OSError, AttributeError):
            return save(self, key, data)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return save(self, key, data)
        finally:
            os.close(fd)                     # (releases the lock)

    locked_save.locked_by_streamattn = True
    cls.save = locked_save
    return True


def variant(fn, tag: str):
    """``fn`` (a closure from a kernel factory) renamed ``<qualname>__<tag>``, before it is jitted with
    ``cache=True``; returns it.

    Numba names a compiled function's environment (its constants: dtype objects, strings) after its
    qualname, argument types and a per-process counter, and a process that loads a second function
    whose environment name is taken reuses the first one's (``numba.core.environment._rebuild_env``).
    Copies of one closure (the serial and parallel loops, the packed-matmul drivers of each weight
    kind) share qualname and argument types, so two of them compiled by different processes at the
    same counter value collided once both were loaded: a driver then read another's constants
    (``'descr' is NULL`` under pytest's two workers, docs/DESIGN.md §14). ``tag`` must tell the copies
    of a closure apart and be usable in a file name (it also names the copy's cache files)."""
    fn.__qualname__ = f"{fn.__qualname__}__{tag}"
    return fn
