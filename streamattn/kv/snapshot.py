"""Snapshots of cache state in a file: save, load, restore, and one sequence at a time.

What is saved is a cache's whole state (spec, K/V, lengths, last_counts, held_from; see ``streamattn.kv.state``),
for one cache or a model's list of per-layer caches, as ``KVCache.export_state`` gives it; loading builds
caches with ``KVCache.from_state`` and writes single sequences with ``KVCache.write_sequence``.

File format ``streamattn-kv``, version 4
-----------------------------------------
An uncompressed ``.npz`` (a zip of ``.npy`` members; read with ``allow_pickle=False``):

    meta                         uint8 [n], UTF-8 JSON:
                                 {"format": "streamattn-kv", "version": 4, "layout": "cache" | "layers",
                                  "layers": [{"spec": {CacheSpec fields}, "slots": S, "used": U}, ...],
                                  "sha256": "<hex digest of the payload>"}
    layer{i}.k, layer{i}.v       [batch, kv_heads, U, width], storage dtype: slots 0 .. U-1 (width: head_dim,
                                 or a quantized row's bytes; K and V each by its own dtype)
    layer{i}.lengths             int64 [batch]
    layer{i}.last_counts         int64 [batch]
    layer{i}.held_from           int64 [batch]
    layer{i}.sink_k, .sink_v     ``sink_dtype`` [batch, kv_heads, n_s, head_dim]: only for a spec with a
                                 ``sink_dtype`` (then slots 0 .. n_s-1 of k and v are zero)

Version 5 allows ``sink_dtype`` "float32" (float32 sink members: the default where K or V is float32 and
the other quantized; version 4 kept those sinks in float16, and such files load as they were written,
with their explicit "float16"). Version 4 added the spec's ``rotate_k`` (keys stored as ``k @ H``,
:mod:`streamattn.kv.rotation`): a rotated cache's key bytes mean nothing without it. Files of versions 1 to 3
hold unrotated keys and load as ``rotate_k=False`` (so a version-3 q4_0 file restores into a q4_0 cache
only with ``rotate_k=False``, refused by name otherwise). Version 3 added the spec's ``sink_dtype`` and
the float16 sink members; version 1 and 2 files have no ``sink_dtype`` key and load as
``sink_dtype=None`` (their sinks were stored like every other token). Version 2 added the spec's
``dtype_v`` and the quantized dtypes q8_0 / q4_0 (uint8 members of GGUF blocks, stored as written: a
restore never re-quantizes). Version 1 files (float storage, one dtype for K and V, no ``dtype_v`` key)
still load; what they hold reads the same.

``U = min(S, max(lengths))``. Slots at or past U hold zeros (a slot that holds no current position is
zero: appends never write there, rewinds and resets zero what they drop), so a load allocates S zeroed
slots and fills the first U: the restored arrays are bit-identical to the saved ones. S is stored
because a causal cache's capacity grows. The digest is sha256 over the meta JSON without its "sha256"
key (sorted keys) and then every array member in name order as name, dtype, shape and raw bytes; the
zip's own CRC-32 also catches flipped bits. npz because numpy alone reads and writes it (no extra
dependency; safetensors is not installed here) and it loads without pickle.

Writes are atomic: a temporary file in the target's folder, flush + fsync, ``os.replace``, then an
fsync of the folder. A crash leaves the old file or the new one under the final name, never half of one.
Loads are all or nothing: the whole file is read and checked (checksum, version, shapes, spec) before
anything is built or written, so a bad file raises ``StateFileError`` and the target cache is untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import struct
import tempfile
import zipfile

import numpy as np

from ..runtime.arrays import check_sequence_index
from ..runtime.files import BadFile, read_bytes
from .cache import KVCache
from .spec import POLICY_FIELDS, CacheSpec

FORMAT = "streamattn-kv"
VERSION = 5
_READS = (1, 2, 3, 4, 5)   # versions this module loads (1: before quantized and split K/V dtypes; 2: before
                           # float16 sinks; 3: before rotate_k; 4: before float32 sinks)
_V1_DTYPES = ("float32", "float16", "bfloat16")
_FIELDS = ("k", "v", "lengths", "last_counts", "held_from")
_SINK_FIELDS = ("sink_k", "sink_v")  # members of a layer whose spec keeps its sinks apart


class StateFileError(ValueError):
    """A state file that cannot be used: the message names the file and the problem; nothing changed."""


# -- save ----------------------------------------------------------------------------------------
def save(path, caches) -> None:
    """Snapshot a cache, or a model's list of per-layer caches, to one file, atomically.

    Parameters
    ----------
    path : str or os.PathLike
        Written exactly as given (no suffix added); ``.npz`` is the natural suffix.
    caches : KVCache or list of KVCache

    Examples
    --------
    >>> cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=8, window=4))
    >>> save("/tmp/kv.npz", cache); load("/tmp/kv.npz").lengths.tolist()
    [0, 0]
    """
    layers = [caches] if isinstance(caches, KVCache) else list(caches)
    _write(path, "cache" if isinstance(caches, KVCache) else "layers",
           [_record(c, c.spec, slice(None)) for c in _check_caches(layers)])


def save_sequence(path, caches, b: int) -> None:
    """Snapshot sequence ``b`` of a cache (or of every layer) as a batch-1 file (llama.cpp #5843).

    Load it into any sequence of a cache with the same spec but any batch with :func:`load_sequence`,
    or as a batch-1 cache with :func:`load`.
    """
    layers = [caches] if isinstance(caches, KVCache) else list(caches)
    for c in _check_caches(layers):
        check_sequence_index("b", b, c.spec.batch)
    _write(path, "cache" if isinstance(caches, KVCache) else "layers",
           [_record(c, dataclasses.replace(c.spec, batch=1), slice(b, b + 1)) for c in layers])


def _record(cache: KVCache, spec: CacheSpec, rows: slice):
    arrays = cache.export_state(rows)
    return {"spec": dataclasses.asdict(spec), "slots": cache.slots, "used": arrays["k"].shape[2]}, arrays


def _write(path, layout: str, records) -> None:
    arrays = {f"layer{i}.{name}": a for i, (_, layer) in enumerate(records) for name, a in layer.items()}
    meta = {"format": FORMAT, "version": VERSION, "layout": layout, "layers": [m for m, _ in records]}
    meta["sha256"] = _digest(meta, arrays)
    arrays["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (not possible on every OS)
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _digest(meta: dict, arrays: dict) -> str:
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.data)
    return h.hexdigest()


# -- load ----------------------------------------------------------------------------------------
def load(path, *, spec=None, device: str = "cpu", max_bytes: int | None = None):
    """New cache(s) from a snapshot: a KVCache if a cache was saved, a list if a list was saved.

    Parameters
    ----------
    spec : CacheSpec or list of CacheSpec, optional
        What the caller expects; a file saved with another spec (``check_finite`` aside) is refused.
    device : {"cpu", "gpu"}
        Where the new caches live, whichever device the file was saved from.
    max_bytes : int, optional
        Refuse a file whose specs ask for more K/V storage than this (default: the physical memory);
        checked before anything is allocated.

    Raises
    ------
    StateFileError
        Truncated, corrupted (checksum), wrong format or version, inconsistent, another spec, too large,
        or anything else that goes wrong while reading it: no other exception escapes a bad file.
    """
    meta, layers = _read(path, max_bytes)
    want = None if spec is None else ([spec] if isinstance(spec, CacheSpec) else list(spec))
    specs = [CacheSpec(**m["spec"]) for m in meta["layers"]]
    if want is not None:
        _match_all(path, specs, want, ignore=POLICY_FIELDS)
        specs = want
    with _allocating(path):
        caches = [KVCache.from_state(s, arrays, slots=m["slots"], device=device)
                  for s, m, arrays in zip(specs, meta["layers"], layers)]
    return caches[0] if meta["layout"] == "cache" else caches


@contextlib.contextmanager
def _allocating(path):
    """Storage the file asked for that the machine cannot give: StateFileError, nothing changed."""
    try:
        yield
    except MemoryError as e:
        raise StateFileError(f"{os.fspath(path)}: not enough memory for the storage this file asks for "
                             f"({e or 'MemoryError'}); pass a smaller max_bytes to refuse such files early") from e


def restore(target, path, *, max_bytes: int | None = None) -> None:
    """Restore a snapshot into existing cache(s) in place, all or nothing.

    ``target`` is a KVCache or a list (one per layer); each must have the spec the file was saved with
    (``check_finite`` aside). On any error the targets are bit-for-bit unchanged; a bad file raises
    ``StateFileError`` (``max_bytes`` as in :func:`load`).
    """
    caches = [target] if isinstance(target, KVCache) else list(target)
    meta, layers = _read(path, max_bytes)
    _match_all(path, [CacheSpec(**m["spec"]) for m in meta["layers"]], [c.spec for c in _check_caches(caches)],
               ignore=POLICY_FIELDS)
    with _allocating(path):
        staged = [KVCache.from_state(c.spec, arrays, slots=m["slots"], device=c.device)  # build everything first
                  for c, m, arrays in zip(caches, meta["layers"], layers)]
    for c, new in zip(caches, staged):                                              # ... then swap: cannot fail
        c.take_state(new)


def load_sequence(path, caches, b: int, *, max_bytes: int | None = None) -> None:
    """Load a :func:`save_sequence` file into sequence ``b`` of a cache (or of every layer), all or nothing.

    The other sequences are untouched; the cache's spec must equal the file's apart from ``batch``.
    A bad file raises ``StateFileError`` (``max_bytes`` as in :func:`load`).
    """
    layers = [caches] if isinstance(caches, KVCache) else list(caches)
    meta, arrays = _read(path, max_bytes)
    for c in _check_caches(layers):
        check_sequence_index("b", b, c.spec.batch)
    specs = [CacheSpec(**m["spec"]) for m in meta["layers"]]
    for i, s in enumerate(specs):
        if s.batch != 1:
            raise StateFileError(f"{path}: layer {i} holds a batch of {s.batch} sequences; load_sequence "
                                 "needs a file from save_sequence (batch 1); use load or restore")
    _match_all(path, specs, [c.spec for c in layers], ignore=POLICY_FIELDS + ("batch",))
    with _allocating(path):
        for c, a in zip(layers, arrays):  # grow causal caches first (keeps every row): a failure changes nothing
            if a["k"].shape[2] > c.slots:
                c.reserve(a["k"].shape[2])
    for c, a in zip(layers, arrays):
        c.write_sequence(b, a["k"][0], a["v"][0], length=int(a["lengths"][0]),
                         last_count=int(a["last_counts"][0]), held_from=int(a["held_from"][0]),
                         **{n: a[n][0] for n in _SINK_FIELDS if n in a})


_MAX_META = 16 << 20                                # bytes of meta JSON (a layer takes ~300)
_MAX_MEMBERS = 1 + 7 * 4096


def _memory_limit() -> int:
    """Default bound on what a file may make a load allocate: the machine's physical memory."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def _read(path, max_bytes: int | None = None):
    """(meta, [per-layer dict of host arrays]) of a state file, every check done; or StateFileError.

    Reading is bounded by the file: members must be stored (not compressed), so no member holds more
    bytes than the file; each ``.npy`` header must describe exactly the bytes that follow it; and the
    storage the layers' specs ask for (``max_bytes``, default the physical memory) is checked before
    anything is allocated. Any failure of parsing (zipfile, numpy's header parser, JSON, recursion,
    memory) becomes ``StateFileError``.
    """
    limit = _memory_limit() if max_bytes is None else max_bytes
    try:  # a missing or unreadable path raises its own OSError; a FIFO, a device, a folder: BadFile
        raw = read_bytes(path, limit=limit + _MAX_META + _MAX_MEMBERS * 512, what="state file")  # + headers
        return _parse(raw, limit)
    except OSError:
        raise
    except (BadFile, _Bad) as e:   # BadFile names the path itself
        raise StateFileError(str(e) if isinstance(e, BadFile) else f"{os.fspath(path)}: {e}") from None
    except (Exception, MemoryError, RecursionError) as e:  # noqa: BLE001 - every parse failure, by name
        raise StateFileError(f"{os.fspath(path)}: not a readable streamattn state file: truncated or corrupted "
                             f"({type(e).__name__}: {e})") from e


class _Bad(Exception):
    """A problem found by a check (message without the path)."""


def _members(raw: bytes) -> dict:
    """name -> read-only array of every member, each bounded by the file's own bytes."""
    if not raw.startswith(b"PK"):  # every zip starts with a "PK" record; numpy would try pickle
        raise ValueError(f"no zip header: the file starts with {raw[:8]!r}")
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        infos = z.infolist()
        if len(infos) > _MAX_MEMBERS:
            raise ValueError(f"{len(infos)} members")
        _check_ranges(raw, infos, z.start_dir)
        members = {}
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size \
                    or info.file_size > len(raw):
                raise ValueError(f"member {info.filename!r} is compressed (method {info.compress_type}, "
                                 f"{info.compress_size} -> {info.file_size} bytes); snapshots store members "
                                 "uncompressed")
            name = info.filename[:-4] if info.filename.endswith(".npy") else None
            if not name or name in members:
                raise ValueError(f"unexpected member {info.filename!r}")
            members[name] = _npy(z.read(info), info.filename)   # zipfile checks the CRC-32
    return members


def _check_ranges(raw: bytes, infos, start_dir: int) -> None:
    """Members' bytes (local header to end of data) may not overlap each other or the central directory:
    nested members pass every check alone, yet yield many times the file's size."""
    spans = sorted((i.header_offset, i.header_offset + 30 + sum(struct.unpack_from("<HH", raw, i.header_offset + 26))
                    + i.compress_size, i.filename) for i in infos)       # 30: local header; + name, extra
    for (a0, a1, an), (b0, _, bn) in zip(spans, spans[1:] + [(start_dir, 0, "the central directory")]):
        if a1 > b0:
            raise ValueError(f"member {an!r} (bytes {a0}..{a1}) overlaps {bn!r} at byte {b0}")


def _npy(data: bytes, name: str):
    """An .npy member as a read-only array over ``data``; the header must account for every byte."""
    f = io.BytesIO(data)
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f"{name}: .npy version {version}")
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(f)
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biuf" or fortran or len(shape) > 4:
        raise ValueError(f"{name}: dtype {dtype.str}, shape {shape}, fortran_order {fortran} is not a member "
                         "streamattn writes")
    count = 1
    for n in shape:
        count *= int(n)
    if count * dtype.itemsize != len(data) - f.tell():
        raise ValueError(f"{name}: header says {shape} {dtype} ({count * dtype.itemsize} bytes), the member "
                         f"holds {len(data) - f.tell()}")
    return np.frombuffer(data, dtype, count, offset=f.tell()).reshape(shape)


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"{what} must be an integer (got {value!r})")
    return value


