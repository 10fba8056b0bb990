"""Cache state: snapshot to a file and back, fork a sequence, rewind a sequence.

The state of one layer's ``KVCache`` is everything attention depends on:

    spec          CacheSpec (mode, sizes, dtype)
    k, v          [batch, kv_heads, slots, head_dim] storage (bfloat16 as uint16 bits)
    lengths       int64 [batch]   tokens seen = next absolute position
    last_counts   int64 [batch]   queries of the last append (what ``attend`` answers by default)
    held_from     int64 [batch]   oldest ring position still held (window caches; see cache.py)

A model holds one cache per layer; every file function takes a cache or a list of them.

File format ``streamattn-kv``, version 1
-----------------------------------------
An uncompressed ``.npz`` (a zip of ``.npy`` members; read with ``allow_pickle=False``):

    meta                         uint8 [n], UTF-8 JSON:
                                 {"format": "streamattn-kv", "version": 1, "layout": "cache" | "layers",
                                  "layers": [{"spec": {CacheSpec fields}, "slots": S, "used": U}, ...],
                                  "sha256": "<hex digest of the payload>"}
    layer{i}.k, layer{i}.v       [batch, kv_heads, U, head_dim], storage dtype: slots 0 .. U-1
    layer{i}.lengths             int64 [batch]
    layer{i}.last_counts         int64 [batch]
    layer{i}.held_from           int64 [batch]

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
import tempfile
import zipfile

import numpy as np

from .cache import KVCache
from .spec import CacheSpec

FORMAT = "streamattn-kv"
VERSION = 1
_FIELDS = ("k", "v", "lengths", "last_counts", "held_from")
_IGNORED = ("check_finite",)  # spec fields that are input policy, not state: never compared


class StateFileError(ValueError):
    """A state file that cannot be used: the message names the file and the problem; nothing changed."""


class RewindError(ValueError):
    """A rewind a window cache cannot do exactly; the message names the numbers; nothing changed."""


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
    >>> cache.save("/tmp/kv.npz"); KVCache.load("/tmp/kv.npz").lengths.tolist()
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
        _check_index("b", b, c.spec.batch)
    _write(path, "cache" if isinstance(caches, KVCache) else "layers",
           [_record(c, dataclasses.replace(c.spec, batch=1), slice(b, b + 1)) for c in layers])


def _record(cache: KVCache, spec: CacheSpec, rows: slice):
    lengths = cache.lengths[rows]
    used = min(cache.slots, int(lengths.max()) if lengths.size else 0)
    arrays = {"k": _host(cache.k[rows, :, :used]), "v": _host(cache.v[rows, :, :used]),
              "lengths": lengths.copy(), "last_counts": cache.last_counts[rows].copy(),
              "held_from": cache.held_from[rows].copy()}
    return {"spec": dataclasses.asdict(spec), "slots": cache.slots, "used": used}, arrays


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
def load(path, *, spec=None, device: str = "cpu"):
    """New cache(s) from a snapshot: a KVCache if a cache was saved, a list if a list was saved.

    Parameters
    ----------
    spec : CacheSpec or list of CacheSpec, optional
        What the caller expects; a file saved with another spec (``check_finite`` aside) is refused.
    device : {"cpu", "gpu"}
        Where the new caches live, whichever device the file was saved from.

    Raises
    ------
    StateFileError
        Truncated, corrupted (checksum), wrong format or version, inconsistent, or another spec.
    """
    meta, layers = _read(path)
    want = None if spec is None else ([spec] if isinstance(spec, CacheSpec) else list(spec))
    specs = [CacheSpec(**m["spec"]) for m in meta["layers"]]
    if want is not None:
        _match_all(path, specs, want, ignore=_IGNORED)
        specs = want
    caches = []
    for s, m, arrays in zip(specs, meta["layers"], layers):
        cache = KVCache(s, device=device)
        _install(cache, m["slots"], arrays)
        caches.append(cache)
    return caches[0] if meta["layout"] == "cache" else caches


def restore(target, path) -> None:
    """Restore a snapshot into existing cache(s) in place, all or nothing.

    ``target`` is a KVCache or a list (one per layer); each must have the spec the file was saved with
    (``check_finite`` aside). On any error the targets are bit-for-bit unchanged.
    """
    caches = [target] if isinstance(target, KVCache) else list(target)
    meta, layers = _read(path)
    _match_all(path, [CacheSpec(**m["spec"]) for m in meta["layers"]], [c.spec for c in _check_caches(caches)],
                ignore=_IGNORED)
    staged = []
    for c, m, arrays in zip(caches, meta["layers"], layers):  # build everything first ...
        shape = (c.spec.batch, c.spec.kv_heads, m["slots"], c.spec.head_dim)
        staged.append([_filled(c.xp, shape, arrays[n]) for n in ("k", "v")])
    for c, (k, v), arrays in zip(caches, staged, layers):     # ... then swap, which cannot fail
        c.k, c.v = k, v
        c.lengths, c.last_counts, c.held_from = (arrays[n].copy() for n in _FIELDS[2:])


def load_sequence(path, caches, b: int) -> None:
    """Load a :func:`save_sequence` file into sequence ``b`` of a cache (or of every layer), all or nothing.

    The other sequences are untouched; the cache's spec must equal the file's apart from ``batch``.
    """
    layers = [caches] if isinstance(caches, KVCache) else list(caches)
    meta, arrays = _read(path)
    for c in _check_caches(layers):
        _check_index("b", b, c.spec.batch)
    specs = [CacheSpec(**m["spec"]) for m in meta["layers"]]
    for i, s in enumerate(specs):
        if s.batch != 1:
            raise StateFileError(f"{path}: layer {i} holds a batch of {s.batch} sequences; load_sequence "
                                 "needs a file from save_sequence (batch 1); use load or restore")
    _match_all(path, specs, [c.spec for c in layers], ignore=_IGNORED + ("batch",))
    for c, a in zip(layers, arrays):
        _put(c, b, a["k"][0], a["v"][0], *(int(a[n][0]) for n in _FIELDS[2:]), reserve_only=True)
    for c, a in zip(layers, arrays):
        _put(c, b, a["k"][0], a["v"][0], *(int(a[n][0]) for n in _FIELDS[2:]))


def _read(path):
    """(meta, [per-layer dict of host arrays]) of a state file, every check done; or StateFileError."""
    def bad(problem):
        return StateFileError(f"{os.fspath(path)}: {problem}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if not raw.startswith(b"PK"):  # every zip starts with a "PK" record; numpy would try pickle
            raise ValueError(f"no zip header: the file starts with {raw[:8]!r}")
        z = np.load(io.BytesIO(raw), allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise ValueError("it holds one .npy array, not an .npz archive")
        with z:
            members = {name: z[name] for name in z.files}  # reads every member: zip CRC-32 checked
    except (zipfile.BadZipFile, ValueError, EOFError, KeyError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise bad(f"not a readable streamattn state file: truncated or corrupted ({type(e).__name__}: {e})") from e
    if "meta" not in members:
        raise bad(f"no 'meta' member: not a {FORMAT} file (members: {sorted(members)[:6]})")
    try:
        meta = json.loads(members.pop("meta").tobytes().decode())
        fmt, version = meta.get("format"), meta.get("version")
    except (UnicodeDecodeError, ValueError, AttributeError) as e:
        raise bad(f"its meta is not valid JSON: corrupted ({e})") from e
    if fmt != FORMAT:
        raise bad(f"format {fmt!r} is not {FORMAT!r}: not a streamattn KV state file")
    if version != VERSION:
        raise bad(f"format version {version!r} is not supported: this streamattn reads version {VERSION}; "
                  "load it with the streamattn that wrote it and save it again")
    digest = _digest(meta, members)
    if digest != meta.get("sha256"):
        raise bad(f"checksum mismatch: the payload hashes to sha256 {digest[:16]}..., the file records "
                  f"{str(meta.get('sha256'))[:16]}...: the file is corrupted")
    if meta.get("layout") not in ("cache", "layers") or not meta.get("layers") \
            or (meta["layout"] == "cache" and len(meta["layers"]) != 1):
        raise bad(f"layout {meta.get('layout')!r} with {len(meta.get('layers') or [])} layers is inconsistent")
    layers = []
    for i, m in enumerate(meta["layers"]):
        try:
            layers.append(_check_layer(m, {n: members[f"layer{i}.{n}"] for n in _FIELDS}))
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"layer {i}: inconsistent contents ({type(e).__name__}: {e})") from e
    return meta, layers


def _check_layer(m: dict, a: dict) -> dict:
    s = CacheSpec(**m["spec"])
    slots, used = m["slots"], m["used"]
    L = a["lengths"]
    for n in _FIELDS[2:]:
        if a[n].dtype != np.int64 or a[n].shape != (s.batch,):
            raise ValueError(f"{n} must be int64 [{s.batch}] (got {a[n].dtype} {a[n].shape})")
    for n in ("k", "v"):
        if a[n].dtype != s.storage_dtype or a[n].shape != (s.batch, s.kv_heads, used, s.head_dim):
            raise ValueError(f"{n} must be {s.storage_dtype} {(s.batch, s.kv_heads, used, s.head_dim)} "
                             f"(got {a[n].dtype} {a[n].shape})")
    if L.min() < 0 or (s.window is None and L.max() > slots) or (a["last_counts"] < 0).any() \
            or (a["last_counts"] > L).any():
        raise ValueError(f"lengths {L.tolist()} / last_counts {a['last_counts'].tolist()} out of range")
    cap = s.slots if s.window is not None else (s.max_len or slots)
    if not (slots == cap if s.window is not None else 1 <= slots <= cap) or used != min(slots, int(L.max())):
        raise ValueError(f"slots={slots}, used={used} do not fit the spec and lengths {L.tolist()}")
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


def _install(cache: KVCache, slots: int, arrays: dict) -> None:
    s = cache.spec
    shape = (s.batch, s.kv_heads, slots, s.head_dim)
    cache.k, cache.v = (_filled(cache.xp, shape, arrays[n]) for n in ("k", "v"))
    cache.lengths, cache.last_counts, cache.held_from = (arrays[n].copy() for n in _FIELDS[2:])


def _filled(xp, shape, rows):
    """Zeros of ``shape`` on xp's device with ``rows`` ([..., used, d], host) in the first slots."""
    out = xp.zeros(shape, dtype=rows.dtype)
    out[:, :, :rows.shape[2]] = xp.asarray(rows)
    return out


