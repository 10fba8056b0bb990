"""A file of packed weights: :class:`~streamattn.quant.weights.QWeight` planes written once, then mapped by
every process that loads the same model, so that they share its pages (docs/DESIGN.md §19,
"The packed weights on disk").

Layout (little-endian)::

    bytes 0 .. 63        header: MAGIC (8), FORMAT u32, 0 u32, index offset u64, index length u64,
                         SHA-256 of the index (32)
    PAGE .. payload end  the planes, each at a multiple of ALIGN bytes, zero bytes between them
    index offset ..      the index: UTF-8 JSON {"key", "chunk", "crc", "end", "weights"}

``key`` is the caller's (what the planes were built from: a file's identity, the layout version, the
CPU target); ``crc`` the CRC-32 of each ``chunk`` bytes of the payload from PAGE to ``end``;
``weights`` one entry per matrix, in the order they were written: its key (a tensor name, or a list of
names for a fused row group), the QWeight's fields, and each plane's dtype, shape and offset (in this
file, or ``"source"``: at that offset of the model file itself, where a plane is the file's bytes
unchanged).

:func:`write` writes under a temporary name and renames (a reader never sees half a file; of two writers
the last rename wins, both whole). :func:`read` checks the header, the index's SHA-256, the key, every
plane's bounds and every chunk's CRC-32 before it returns views: a damaged or stale file is a
:class:`Miss`, never wrong weights. With ``verify="changed"`` the CRC-32s are read only when the file
changed since they last held: ``<file>.verified`` records the file's status (device, inode, size, mtime,
ctime) and its index's SHA-256 at its last whole check (docs/DESIGN.md §19 says what this leaves out).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from streamattn.quant.weights import KINDS, QWeight, layout_error

MAGIC = b"SAPACKED"
#: The container's own version (this module's layout of header, payload and index).
FORMAT = 1
PAGE = 4096
ALIGN = 64                    # every plane starts on a cache line, as weights.move_planes places them
CHUNK = 16 << 20              # bytes per CRC-32: a file verifies in parallel, a chunk at a time
_HEADER = struct.Struct("<8sIIQQ32s")
_DTYPES = ("uint8", "uint16", "float32")
_PLANES = ("qs", "scale", "minv")
#: A whole check is recorded only for a file whose status changed at least this many seconds before: a
#: write within one tick of the file system's clock could otherwise leave ctime as recorded.
SETTLE_S = 2.0
STAMP = ".verified"           # the suffix of the record of a file's last whole check


class Miss(Exception):
    """No usable packed file: absent, stale (another key) or damaged; the message says which."""


def _crc_of(view) -> int:
    return zlib.crc32(view)       # (zlib releases the GIL on buffers this size: chunks verify in parallel)


class _Crcs:
    """The CRC-32 of each CHUNK bytes of a stream written in pieces."""

    def __init__(self):
        self.done, self.crc, self.filled = [], 0, 0

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(CHUNK - self.filled, len(data))
            self.crc = zlib.crc32(data[:take], self.crc)
            self.filled += take
            data = data[take:]
            if self.filled == CHUNK:
                self.done.append(self.crc)
                self.crc, self.filled = 0, 0

    def finish(self) -> list:
        return self.done + ([self.crc] if self.filled else [])


def write(path, key: dict, owners, *, source=None) -> None:
    """Write the (key, QWeight) pairs of the iterable ``owners`` to a packed file at ``path``, in that order.

    Each weight is written, then dropped (``owners`` may be a generator that packs the next one meanwhile:
    one weight in memory at a time). A plane that is a C-contiguous view of ``source`` (the model file's
    map, a uint8 array) is recorded by its offset there instead of copied. The file is written under a
    temporary name in the same folder and renamed over ``path``; on any error the temporary file is
    removed and the error raised (OSError for a full disk or an unwritable folder).
    """
    path = os.fspath(path)
    src = None if source is None else (source.ctypes.data, source.nbytes)
    with _replacing(path, "b") as f:
        f.write(bytes(PAGE))                          # the header's place, written last
        crcs, at, entries = _Crcs(), PAGE, []
        for wkey, w in owners:
            planes = []
            for name in _PLANES:
                p = getattr(w, name)
                if p is None:
                    planes.append(None)
                    continue
                where = _within(p, src)
                if where is not None:
                    planes.append({"dtype": p.dtype.name, "shape": list(p.shape), "source": where})
                    continue
                pad = -at % ALIGN
                if pad:
                    crcs.update(memoryview(bytes(pad)))
                    f.write(bytes(pad))
                    at += pad
                data = memoryview(np.ascontiguousarray(p)).cast("B")
                crcs.update(data)
                f.write(data)
                planes.append({"dtype": p.dtype.name, "shape": list(p.shape), "offset": at})
                at += p.nbytes
            entries.append({"key": list(wkey) if isinstance(wkey, tuple) else wkey, "kind": w.kind,
                            "shape": list(w.shape), "group": w.group, "source": w.source, "lanes": w.lanes,
                            "planes": planes})
            del w, p
        index = json.dumps({"key": key, "chunk": CHUNK, "crc": crcs.finish(), "end": at,
                            "weights": entries}, separators=(",", ":")).encode()
        f.write(index)
        f.seek(0)
        f.write(_HEADER.pack(MAGIC, FORMAT, 0, at, len(index), hashlib.sha256(index).digest()))
    _forget(path)


def _within(p: np.ndarray, src) -> int | None:
    """The offset of plane ``p`` in the map ``src`` ((address, size)) when it is a contiguous range of it."""
    if src is None or not p.flags.c_contiguous:
        return None
    off = p.ctypes.data - src[0]
    return off if 0 <= off and off + p.nbytes <= src[1] else None


def read(path, key: dict, *, source=None, verify: bool | str = True, threads: int | None = None) -> list:
    """The (key, QWeight) pairs of the packed file at ``path``, its planes views of a private map of it.

    Parameters
    ----------
    path : str
        The packed file.
    key : dict
        What the file must have been built from; another key is a :class:`Miss` (stale).
    source : str, optional
        The model file, for planes recorded by their offset in it (mapped the same way).
    verify : bool or "changed"
        True: check every chunk's CRC-32 (default; this reads the whole payload, in ``threads`` threads).
        "changed": the same, unless ``<path>.verified`` shows that they held for this very file (same
        device, inode, size, mtime, ctime and index) at a check made at least :data:`SETTLE_S` seconds after
        its last change; a whole check records itself there (where the folder is writable). False: no
        CRC-32. The header, the index's SHA-256, the key and every plane's bounds are checked either way.

    Returns
    -------
    list of (str or tuple of str, QWeight)
        Fused groups' keys as tuples. The planes are writable arrays over a copy-on-write map: pages are
        the page cache's, shared by every process that maps the file, until one writes (nothing does).

    Raises
    ------
    Miss
        The file is absent, stale or damaged; the message says what was found.
    ValueError
        The file records planes of the model file and ``source`` is None; ``verify`` is none of the three.
    """
    if verify is not True and verify is not False and verify != "changed":
        raise ValueError(f"verify must be True, False or 'changed' (got {verify!r})")
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            st, at, digest, index = _index(f, path)
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise Miss(f"{path}: absent") from None
    except OSError as e:
        raise Miss(f"{path}: cannot be read ({e})") from None
    if index.get("key") != key:
        raise Miss(f"{path}: built for {index.get('key')!r}, not {key!r}: stale")
    whole = np.frombuffer(mm, np.uint8)
    end = index["end"]
    if not PAGE <= end <= at:
        raise Miss(f"{path}: payload end {end} outside {PAGE}..{at}: damaged")
    _advise(mm)
    status = _status(st, digest)
    if verify is True or (verify == "changed" and _stamp(path) != status):
        _verify(path, mm, whole[PAGE:end], index, threads)
        if verify == "changed" and time.time() - st.st_ctime >= SETTLE_S:
            _record(path, status)
    src = None
    if any(isinstance(p, dict) and "source" in p for e in index["weights"] for p in e.get("planes", ())):
        if source is None:
            raise ValueError(f"{path} holds planes of its model file's bytes: give the model file as source=")
        with open(os.fspath(source), "rb") as f:
            smm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        _advise(smm, SOURCE_ADVICE)
        src = np.frombuffer(smm, np.uint8)
    return [_entry(path, e, whole, end, src) for e in index["weights"]]


#: The advice a map of weights gets, in this order, where the platform has it: huge pages (a 2 MiB page
#: cache folio mapped whole; the hardware prefetcher stops at every page's end, docs/PERF.md "One-thread
#: K-quant GEMV and a file's 4 KiB pages"), then read-ahead now, in the background.
ADVICE = ("MADV_HUGEPAGE", "MADV_WILLNEED")

#: The advice the model file's own map gets (for the planes the packed file leaves in it): huge pages only,
#: no read-ahead, as most of the model file is not weights read from that map.
SOURCE_ADVICE = ("MADV_HUGEPAGE",)


def _advise(mm: mmap.mmap, names=None) -> list:
    """Give the map ``mm`` each advice of ``names`` (:data:`ADVICE`) the platform has; the names the kernel took.

    Advice is a hint: one the kernel refuses (OSError, e.g. huge pages disabled) is skipped and the map
    works as before. Huge pages keep the pages the page cache's (shared by every process mapping the file):
    the kernel maps its large folios with PMD entries where the map's address and the file offset are both
    2 MiB-aligned, and places a file map of 2 MiB or more at such an address itself.
    """
    took = []
    if not hasattr(mm, "madvise"):             # Windows' mmap has none
        return took
    for name in ADVICE if names is None else names:
        advice = getattr(mmap, name, None)
        if advice is None:
            continue
        try:
            mm.madvise(advice)
        except OSError:
            continue
        took.append(name)
    return took


def key_of(path) -> dict:
    """The key a packed file was built for, from its header and index alone (no payload byte is read).

    Raises
    ------
    Miss
        Absent, not a packed file, or its index fails its SHA-256.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            key = _index(f, path)[3].get("key")
    except FileNotFoundError:
        raise Miss(f"{path}: absent") from None
    except OSError as e:
        raise Miss(f"{path}: cannot be read ({e})") from None
    return key if isinstance(key, dict) else {}