def _parse(raw: bytes, max_bytes: int):
    members = _members(raw)
    if "meta" not in members:
        raise _Bad(f"no 'meta' member: not a {FORMAT} file (members: {sorted(members)[:6]})")
    text = members.pop("meta")
    if text.dtype != np.uint8 or text.ndim != 1 or text.size > _MAX_META:
        raise _Bad(f"meta must be uint8 [n <= {_MAX_META}] (got {text.dtype} {text.shape})")
    try:
        meta = json.loads(text.tobytes().decode())
        fmt, version = meta.get("format"), meta.get("version")
    except (UnicodeDecodeError, ValueError, AttributeError, RecursionError) as e:
        raise _Bad(f"its meta is not valid JSON: corrupted ({type(e).__name__}: {e})") from e
    if fmt != FORMAT:
        raise _Bad(f"format {fmt!r} is not {FORMAT!r}: not a streamattn KV state file")
    if version not in _READS:
        raise _Bad(f"format version {version!r} is not supported: this streamattn reads versions {_READS}; "
                   "load it with the streamattn that wrote it and save it again")
    digest = _digest(meta, members)
    if digest != meta.get("sha256"):
        raise _Bad(f"checksum mismatch: the payload hashes to sha256 {digest[:16]}..., the file records "
                   f"{str(meta.get('sha256'))[:16]}...: the file is corrupted")
    records = meta.get("layers")
    if meta.get("layout") not in ("cache", "layers") or not isinstance(records, list) or not records \
            or (meta["layout"] == "cache" and len(records) != 1):
        raise _Bad(f"layout {meta.get('layout')!r} with {len(records) if isinstance(records, list) else 0} "
                   "layers is inconsistent")
    layers, total = [], 0
    for i, m in enumerate(records):
        try:
            if not isinstance(m, dict) or not isinstance(m.get("spec"), dict):
                raise ValueError(f"layer record must hold a spec dict (got {str(m)[:80]})")
            if version == 1 and ("dtype_v" in m["spec"] or m["spec"].get("dtype") not in _V1_DTYPES):
                raise ValueError(f"a version 1 spec holds float storage of one dtype (got {m['spec']})")
            if version < 3:
                if "sink_dtype" in m["spec"]:
                    raise ValueError(f"a version {version} spec has no sink_dtype (got {m['spec']})")
                m["spec"]["sink_dtype"] = None     # its sinks were stored like every other token
            if version < 4:                       # written before rotate_k: its keys are stored unrotated
                if "rotate_k" in m["spec"]:
                    raise ValueError(f"a version {version} spec has no rotate_k (got {m['spec']})")
                m["spec"] = {**m["spec"], "rotate_k": False}
            if version < 5 and m["spec"].get("sink_dtype") not in (None, "float16"):
                raise ValueError(f"a version {version} spec keeps its sinks in float16 or not apart "
                                 f"(got {m['spec']})")
            s = CacheSpec(**m["spec"])
            slots, used = _int(m.get("slots"), "slots"), _int(m.get("used"), "used")
            alloc = s.slots if s.window is not None else max(slots, 1)   # what load and restore allocate
            total += s.batch * s.kv_heads * alloc * (s.k_width * s.storage_dtype.itemsize
                                                     + s.v_width * s.storage_dtype_v.itemsize)
            fields = _FIELDS + (_SINK_FIELDS if s.sink_dtype is not None else ())
            total += 0 if s.sink_dtype is None else \
                2 * s.sink_storage.itemsize * s.batch * s.kv_heads * s.sinks * s.head_dim   # K and V
            if total > max_bytes:
                raise _Bad(f"layer {i}: the file's specs ask for {total} bytes of K/V storage, more than "
                           f"max_bytes={max_bytes}; refused before allocating")
            layers.append(_check_layer(m, {n: members[f"layer{i}.{n}"] for n in fields}))
        except (KeyError, TypeError, ValueError) as e:
            raise _Bad(f"layer {i}: inconsistent contents ({type(e).__name__}: {e})") from e
    return meta, layers