def _host(a):
    return a.get() if hasattr(a, "get") else np.array(a)


# -- fork ----------------------------------------------------------------------------------------
def fork(cache: KVCache, src: int, dst: int, *, into: KVCache | None = None) -> None:
    """Copy sequence ``src``'s state into sequence ``dst`` of the same cache or of ``into``.

    Both branches then continue independently; each equals full attention over its own history.
    ``into`` must have the same spec apart from ``batch`` (and ``check_finite``); it may live on
    another device. ``dst``'s previous state is replaced.

    Examples
    --------
    >>> cache = KVCache(CacheSpec(batch=2, kv_heads=1, head_dim=8, window=4, max_chunk=3))
    >>> cache.append(np.ones((2, 1, 3, 8)), np.ones((2, 1, 3, 8)), counts=[3, 0])
    >>> cache.fork(0, 1); cache.lengths.tolist()
    [3, 3]
    """
    target = cache if into is None else into
    _check_caches([cache, target])
    _check_index("src", src, cache.spec.batch)
    _check_index("dst", dst, target.spec.batch)
    diff = [n for n in (f.name for f in dataclasses.fields(CacheSpec))
            if n not in _IGNORED + ("batch",) and getattr(cache.spec, n) != getattr(target.spec, n)]
    if diff:
        raise ValueError(f"cannot fork into a cache with another spec: {', '.join(diff)} differ "
                         f"({cache.spec} vs {target.spec})")
    if target is cache and src == dst:
        return
    n = min(cache.slots, int(cache.lengths[src]))
    k, v = cache.k[src][:, :n], cache.v[src][:, :n]           # [kv_heads, n, head_dim]
    if target.xp is not cache.xp:
        k, v = _host(k), _host(v)
    _put(target, dst, k, v, int(cache.lengths[src]), int(cache.last_counts[src]), int(cache.held_from[src]))


