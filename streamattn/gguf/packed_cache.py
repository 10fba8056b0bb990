"""The packed weights of a GGUF file cached on disk: where, under which key, and the load that maps them
or builds them once (docs/DESIGN.md §19, "The packed weights on disk").

Where: ``$STREAMATTN_PACKED_CACHE`` (a folder; ``off`` disables the cache), else ``packed/`` beside the
pulled models (:func:`streamattn.gguf.hub.cache_dir`). One file per model file and CPU target, named after
the model file's stem and a digest of its real path; files of less than :data:`MIN_BYTES` are packed in
memory unless a folder is given explicitly (their packing takes milliseconds).

The key a cached file must match (:func:`key`): the GGUF file's size, modification time and the SHA-256
of its header and tensor table (the bytes before the tensor data: names, types, shapes, offsets and all
metadata; the tensor data is not read), :data:`LAYOUT_VERSION`, a digest of the source files that decide
the packed layout, and the rows per interleaved group the kernels take (``quant.kernels.LANES``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path

from streamattn.quant import packed_file

ENV = "STREAMATTN_PACKED_CACHE"
_OFF = ("", "0", "off", "no", "none", "false")
#: Model files smaller than this are packed in memory by default (a folder given to load_gguf caches any).
MIN_BYTES = 32 << 20
#: Bumped whenever a packed layout or the order of the planes changes; the source digest in the key
#: catches an edit that forgot to (a stale layout read as current would be wrong weights).
LAYOUT_VERSION = 1
#: The modules whose code decides the bytes of a packed file (relative to the streamattn package).
LAYOUT_SOURCES = ("quant/weights.py", "quant/repack.py", "quant/levels.py", "quant/arrange.py",
                  "quant/packed_file.py")
#: Every rows-per-group a packed file can have (``quant.kernels.LANES``: 8 for AVX2, 16 for AVX-512): one
#: model file has at most one packed file per value in a folder.
ALL_LANES = (8, 16)


def folder(option, size: int) -> Path | None:
    """The cache folder for a model file of ``size`` bytes, or None (packed in memory).

    ``option``: False (no cache), a folder (that one, whatever the size), or None: ``$STREAMATTN_PACKED_CACHE``
    (``off`` disables), else ``<models cache>/../packed``, for files of at least :data:`MIN_BYTES` (True: for
    any file)."""
    if option is False:
        return None
    if option is not None and option is not True:
        return Path(option)
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env)
    if size < MIN_BYTES and option is None:
        return None
    from streamattn.gguf.hub import cache_dir
    return cache_dir().parent / "packed"


@functools.cache
def _sources_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for rel in LAYOUT_SOURCES:
        try:
            h.update(hashlib.sha256((root / rel).read_bytes()).digest())
        except OSError:                    # a source not readable as a file (a zipped install)
            from streamattn import __version__
            return f"version {__version__}"
    return h.hexdigest()


def key(path: str, header: memoryview, lanes: int) -> dict:
    """What a packed file of the GGUF at ``path`` must have been built from (``header``: its bytes before
    the tensor data, :attr:`streamattn.gguf.reader.GGUFFile.header`)."""
    st = os.stat(path)
    return {"gguf": {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                     "header_sha256": hashlib.sha256(header).hexdigest()},
            "layout": LAYOUT_VERSION, "sources": _sources_digest(), "lanes": lanes}


def file_for(where: Path, path: str, lanes: int) -> Path:
    """The packed file in folder ``where`` for the GGUF at ``path`` and ``lanes``."""
    real = os.path.realpath(path)
    digest = hashlib.sha256(f"{real}\0{lanes}".encode()).hexdigest()[:16]
    return where / f"{Path(real).stem}.{digest}.packed"


def load(where: Path, path: str, want: dict, build, *, source=None, lanes: int, check=None) -> list | None:
    """The model's packed weights as ``(key, QWeight)`` pairs mapped from its packed file in ``where``,
    building the file first when it is absent, stale or damaged; None where the folder cannot be used (a
    RuntimeWarning says why, and the caller packs in memory).

    ``want``: :func:`key`; ``build()``: an iterable of the pairs, packed (called at most once, under an
    exclusive lock on ``<file>.lock``, so that concurrent loaders of one model build it once: the others
    wait, then map the file the first wrote); ``source``: the GGUF file's map (planes that are its bytes
    are recorded by offset, :func:`streamattn.quant.packed_file.write`); ``check(pairs)``: what is wrong with
    a file's weights for this model (the names and shapes it expects), or None; a file it refuses is
    rebuilt.

    The CRC-32s of a mapped file are read when it changed since they last held
    (``packed_file.read(verify="changed")``). A rebuild replaces the file of the same name; after it, this
    model file's packed files for other lanes (:data:`ALL_LANES`) that were built from an older version of
    it (an earlier mtime) are deleted, each under its own lock, skipped while another process holds that
    lock, so that no packed file of an old version stays behind; a failure there leaves the file and does
    not undo the rebuild."""
    target = file_for(where, path, lanes)

    def mapped():
        got = packed_file.read(target, want, source=path, verify="changed")
        wrong = check(got) if check is not None else None
        if wrong:
            raise packed_file.Miss(f"{target}: {wrong}")
        return got

    try:
        return mapped()
    except packed_file.Miss:
        pass
    try:
        where.mkdir(parents=True, exist_ok=True)
        with _locked(target):
            try:                               # another process may have built it while this one waited
                return mapped()
            except packed_file.Miss:
                pass
            for old in where.glob(target.name + ".*.tmp"):   # left by a writer that died (writers hold the lock)
                old.unlink(missing_ok=True)
            packed_file.write(target, want, build(), source=source)
            _drop_old_versions(where, path, lanes, want)
            return packed_file.read(target, want, source=path, verify=False)   # (just written from memory)
    except (OSError, packed_file.Miss) as e:
        warnings.warn(f"packed-weights cache {where}: {e}; packing {path} in memory instead (set {ENV} to a "
                      f"writable folder, or to 'off')", RuntimeWarning, stacklevel=3)
        return None


def _drop_old_versions(where: Path, path: str, lanes: int, want: dict) -> None:
    """Delete the packed files of ``path`` for lanes other than ``lanes`` built from an older version of the
    model file than ``want``'s (an earlier mtime): a file for another CPU target built from this version
    or a newer one stays, so two hosts sharing the folder with copies of one model made at different times
    do not delete each other's files. Best effort: a file that cannot be locked or deleted stays."""
    for other in ALL_LANES:
        f = file_for(where, path, other)
        if other == lanes or not f.exists():
            continue
        try:
            with _locked(f, wait=False) as lock:
                if not lock.held:              # being built or rebuilt now: that builder decides
                    continue
                try:
                    got = packed_file.key_of(f).get("gguf")
                except packed_file.Miss:
                    continue                   # damaged: its own loader rebuilds it
                if isinstance(got, dict) and got != want["gguf"] \
                        and isinstance(got.get("mtime_ns"), int) and got["mtime_ns"] < want["gguf"]["mtime_ns"]:
                    packed_file.remove(f)
        except OSError:
            continue                           # (a lock file or folder this user may not write)


class _locked:
    """An exclusive ``flock`` on ``<target>.lock`` for the ``with`` block (none where fcntl is missing);
    ``wait=False``: try once, and ``held`` says whether it was taken."""

    def __init__(self, target: Path, *, wait: bool = True):
        self.path = f"{target}.lock"
        self.fd = None
        self.wait = wait
        self.held = False

    def __enter__(self):
        try:
            import fcntl
        except ImportError:
            self.held = True
            return self
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return self
        except OSError:
            os.close(self.fd)
            self.fd = None
            raise
        self.held = True
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)               # (releases the lock)