def _check_layer(m: dict, a: dict) -> dict:
    s = CacheSpec(**m["spec"])
    slots, used = m["slots"], m["used"]
    L = a["lengths"]
    for n in _FIELDS[2:]:
        if a[n].dtype != np.int64 or a[n].shape != (s.batch,):
            raise ValueError(f"{n} must be int64 [{s.batch}] (got {a[n].dtype} {a[n].shape})")
    for n, dt, width in (("k", s.storage_dtype, s.k_width), ("v", s.storage_dtype_v, s.v_width)):
        if a[n].dtype != dt or a[n].shape != (s.batch, s.kv_heads, used, width):
            raise ValueError(f"{n} must be {dt} {(s.batch, s.kv_heads, used, width)} "
                             f"(got {a[n].dtype} {a[n].shape})")
    if L.min() < 0 or (s.window is None and L.max() > slots) or (a["last_counts"] < 0).any() \
            or (a["last_counts"] > L).any():
        raise ValueError(f"lengths {L.tolist()} / last_counts {a['last_counts'].tolist()} out of range")
    cap = s.slots if s.window is not None else (s.max_len or slots)
    if not (slots == cap if s.window is not None else 1 <= slots <= cap) or used != min(slots, int(L.max())):
        raise ValueError(f"slots={slots}, used={used} do not fit the spec and lengths {L.tolist()}")
    for n in _SINK_FIELDS if s.sink_dtype is not None else ():
        if a[n].dtype != s.sink_storage or a[n].shape != (s.batch, s.kv_heads, s.sinks, s.head_dim):
            raise ValueError(f"{n} must be {s.sink_dtype} {(s.batch, s.kv_heads, s.sinks, s.head_dim)} "
                             f"(got {a[n].dtype} {a[n].shape})")
    h = a["held_from"]
    if s.window is None and h.any() or s.window is not None and \
            ((h < s.sinks).any() or (h > np.maximum(s.sinks, L)).any() or (h < L - (slots - s.sinks)).any()):
        raise ValueError(f"held_from {h.tolist()} impossible for lengths {L.tolist()}")
    return a


def _match_all(path, found, want, *, ignore) -> None:
    if len(found) != len(want):
        raise StateFileError(f"{os.fspath(path)}: holds {len(found)} layer(s), {len(want)} requested")
    for i, (f, w) in enumerate(zip(found, want)):
        diff = [f"{n}={getattr(f, n)!r} in the file, {getattr(w, n)!r} requested"
                for n in (x.name for x in dataclasses.fields(CacheSpec))
                if n not in ignore and getattr(f, n) != getattr(w, n)]
        if diff:
            raise StateFileError(f"{os.fspath(path)}: layer {i} was saved with another spec: " + "; ".join(diff))


def _check_caches(caches):
    if not caches or not all(isinstance(c, KVCache) for c in caches):
        raise TypeError(f"expected a KVCache or a non-empty list of them (got {[type(c).__name__ for c in caches]})")
    return caches