def _put(cache: KVCache, b: int, k, v, length: int, last_count: int, held_from: int, *, reserve_only=False):
    """Make sequence b hold k, v ([kv_heads, n, head_dim], slots 0..n-1; zeros after) and these counters."""
    n = k.shape[1]
    if n > cache.slots:  # causal: grow first; it keeps every row, so a later failure changes nothing
        cache.reserve(n)
    if reserve_only:
        return
    xp = cache.xp
    cache.k[b] = 0
    cache.v[b] = 0
    cache.k[b][:, :n] = xp.asarray(k)
    cache.v[b][:, :n] = xp.asarray(v)
    cache.lengths[b], cache.last_counts[b], cache.held_from[b] = length, last_count, held_from


# -- rewind --------------------------------------------------------------------------------------
def rewind(cache: KVCache, b: int, k: int) -> None:
    """Drop the last ``k`` tokens of sequence ``b``: afterwards it is as if they were never appended.

    Always possible in a causal cache. In a window cache it is possible exactly when the keys the next
    query needs have not been overwritten; otherwise ``RewindError`` names the numbers and nothing changes.

    When a window rewind is exact. Notation: n_s sinks, n_c window, C = max_chunk, R = slots - n_s =
    n_c + C - 1 ring slots, L the length before and L' = L - k after.

    * What the ring holds. Position j >= n_s lives in slot n_s + (j - n_s) mod R, so writing j destroys
      j - R. After appends alone the ring holds the last R positions, max(n_s, L - R) .. L - 1; the cache
      records the oldest one it still holds as ``held_from[b]`` (a rewind cannot bring back what the
      dropped tokens overwrote, so after one it can be higher than max(n_s, L - R)).
    * What the future needs. Next, a chunk of T <= C tokens is written at L' .. L'+T-1 and then attended.
      Its earliest query, at L', sees the sinks and max(n_s, L' - n_c + 1) .. L'; the old keys among them
      are  need = max(n_s, L' - n_c + 1) .. L' - 1.  The chunk's own writes destroy only L' - R ..
      L' + T - 1 - R, all below L' - n_c + 1 because T <= C (the C - 1 slack), and every later chunk moves
      both ends forward by the same count; so if the first query after the rewind is exact, all are.
    * The rule: the rewind is allowed iff  need >= held_from  or  need >= L'  (no old key needed).

    With no earlier rewind (held_from = max(n_s, L - R)) this reads: allowed iff
      - L <= slots (the ring never wrapped: nothing was overwritten), or
      - k <= C: the ring holds R = n_c + C - 1 positions, R - k of them below L', and the next query
        needs n_c - 1 of those: R - k >= n_c - 1 <=> k <= C; or
      - L' <= n_s (back into the sinks, which are never overwritten) or n_c = 1 (a query sees itself).
    In general held_from = H - R for H the longest length reached since the ring last refilled, so the
    rule is L' >= H - C: rewinds add up (from a full ring, rewinding k1, appending T <= k1 and rewinding
    k2 is allowed while k1 - T + k2 <= C) until R new tokens past H have refilled the ring.
    Dropped tokens' slots are zeroed (they never share a slot with a held position, since
    held_from >= L - R); ``last_counts[b]`` becomes 0; ``held_from[b]`` becomes max(n_s, min(held_from, L')).
    Right after a rewind the newest remaining tokens can be re-attended only while their own keys are
    held: ``cache.answerable()`` says how many (after a rewind of exactly C, none until the next append).

    Examples
    --------
    >>> cache = KVCache(CacheSpec(batch=1, kv_heads=1, head_dim=8, window=4, max_chunk=2))  # R = 5
    >>> for _ in range(9): cache.append(np.ones((1, 1, 1, 8)), np.ones((1, 1, 1, 8)))
    >>> cache.rewind(0, 2); cache.lengths.tolist()
    [7]
    >>> cache.rewind(0, 1)
    Traceback (most recent call last):
    ...
    streamattn.state.RewindError: cannot rewind sequence 0 by 1 (length 7 -> 6) in this window cache: ...
    """
    _check_index("b", b, cache.spec.batch)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= cache.lengths[b]:
        raise ValueError(f"k must be an integer in 0..lengths[{b}]={int(cache.lengths[b])} (got {k!r})")
    why = refusal(cache, b, int(k))
    if why:
        raise RewindError(why)
    _drop(cache, b, int(k))


