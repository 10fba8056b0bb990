"""The ring KV cache: where each token's K and V rows live, and nothing else.

One ``KVCache`` is one layer. K and V are preallocated ``[batch, kv_heads, slots, head_dim]`` arrays (numpy
on the CPU, CuPy on the GPU) plus ``lengths[batch]``, the number of tokens each sequence has seen, which is
also the absolute position of its next token. The cache does no arithmetic on K or V: the backends do.

Slot of absolute position j (the one place this rule is written in Python; the kernels derive the same
rule from (slot, length)):

* causal: ``slot(j) = j``; storage grows by doubling (capped by ``max_len``).
* window / sinks: ``slots = n_s + n_c + C - 1`` and ``slot(j) = j`` for j < n_s, else
  ``n_s + (j - n_s) mod (slots - n_s)``. A write is O(1) per token: no roll, no concatenation.

Why the ring has C - 1 slots of slack. A chunk of T <= C tokens is written first and attended second.
Its earliest query, at position L - T, still needs keys down to L - T - n_c + 1; the ring region holds
the most recent ``R = n_c + C - 1`` positions, L - R .. L - 1, and L - R = L - n_c - C + 1 <= L - T - n_c + 1.
So writing the whole chunk never overwrites a key that a query of the same chunk still needs: "write,
then attend" is exact. A ring of exactly n_c slots would lose up to T - 1 of them (ik_llama.cpp sizes its
ring n_swa + n_ubatch for the same reason).

Why a kernel may read the slots in ring order. Keys enter the cache already rotated by RoPE at their
absolute positions, so nothing about a key depends on where it sits in memory; and softmax(q K^T) V is a
sum over keys, invariant to their order. Only the mask needs positions, and those come from
(slot, length). Nothing is ever re-rotated, which is what broke the sink caches of other engines.

Every mutation validates first and writes second: a rejected call leaves the cache bit-for-bit unchanged.

What a window ring still holds: ``held_from[b]``. A write at position j destroys position j - R (R = slots - n_s),
so after appends alone the ring holds the last R positions, ``max(n_s, L - R) .. L - 1``. A rewind
(streamattn.state) lowers L but cannot bring back what the dropped tokens overwrote, so the cache records the
oldest ring position it still holds for each sequence; ``answerable()`` and ``state.rewind`` derive from it
which queries can still be attended exactly. Slots that hold no current position are zero.
"""

from __future__ import annotations

import numpy as np

from .spec import CacheSpec

_INITIAL_CAUSAL_SLOTS = 256
STORAGE_ALIGN = 64  # bytes: one cache line, one AVX-512 vector


def storage_zeros(xp, shape, dtype):
    """Zeroed K or V storage whose data starts on a STORAGE_ALIGN-byte boundary.

    numpy's large arrays start 16 bytes past a line (malloc's chunk header), so every 64-byte vector
    load of a row touched two cache lines. Aligned storage read faster from memory: CPU decode, MHA 8/8
    float32 at 16k keys, 89.9 -> 94.7% of the read ceiling (median of 289 alternated timings, fast host
    mode); GQA unchanged. CuPy's allocations are 256-byte aligned already.
    """
    if xp is not np:
        return xp.zeros(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + STORAGE_ALIGN, np.uint8)
    start = -raw.ctypes.data % STORAGE_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def ring_slots(positions, *, sinks: int, ring: int):
    """Slots of absolute ``positions`` (any int array) in a cache with ``sinks`` fixed and ``ring`` rotating slots.

    Causal caches are the case ``sinks=0, ring=capacity`` (then slot == position).

    >>> ring_slots(np.arange(8), sinks=2, ring=3).tolist()
    [0, 1, 2, 3, 4, 2, 3, 4]
    """
    positions = np.asarray(positions)
    return np.where(positions < sinks, positions, sinks + (positions - sinks) % ring)


def slot_positions(length: int, *, slots: int, sinks: int):
    """Absolute position held by each slot after ``length`` tokens, or -1 for a slot never written.

    >>> slot_positions(7, slots=5, sinks=2).tolist()   # ring of 3 holds positions 4, 5, 6
    [0, 1, 5, 6, 4]
    """
    s = np.arange(slots)
    ring = slots - sinks
    pos = np.where(s < sinks, s, (length - 1) - ((length - 1 - s) % ring))
    return np.where((pos >= 0) & (pos < length) & ((s < sinks) | (pos >= sinks)), pos, -1)