def _index(f, path: str) -> tuple:
    """(status, index offset, index SHA-256, index) of the open packed file ``f``: header and index checked."""
    st = os.fstat(f.fileno())
    if st.st_size < PAGE + _HEADER.size:
        raise Miss(f"{path}: {st.st_size} bytes, shorter than a header")
    magic, fmt, _, at, length, digest = _HEADER.unpack(f.read(_HEADER.size))
    if magic != MAGIC or fmt != FORMAT:
        raise Miss(f"{path}: not a packed-weights file of format {FORMAT} (magic {magic!r}, format {fmt})")
    if at < PAGE or at + length != st.st_size:
        raise Miss(f"{path}: the index at {at}..{at + length} does not end the file ({st.st_size} bytes): "
                   "truncated or damaged")
    f.seek(at)
    raw = f.read(length)
    if hashlib.sha256(raw).digest() != digest:
        raise Miss(f"{path}: the index does not match its SHA-256: damaged")
    try:
        index = json.loads(raw)
    except ValueError as e:
        raise Miss(f"{path}: the index is not JSON ({e}): damaged") from None
    if not isinstance(index, dict):
        raise Miss(f"{path}: the index is not a JSON object: damaged")
    return st, at, digest, index


def remove(path) -> None:
    """Delete a packed file and the record of its last check (absent ones are fine). Processes that map
    it keep their pages until they unmap them."""
    for p in (os.fspath(path), os.fspath(path) + STAMP):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _verify(path, mm, payload: np.ndarray, index: dict, threads: int | None) -> None:
    chunk, crcs = index["chunk"], index["crc"]
    starts = range(0, len(payload), chunk)
    if len(starts) != len(crcs):
        raise Miss(f"{path}: {len(crcs)} checksums for {len(starts)} chunks: damaged")
    views = [memoryview(payload[a:a + chunk]) for a in starts]
    workers = threads or min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        got = list(pool.map(_crc_of, views))
    bad = [i for i, (a, b) in enumerate(zip(got, crcs)) if a != b]
    if bad:
        raise Miss(f"{path}: bytes {bad[0] * chunk + PAGE}..{(bad[0] + 1) * chunk + PAGE} (and {len(bad) - 1} "
                   "more chunks) do not match their CRC-32: damaged")