def can_rewind(cache: KVCache, b: int, k: int) -> bool:
    """Whether ``rewind(cache, b, k)`` is allowed (``k`` within 0..lengths[b])."""
    return 0 <= k <= cache.lengths[b] and refusal(cache, b, k) is None


def refusal(cache: KVCache, b: int, k: int) -> str | None:
    """Why sequence b of a window cache cannot be rewound by k (see :func:`rewind`), or None."""
    s = cache.spec
    if s.window is None or k == 0:
        return None
    L, held = int(cache.lengths[b]), int(cache.held_from[b])
    Lp = L - k
    need = max(s.sinks, Lp - s.window + 1)   # oldest old key the next query (at L') sees
    if need >= held or need >= Lp:
        return None
    return (f"cannot rewind sequence {b} by {k} (length {L} -> {Lp}) in this window cache: the next query "
            f"(position {Lp}) needs keys from position {need}, but the ring (R={cache.ring} slots) still holds "
            f"only positions {held}..{L - 1}; rewind it to length >= {held + s.window - 1} (at most "
            f"max_chunk={s.max_chunk} below the newest token the ring has held) or to length <= {s.sinks} (sinks only), "
            "or build the cache with a larger max_chunk")


def _drop(cache: KVCache, b: int, k: int) -> None:
    """Rewind without the check (tests use it to show the check is needed): zero the dropped slots."""
    if k == 0:
        return
    n_s, L = cache.spec.sinks, int(cache.lengths[b])
    Lp = L - k
    # dropped positions still in a slot: sinks Lp..n_s-1, and ring positions >= L - R (older are gone)
    pos = np.concatenate([np.arange(Lp, min(L, n_s)), np.arange(max(Lp, n_s, L - cache.ring), L)])
    idx = cache.xp.asarray(cache.slots_of(pos))
    cache.k[b][:, idx] = 0
    cache.v[b][:, idx] = 0
    cache.lengths[b] = Lp
    cache.last_counts[b] = 0
    if cache.spec.window is not None:
        cache.held_from[b] = max(n_s, min(int(cache.held_from[b]), Lp))


# -- helpers -------------------------------------------------------------------------------------
def _check_caches(caches):
    if not caches or not all(isinstance(c, KVCache) for c in caches):
        raise TypeError(f"expected a KVCache or a non-empty list of them (got {[type(c).__name__ for c in caches]})")
    return caches


def _check_index(name: str, value, batch: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < batch:
        raise ValueError(f"{name} must be a sequence index in 0..{batch - 1} (got {value!r})")
