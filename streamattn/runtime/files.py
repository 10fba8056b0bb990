"""The one way streamattn reads a file it was handed: regular files only, the size checked first.

A path from a user may name a FIFO (reading it blocks until someone writes), a device (``/dev/zero`` and
``/dev/urandom`` never end, ``/dev/full`` reads as zeros), a directory, or a file far larger than what
the caller can use. :func:`open_regular` opens without blocking and refuses everything but a regular file
by name; :func:`read_bytes` and :func:`read_text` then compare the file's size with the caller's limit
*before* allocating anything, and read at most that many bytes even if the file grows meanwhile.

Every refusal is a :class:`BadFile` (a ``ValueError``) whose message starts with the path and says what
was expected; a missing or unreadable path stays the operating system's ``OSError``, which names it.
"""

from __future__ import annotations

import os
import stat


class BadFile(ValueError):
    """The path is not a regular file, or holds more than the caller accepts; the message names it."""


class ModelFileError(ValueError):
    """A model file is missing, truncated, corrupt or of an unsupported architecture. Raised by the file
    readers (:mod:`streamattn.gguf`) and by the model configuration read from them
    (:mod:`streamattn.models.config`): it lives here, below both, so that neither package imports the
    other's errors (tests/test_layout.py refuses package cycles)."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind(mode: int) -> str:
    """'a directory', 'a FIFO (named pipe)', ... for an ``st_mode`` that is not a regular file."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path, mode: str = "rb", *, what: str = "file"):
    """Open ``path`` for reading ("rb" or "r+b") if it is a regular file; :class:`BadFile` otherwise.

    The file is opened with ``O_NONBLOCK`` (a FIFO does not block the open) and checked with ``fstat`` on
    the open descriptor (no race with a rename between the check and the open).
    """
    flags = {"rb": os.O_RDONLY, "r+b": os.O_RDWR}[mode]
    p = os.fspath(path)
    fd = os.open(p, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadFile(f"{p}: is {kind(st.st_mode)}; expected a regular {what}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def check_regular(path, *, what: str = "file") -> None:
    """Refuse an existing ``path`` that is not a regular file (for paths about to be written)."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise BadFile(f"{p}: is {kind(st.st_mode)}; expected a regular {what}")


def check_writable(path, *, what: str = "output file") -> None:
    """Refuse, before any work, an output path that cannot be written: a folder, a device or FIFO, a
    missing or unwritable parent folder. (Writing may still fail later: a full disk.)"""
    p = os.fspath(path)
    check_regular(p, what=what)
    parent = os.path.dirname(os.path.abspath(p))
    if not os.path.isdir(parent):
        raise BadFile(f"{p}: its folder {parent} does not exist; expected a writable {what}")
    if not os.access(parent if not os.path.exists(p) else p, os.W_OK):
        raise BadFile(f"{p}: not writable; expected a writable {what}")


def read_bytes(path, *, limit: int, what: str = "file") -> bytes:
    """The whole of a regular file holding at most ``limit`` bytes; :class:`BadFile` if it holds more.

    Examples
    --------
    >>> read_bytes("/dev/zero", limit=1 << 20)     # doctest: +SKIP
    BadFile: /dev/zero: is a character device; expected a regular file
    """
    with open_regular(path, what=what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise BadFile(f"{os.fspath(path)}: {what} of {size} bytes; at most {limit} bytes are accepted")
        data = f.read(size + 1)
    if len(data) > size:                          # grew while we read it
        raise BadFile(f"{os.fspath(path)}: {what} grew past {size} bytes while being read")
    return data


def read_text(path, *, limit: int, what: str = "text file") -> str:
    """:func:`read_bytes` decoded as UTF-8; invalid bytes are a :class:`BadFile` naming the byte offset."""
    data = read_bytes(path, limit=limit, what=what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadFile(f"{os.fspath(path)}: not UTF-8 text (byte {e.start}: {data[e.start:e.start + 4]!r}); "
                      f"expected a UTF-8 {what}") from None


def same_file(a, b) -> bool:
    """Whether two existing paths name the same file (False if either does not exist)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def short(value, n: int = 60) -> str:
    """``repr(value)`` cut to about ``n`` characters, with the full length: error messages quote input
    without echoing megabytes of it."""
    r = repr(value)
    if len(r) <= n:
        return r
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(r)} characters as text"
    return f"{r[:n]}... ({size})"


__all__ = ["BadFile", "check_regular", "check_writable", "kind", "open_regular", "read_bytes", "read_text",
           "same_file", "short"]