def _status(st, digest: bytes) -> dict:
    """What identifies one state of a file: any write, truncation, rename over it or chmod changes one field."""
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "index_sha256": digest.hex()}


def _stamp(path: str) -> dict | None:
    try:
        with open(path + STAMP, "rb") as f:
            got = json.loads(f.read(4096))
        return got if isinstance(got, dict) else None
    except (OSError, ValueError):
        return None


def _record(path: str, status: dict) -> None:
    """Write ``<path>.verified`` atomically; a folder that cannot be written keeps whole checks."""
    try:
        with _replacing(path + STAMP, "") as f:
            json.dump(status, f)
    except OSError:
        pass


@contextlib.contextmanager
def _replacing(path: str, binary: str):
    """A file opened for writing (mode ``"w" + binary``) under a temporary name beside ``path``, renamed
    over it when the block ends; on an error inside the block it is removed and the error raised. Readable
    by other users (mkstemp's 0600 made 0644): a folder may be shared."""
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w" + binary) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _forget(path: str) -> None:
    try:
        os.unlink(path + STAMP)
    except OSError:
        pass


def _entry(path, e: dict, whole: np.ndarray, end: int, src) -> tuple:
    try:
        kind, shape, lanes = e["kind"], tuple(int(n) for n in e["shape"]), int(e["lanes"])
        if kind not in KINDS or len(shape) != 2:
            raise ValueError(f"kind {kind!r}, shape {shape}")
        planes = [None if p is None else _plane(p, whole, end, src) for p in e["planes"]]
        key = tuple(e["key"]) if isinstance(e["key"], list) else e["key"]
        w = QWeight(kind, shape, *planes, int(e["group"]), str(e["source"]), lanes)
        wrong = layout_error(w)             # planes that do not fit their weight: kernels would read past them
        if wrong:
            raise ValueError(wrong)
        return key, w
    except (KeyError, TypeError, ValueError) as err:
        raise Miss(f"{path}: entry {str(e.get('key'))[:80]} is malformed ({err}): damaged") from None


def _plane(p: dict, whole: np.ndarray, end: int, src) -> np.ndarray:
    if p["dtype"] not in _DTYPES:
        raise ValueError(f"dtype {p['dtype']!r}")
    dtype, shape = np.dtype(p["dtype"]), tuple(int(n) for n in p["shape"])
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    base, lo, hi = (src, 0, None if src is None else len(src)) if "source" in p else (whole, PAGE, end)
    at = int(p["source"] if "source" in p else p["offset"])
    if base is None or not lo <= at <= at + n <= hi or at % dtype.itemsize:
        raise ValueError(f"plane of {n} bytes at {at} outside {lo}..{hi}")
    return base[at:at + n].view(dtype).reshape(shape)