def widen_bf16(bits, xp=np):
    """bfloat16 raw bits (uint16) -> float32: a 16-bit shift."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def to_storage(x, dtype: str, xp):
    """Cast a float array to the spec's storage (bf16: round-to-nearest-even raw bits)."""
    if dtype == "bfloat16":
        if x.dtype.name == "bfloat16":  # ml_dtypes input: already bf16
            return x.view(xp.uint16)
        bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
        rounding = ((bits >> 16) & 1) + 0x7FFF
        return ((bits + rounding) >> 16).astype(xp.uint16)
    return x.astype(dtype, copy=False)


class KVCache:
    """One layer's K/V storage with per-sequence lengths (ragged batch).

    Parameters
    ----------
    spec : CacheSpec
    device : {"cpu", "gpu", "auto"}
        Where K and V live: numpy arrays, or CuPy arrays on the current device; "auto" picks the GPU
        when CuPy sees a device, else the CPU. ``attend(..., backend="auto")`` follows the cache.

    Attributes
    ----------
    k, v : [batch, kv_heads, slots, head_dim] storage arrays (bf16 as uint16 bits)
    lengths : int64 [batch], tokens seen per sequence (its next absolute position); host memory
    last_counts : int64 [batch], tokens per sequence in the most recent append (the queries to attend)
    held_from : int64 [batch], oldest ring position (>= n_s) whose K/V the ring still holds; host memory.
        ``max(n_s, L - R)`` after appends alone (0 for causal caches); higher only after a rewind.

    Examples
    --------
    >>> cache = KVCache(CacheSpec(batch=1, kv_heads=2, head_dim=4, window=3))
    >>> for _ in range(5):
    ...     cache.append(np.ones((1, 2, 1, 4)), np.ones((1, 2, 1, 4)))
    >>> cache.lengths.tolist(), cache.k.shape
    ([5], (1, 2, 3, 4))
    """

    def __init__(self, spec: CacheSpec, *, device: str = "cpu"):
        if not isinstance(spec, CacheSpec):
            raise TypeError(f"spec must be a CacheSpec (got {type(spec).__name__})")
        if device == "auto":
            from .backends import gpu
            device = "gpu" if gpu.available() else "cpu"
        if device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu', 'gpu' or 'auto' (got {device!r})")
        self.spec = spec
        self.device = device
        if device == "gpu":
            import cupy
            self.xp = cupy
        else:
            self.xp = np
        slots = spec.slots
        if slots is None:
            slots = min(_INITIAL_CAUSAL_SLOTS, spec.max_len or _INITIAL_CAUSAL_SLOTS)
        shape = (spec.batch, spec.kv_heads, slots, spec.head_dim)
        self.k = storage_zeros(self.xp, shape, spec.storage_dtype)  # [batch, kv_heads, slots, head_dim]
        self.v = storage_zeros(self.xp, shape, spec.storage_dtype)  # [batch, kv_heads, slots, head_dim]
        self.lengths = np.zeros(spec.batch, dtype=np.int64)      # [batch]
        self.last_counts = np.zeros(spec.batch, dtype=np.int64)  # [batch]
        self.held_from = np.full(spec.batch, spec.sinks, dtype=np.int64)  # [batch]

    # -- geometry -------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        return self.k.shape[2]

    @property
    def ring(self) -> int:
        """Rotating slots: everything after the sinks (the whole capacity for a causal cache)."""
        return self.slots - self.spec.sinks

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V."""
        return int(self.k.nbytes + self.v.nbytes)

    def slots_of(self, positions):
        """Slots of absolute ``positions`` (int array)."""
        return ring_slots(positions, sinks=self.spec.sinks, ring=self.ring)

    # -- mutation -------------------------------------------------------------------------------
    def append(self, k, v, counts=None) -> None:
        """Write a chunk of T tokens per sequence at positions ``lengths[b] .. lengths[b] + counts[b] - 1``.

        Parameters
        ----------
        k, v : [batch, kv_heads, T, head_dim] float arrays (already rotated by RoPE)
        counts : int [batch], optional
            Real tokens per sequence in this chunk (0..T); rows past ``counts[b]`` are padding and
            are ignored. Default: T for every sequence.

        Raises ValueError or TypeError, naming the argument, before anything is written.
        """
        xp, spec = self.xp, self.spec
        counts = self._validate_append(k, v, counts)
        with np.errstate(over="ignore"):      # an overflow to inf is caught just below, by name
            ks = to_storage(k, spec.dtype, xp)  # [batch, kv_heads, T, head_dim]
            vs = to_storage(v, spec.dtype, xp)
        if spec.check_finite:
            self._check_stored_finite(ks, vs, counts)
        need = int((self.lengths + counts).max())
        if spec.window is None and need > self.slots:
            self._grow(need)
        for b in range(spec.batch):
            c = int(counts[b])
            if c == 0:
                continue
            slots = self.slots_of(np.arange(self.lengths[b], self.lengths[b] + c))  # [c]
            idx = xp.asarray(slots)
            self.k[b][:, idx] = ks[b, :, :c]
            self.v[b][:, idx] = vs[b, :, :c]
        if spec.window is not None:  # the writes destroyed positions up to L + count - 1 - R
            self.held_from = np.maximum(self.held_from, self.lengths + counts - self.ring)
        self.lengths += counts
        self.last_counts = counts

    def _validate_append(self, k, v, counts):
        spec, xp = self.spec, self.xp
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, xp.ndarray):
                raise TypeError(f"{name} must be a {xp.__name__} array on this cache's device "
                                f"({self.device}) (got {type(x).__name__})")
            if x.ndim != 4 or x.shape[0] != spec.batch or x.shape[1] != spec.kv_heads \
                    or x.shape[3] != spec.head_dim or x.shape[2] < 1:
                raise ValueError(f"{name} must have shape [batch={spec.batch}, kv_heads={spec.kv_heads}, "
                                 f"T>=1, head_dim={spec.head_dim}] (got {tuple(x.shape)})")
            if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
                raise TypeError(f"{name} must hold floats (got dtype {x.dtype})")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape (got {tuple(k.shape)} and {tuple(v.shape)})")
        T = k.shape[2]
        if counts is None:
            counts = np.full(spec.batch, T, dtype=np.int64)
        else:
            counts = np.asarray(counts)
            if counts.shape != (spec.batch,) or counts.dtype.kind not in "iu":
                raise ValueError(f"counts must be an int array of shape ({spec.batch},) "
                                 f"(got shape {counts.shape}, dtype {counts.dtype})")
            if counts.min() < 0 or counts.max() > T:
                raise ValueError(f"counts must lie in 0..T={T} (got {counts.tolist()})")
            counts = counts.astype(np.int64)
        if spec.window is not None and counts.max() > spec.max_chunk:
            raise ValueError(f"a chunk of {int(counts.max())} tokens exceeds max_chunk={spec.max_chunk} of this "
                             f"window cache (its ring has {spec.max_chunk - 1} slots of slack); append in pieces "
                             f"of at most {spec.max_chunk} or build the cache with a larger max_chunk")
        if spec.max_len is not None:
            over = np.nonzero(self.lengths + counts > spec.max_len)[0]
            if over.size:
                b = int(over[0])
                raise ValueError(f"sequence {b} would reach {int(self.lengths[b] + counts[b])} tokens, over "
                                 f"max_len={spec.max_len} of this causal cache; use a window cache for "
                                 "unbounded streams or a larger max_len")
        return counts

    def _check_stored_finite(self, ks, vs, counts) -> None:
        """Refuse a chunk whose real rows are NaN or inf *as stored*: the check runs after the cast, so a
        float32 1e5 that overflows a float16 cache is refused too."""
        xp = self.xp
        for name, x in (("k", ks), ("v", vs)):
            for b in range(self.spec.batch):
                rows = x[b, :, :int(counts[b])]
                if not rows.size:
                    continue
                wide = widen_bf16(rows, xp) if self.spec.dtype == "bfloat16" else rows
                if not bool(xp.isfinite(wide).all()):
                    raise ValueError(f"{name} holds NaN or inf for sequence {b}; the cache is unchanged (checked "
                                     f"as stored in {self.spec.dtype}: float16 overflows past 65504; pass "
                                     "check_finite=False in the spec to skip this check)")

    def reserve(self, tokens: int) -> None:
        """Causal caches: allocate room for ``tokens`` per sequence now, so later appends never reallocate."""
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 0:
            raise ValueError(f"tokens must be an integer >= 0 (got {tokens!r})")
        if self.spec.window is not None:
            raise ValueError("reserve() is for causal caches; a window cache is allocated in full at creation")
        if self.spec.max_len is not None and tokens > self.spec.max_len:
            raise ValueError(f"tokens={tokens} exceeds max_len={self.spec.max_len}")
        if tokens > self.slots:
            self._grow(tokens)

    def _grow(self, need: int) -> None:
        cap = self.slots
        while cap < need:
            cap *= 2
        if self.spec.max_len is not None:
            cap = min(cap, self.spec.max_len)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = storage_zeros(self.xp, old.shape[:2] + (cap,) + old.shape[3:], old.dtype)
            new[:, :, :old.shape[2]] = old
            setattr(self, name, new)

    def reset(self, b: int | None = None) -> None:
        """Forget sequence ``b`` (or every sequence when ``b`` is None); its storage is zeroed."""
        if b is None:
            self.k[...] = 0
            self.v[...] = 0
            self.lengths[:] = 0
            self.last_counts[:] = 0
            self.held_from[:] = self.spec.sinks
            return
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < self.spec.batch:
            raise ValueError(f"b must be a sequence index in 0..{self.spec.batch - 1} (got {b!r})")
        self.k[b] = 0
        self.v[b] = 0
        self.lengths[b] = 0
        self.last_counts[b] = 0
        self.held_from[b] = self.spec.sinks

    # -- state (streamattn.state does the work) ---------------------------------------------------
    def answerable(self):
        """int64 [batch]: how many of its newest tokens each sequence can attend exactly now (``attend``'s
        ``counts`` may not exceed it). Query i needs ring keys from ``i - n_c + 1``; the ring holds them from
        ``held_from`` on. So: ``lengths`` for a causal cache or a ring that never wrapped; max_chunk for a
        wrapped ring (the C - 1 slack); fewer right after a rewind, until new tokens are appended."""
        if self.spec.window is None:
            return self.lengths.copy()
        wrapped = self.held_from > self.spec.sinks  # ring positions below held_from are gone
        limit = self.lengths - self.held_from - self.spec.window + 1
        return np.where(wrapped, np.clip(limit, 0, self.lengths), self.lengths)

    def rewind(self, b: int, k: int) -> None:
        """Drop the last ``k`` tokens of sequence ``b``; see :func:`streamattn.state.rewind` for when a
        window cache allows it."""
        from . import state
        state.rewind(self, b, k)

    def fork(self, src: int, dst: int, *, into: "KVCache | None" = None) -> None:
        """Copy sequence ``src`` into sequence ``dst`` of this cache (or of ``into``); see
        :func:`streamattn.state.fork`."""
        from . import state
        state.fork(self, src, dst, into=into)

    def save(self, path) -> None:
        """Snapshot this cache to ``path`` atomically; see :func:`streamattn.state.save`."""
        from . import state
        state.save(path, self)

    @classmethod
    def load(cls, path, *, spec: CacheSpec | None = None, device: str = "cpu") -> "KVCache":
        """A new cache from a snapshot file; see :func:`streamattn.state.load`."""
        from . import state
        cache = state.load(path, spec=spec, device=device)
        if not isinstance(cache, cls):
            raise ValueError(f"{path}: holds {len(cache)} layers; use streamattn.state.load for a list")
        return cache

    # -- inspection -----------------------------------------------------------------------------
    def temporal_view(self, b: int):
        """The tokens sequence ``b`` still holds, in temporal order, widened to float32 on the host
        (after a window rewind, ring positions below ``held_from[b]`` are not held).

        Returns
        -------
        k, v : [kv_heads, n, head_dim] float32
        positions : int64 [n], ascending absolute positions
        """
        pos = slot_positions(int(self.lengths[b]), slots=self.slots, sinks=self.spec.sinks)  # [slots]
        order = np.argsort(pos, kind="stable")
        p = pos[order]
        order = order[(p >= 0) & ((p < self.spec.sinks) | (p >= self.held_from[b]))]  # lost to a rewind: not held
        out = []
        for store in (self.k, self.v):
            rows = store[b][:, self.xp.asarray(order)]  # [kv_heads, n, head_dim]
            rows = rows.get() if self.device == "gpu" else rows
            out.append(widen_bf16(rows) if self.spec.dtype == "bfloat16" else rows.astype(np.float32))
        return out[0], out[1], pos[order].astype(np.int64)
