"""The ring KV cache: where each token's K and V rows live, and nothing else.

One ``KVCache`` is one layer. K and V are preallocated ``[batch, kv_heads, slots, head_dim]`` arrays (numpy
on the CPU, CuPy on the GPU) plus ``lengths[batch]``, the number of tokens each sequence has seen, which is
also the absolute position of its next token. The cache does no arithmetic on K or V: the backends do.

Slot of absolute position j (written once, ``storage.slot_of``, which the cache's Python side and its
compiled CPU write both call; the attention kernels derive the same rule from (slot, length)):

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
(``truncate``, called by streamattn.kv.state.rewind) lowers L but cannot bring back what the dropped tokens
overwrote, so the cache records the oldest ring position it still holds for each sequence; ``answerable()``
and ``state.rewind`` derive from it which queries can still be attended exactly. Slots that hold no current
position are zero.

Sinks apart (``spec.sink_dtype`` "float16" or "float32": a sinks cache with quantized K or V). The n_s sink
tokens live in ``sink_k``, ``sink_v`` (of that dtype, row j = position j) and ``k``, ``v`` hold only the ring:
R = n_c + C - 1 slots, position j >= n_s in slot (j - n_s) mod R, the slot rule of a window cache without
sinks over positions shifted by n_s. So each part is a cache the backends already attend, and
``streamattn.kv.dispatch`` merges the two answers by their log-sum-exps (docs/DESIGN.md §6). ``slots`` and
``ring`` keep their meaning (n_s + R and R); the state dicts (export_state, write_sequence) keep the
layout of a cache with its sinks inside, sink slots zero, plus the sink store's rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..runtime.arrays import check_sequence_index, to_host
from .device_step import DeviceCounters, DeviceStep
from .rotation import rotate
from .spec import QUANTIZED, CacheSpec
from .storage import (EXPONENT_BITS, bits, check_stored_finite, non_finite_error, ring_slots, slot_positions,
                      recode_for_queries, storage_zeros, to_storage, widen, write_rows)


_INITIAL_CAUSAL_SLOTS = 256


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
    k, v : [batch, kv_heads, slots, head_dim] storage arrays (bf16 as uint16 bits; q8_0 / q4_0 as uint8
        [batch, kv_heads, slots, row bytes] of GGUF blocks, ``spec.k_width`` / ``spec.v_width``)
    lengths : int64 [batch], tokens seen per sequence (its next absolute position); host memory
    last_counts : int64 [batch], tokens per sequence in the most recent append (the queries to attend)
    held_from : int64 [batch], oldest ring position (>= n_s) whose K/V the ring still holds; host memory.
        ``max(n_s, L - R)`` after appends alone (0 for causal caches); higher only after a rewind.
    view_of : KVCache or None, the cache whose first rows a :meth:`head` view shares (a view cannot grow)
    sink_k, sink_v : [batch, kv_heads, n_s, head_dim] of ``spec.sink_dtype``, the sink tokens' rows when
        it is "float16" or "float32" (then ``k``, ``v`` hold the ring's R slots only); else None
    counters : streamattn.kv.device_step.DeviceCounters or None, a GPU cache's lengths and counts on the device
    step : streamattn.kv.device_step.DeviceStep or None, the step a GPU cache's appends report to (its
        finite check is then read once, at the step's end); None: each append checks at once

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
        self.sink_k = self.sink_v = None
        if spec.sink_dtype is not None:                    # the sinks apart: [batch, kv_heads, n_s, head_dim]
            sink_shape = (spec.batch, spec.kv_heads, spec.sinks, spec.head_dim)
            self.sink_k = storage_zeros(self.xp, sink_shape, spec.sink_storage)
            self.sink_v = storage_zeros(self.xp, sink_shape, spec.sink_storage)
            slots -= spec.sinks                            # k, v: the ring's R slots
        shape = (spec.batch, spec.kv_heads, slots)
        self.k = storage_zeros(self.xp, shape + (spec.k_width,), spec.storage_dtype)    # [batch, kv_heads, slots,
        self.v = storage_zeros(self.xp, shape + (spec.v_width,), spec.storage_dtype_v)  # k_width / v_width]
        self.lengths = np.zeros(spec.batch, dtype=np.int64)      # [batch]
        self.last_counts = np.zeros(spec.batch, dtype=np.int64)  # [batch]
        self.held_from = np.full(spec.batch, spec.sinks, dtype=np.int64)  # [batch]
        self.view_of = None                                      # the cache a head() view shares storage with
        # a GPU cache: lengths / counts also on the device (device_step.DeviceCounters), the step whose flag
        # its appends lower (None: each append checks alone), the slots' old bytes of the last append
        self.counters = DeviceCounters(self.xp, spec.batch) if device == "gpu" else None
        self.step = None
        self._undo, self._lone, self._fed = {}, None, None   # _fed: (host factors, their device copy)

    # -- geometry -------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """Slot count: n_s + R for a window cache (a sink store included), the capacity of a causal one."""
        return self.k.shape[2] + (self.spec.sinks if self.sink_k is not None else 0)

    @property
    def ring(self) -> int:
        """Rotating slots: everything after the sinks (the whole capacity for a causal cache)."""
        return self.slots - self.spec.sinks

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V (a sink store included)."""
        sinks = 0 if self.sink_k is None else self.sink_k.nbytes + self.sink_v.nbytes
        return int(self.k.nbytes + self.v.nbytes + sinks)

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
        self._write(k, v, self._validate_append(k, v, counts))

    def append_trusted(self, k, v, counts=None, v_rounding=None, k_search=False, k_queries=None) -> None:
        """:meth:`append` for a chunk its caller built with this cache's shape and device (the model).

        k, v: float [batch, kv_heads, T, head_dim] on this cache's device; counts: None or int [batch].
        Skips the checks of the arguments' types and shapes, which cannot fail for such a caller, and
        keeps those of their values, which can: counts in 0..T, max_chunk, max_len, and the stored
        values finite (``check_finite``). A refused chunk leaves the cache unchanged, as in append.
        ``v_rounding``, ``k_search``, ``k_queries``: how a quantized V and K are rounded (:meth:`stage`).
        """
        T = k.shape[2]
        counts = np.full(self.spec.batch, T, np.int64) if counts is None else self._check_counts(counts, T)
        self.check_room(counts)
        self._write(k, v, counts, v_rounding, k_search, k_queries)

    def _write(self, k, v, counts, v_rounding=None, k_search=False, k_queries=None) -> None:
        """Store a validated chunk: cast, check finite as stored (before writing), grow, write, count (on
        the CPU the check, write and count are one compiled call, :func:`streamattn.kv.storage.write_rows`)."""
        xp, spec = self.xp, self.spec
        ks, vs = self.stage(k, v, counts, v_rounding, k_search, k_queries)
        if ks is None:                            # the device kernel casts and writes (_write_device)
            return self._write_device(k, v, counts, None if v_rounding is None else self._fed[1])
        if self.sink_k is not None:
            return self._write_split(k, v, ks, vs, counts)
        if xp is np:                              # one compiled call: check as stored, write, count
            mixed = spec.dtype_v is not None or spec.dtype in QUANTIZED  # no one exponent pattern for both
            if mixed and spec.check_finite:
                check_stored_finite(ks, vs, counts, spec.dtype, xp, spec.v_dtype)
            bad = write_rows(bits(self.k), bits(self.v), bits(ks), bits(vs), self.lengths,
                             np.ascontiguousarray(counts, np.int64), self.last_counts, self.held_from,
                             spec.sinks, self.ring, spec.window is not None, spec.check_finite and not mixed,
                             EXPONENT_BITS.get(spec.dtype, 0))
            if bad >= 0:
                raise non_finite_error("kv"[bad % 2], bad // 2, spec.dtype)
            return
        if spec.check_finite:
            check_stored_finite(ks, vs, counts, spec.dtype, xp, spec.v_dtype)
        for b in range(spec.batch):
            c = int(counts[b])
            if c == 0:
                continue
            L = int(self.lengths[b])
            if c == 1:                          # one token (decode): basic indexing, no index array
                s = int(self.slots_of(L))
                self.k[b, :, s] = ks[b, :, 0]
                self.v[b, :, s] = vs[b, :, 0]
                continue
            idx = xp.asarray(self.slots_of(np.arange(L, L + c)))                     # [c]
            self.k[b][:, idx] = ks[b, :, :c]
            self.v[b][:, idx] = vs[b, :, :c]
        if spec.window is not None:  # the writes destroyed positions up to L + count - 1 - R
            np.maximum(self.held_from, self.lengths + counts - self.ring, out=self.held_from)
        self.lengths += counts
        self.last_counts[:] = counts           # in place: a head() view and its parent share the counters

    def _device_append(self, v_rounding, k_search, k_queries) -> bool:
        """True where the append kernel writes this GPU cache's rows: a K/V pair and head_dim it has, gguf's
        rounding or a fed q4_0 V (a searched or query-recoded K rounds on the host)."""
        from .backends.gpu_append import supports
        spec = self.spec
        return (self.counters is not None and (v_rounding is None or spec.v_dtype == "q4_0") and not k_search
                and k_queries is None and supports(spec.dtype, spec.v_dtype, spec.head_dim))

    def _write_device(self, k, v, counts, v_fed=None) -> None:
        """:meth:`_write` on the device, no sync: the append kernel casts (or quantizes, keys rotated) and writes
        the rows, saving the slots' old bytes, and lowers the step's finite flag; the device lengths move by a
        device add, the host copies here. Outside a :class:`DeviceStep` the append is its own step: its flag
        is read at once, and a non-finite chunk is undone and refused as on the CPU. ``v_fed``: the device copy
        of a q4_0 V's rounding factors (:meth:`stage` uploads them once)."""
        from .backends import gpu, gpu_append
        spec, xp = self.spec, self.xp
        T = k.shape[2]
        if self.step is None and self._lone is None:
            self._lone = DeviceStep(xp=xp)                        # the step of appends outside any step
        step = self.step if self.step is not None else self._lone
        fresh = any(e[0] is self for e in step.entries)           # a second append in one step: its own undo
        undo = None if fresh else self._undo.get(T)
        if undo is None:
            undo = tuple(xp.empty((spec.batch, spec.kv_heads, T) + a.shape[3:], dtype=a.dtype)
                         for a in (self.k, self.v))
            if not fresh:
                self._undo = {T: undo}                            # [batch, kv_heads, T, width] each
        lengths, d_counts = self.counters.match(self.lengths, counts)
        flag, base = step.record(self, counts, *undo)
        window = spec.window is not None
        try:
            gpu_append.append_with(xp, gpu.launch, k, v, self.k, self.v, undo[0], undo[1], lengths, d_counts, flag,
                                   kind=spec.dtype, v_kind=spec.v_dtype, sinks=spec.sinks if window else 0,
                                   ring=self.ring, rotate_k=spec.rotate_k, code_base=base, sink_k=self.sink_k,
                                   sink_v=self.sink_v, v_fed=v_fed)
        except BaseException:                 # not launched: its undo rows hold nothing to restore
            step.entries.pop()
            step.codes = base
            raise
        self.counters.advance()
        if window:
            np.maximum(self.held_from, self.lengths + counts - self.ring, out=self.held_from)
        self.lengths += counts
        self.last_counts[:] = counts
        if self.step is None:
            step.finish()

    def _write_split(self, k, v, ks, vs, counts) -> None:
        """:meth:`_write` for sinks apart: rows at positions < n_s go to the sink store (``spec.sink_dtype``),
        the rest to ring slot (j - n_s) mod R as stored (``ks``, ``vs``); everything checked before writing."""
        xp, spec = self.xp, self.spec
        n_s, R = spec.sinks, self.ring
        to_sink = np.clip(n_s - self.lengths, 0, counts)                       # [batch] rows for the sinks
        if spec.check_finite:            # every row as quantized (a sink row finite in float16 is so there too)
            check_stored_finite(ks, vs, counts, spec.dtype, xp, spec.v_dtype)
        if to_sink.any():
            if spec.rotate_k:                   # the sink keys rotated as the ring's were in stage()
                k = rotate(k, xp)
            with np.errstate(over="ignore"):
                k_sink, v_sink = (to_storage(x, spec.sink_dtype, xp) for x in (k, v))   # [batch, kv_heads, T, hd]
            if spec.check_finite:
                check_stored_finite(k_sink, v_sink, to_sink, spec.sink_dtype, xp)
        for b in range(spec.batch):
            L, c, s = int(self.lengths[b]), int(counts[b]), int(to_sink[b])
            if s:
                self.sink_k[b, :, L:L + s] = k_sink[b, :, :s]
                self.sink_v[b, :, L:L + s] = v_sink[b, :, :s]
            if c == s + 1:                      # one ring row (decode): basic indexing, no index array
                slot = (L + s - n_s) % R
                self.k[b, :, slot] = ks[b, :, s]
                self.v[b, :, slot] = vs[b, :, s]
            elif c > s:
                idx = xp.asarray((np.arange(L + s, L + c) - n_s) % R)                  # [c - s]
                self.k[b][:, idx] = ks[b, :, s:c]
                self.v[b][:, idx] = vs[b, :, s:c]
        np.maximum(self.held_from, self.lengths + counts - R, out=self.held_from)
        self.lengths += counts
        self.last_counts[:] = counts

    def stage(self, k, v, counts, v_rounding=None, k_search=False, k_queries=None):
        """A validated chunk cast to the storage (ks, vs), with room made for it: a causal cache grows,
        after refusing a chunk that is not finite as stored (so a refused chunk changes nothing). A
        ``rotate_k`` spec rotates the keys first (:func:`streamattn.kv.rotation.rotate`), before they are cast.
        ``v_rounding``: None (round to nearest), or float64 [kv_heads, D, D] factors with which a quantized V
        is rounded for the layer's output projection (:func:`streamattn.kv.storage.quantize_rows_fed`; the model
        passes them, :meth:`streamattn.models.transformer.Transformer.value_rounding`). ``k_search``: a q4_0
        K's block scales searched for the least error (:func:`streamattn.kv.storage.quantize_rows`;
        the model asks for it, :meth:`~streamattn.models.transformer.Transformer.key_search`), else gguf's.
        ``k_queries``: None, or float32 [batch, heads, T, head_dim] queries of the chunk's own tokens in the frame
        the keys are stored in (rotated with them): a q4_0 K then has its codes rounded for them, each row
        for its own token's query group (:func:`streamattn.kv.storage.recode_for_queries`; the model passes
        them with ``k_search``, :meth:`~streamattn.models.transformer.Transformer.key_search`).
        A GPU cache whose append kernel casts the rows itself (:meth:`_write_device`) gets room only, and
        (None, None)."""
        xp, spec = self.xp, self.spec
        if self._device_append(v_rounding, k_search, k_queries):   # the kernel rotates and casts: room only
            if spec.window is None:
                need = int((self.lengths + counts).max())
                if need > self.slots:     # grown before the step's finite check: a rollback keeps the room
                    self._grow(need)
            if v_rounding is not None and (self._fed is None or self._fed[0] is not v_rounding):
                self._fed = (v_rounding, xp.ascontiguousarray(xp.asarray(v_rounding), dtype=xp.float64))  # once
            return None, None
        if spec.rotate_k:                                # keys stored as k @ H (streamattn.kv.rotation)
            k = rotate(k, xp)                            # [batch, kv_heads, T, head_dim] float32
        if k.dtype == spec.storage_dtype and v.dtype == spec.storage_dtype_v:    # no cast: no overflow
            ks, vs = k, v                                # (not bf16 or q*: their storage dtype is no float)
        else:
            with np.errstate(over="ignore"):      # an overflow to inf is caught just below, by name
                ks = to_storage(k, spec.dtype, xp, search=k_search)  # [batch, kv_heads, T, k_width]
                vs = to_storage(v, spec.v_dtype, xp, v_rounding)  # [batch, kv_heads, T, v_width]
            if k_queries is not None and spec.dtype == "q4_0":
                ks = _recode_keys(k, ks, k_queries, xp)
        if spec.window is None:
            need = int(self.lengths[0] + counts[0]) if spec.batch == 1 else int((self.lengths + counts).max())
            if need > self.slots:
                if spec.check_finite:             # refuse before growing: a refused chunk changes nothing
                    check_stored_finite(ks, vs, counts, spec.dtype, xp, spec.v_dtype)
                self._grow(need)
        return ks, vs

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
        counts = np.full(spec.batch, T, dtype=np.int64) if counts is None else self._check_counts(counts, T)
        self.check_room(counts)
        return counts

    def _check_counts(self, counts, T):
        """counts as int64 [batch], each in 0..T, or ValueError."""
        spec = self.spec
        counts = np.asarray(counts)
        if counts.shape != (spec.batch,) or counts.dtype.kind not in "iu":
            raise ValueError(f"counts must be an int array of shape ({spec.batch},) "
                             f"(got shape {counts.shape}, dtype {counts.dtype})")
        if counts.min() < 0 or counts.max() > T:
            raise ValueError(f"counts must lie in 0..T={T} (got {counts.tolist()})")
        return counts.astype(np.int64)

    def check_room(self, counts):
        """ValueError unless a chunk of ``counts`` tokens fits: max_chunk (window), max_len (causal)."""
        spec = self.spec
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

    def head(self, n: int) -> "KVCache":
        """Sequences 0..n-1 as a cache of batch n sharing this one's storage and counters.

        Appending to and attending the view is appending to and attending those rows here: a step that
        runs only the first n sequences computes no rows for idle ones after them (the server's engine);
        rows n.. are untouched (a full-batch append would set their ``last_counts`` to 0). A view cannot grow
        (that would detach it): ``reserve`` room on this cache first. Use a view for one step and drop it; a
        later ``reserve`` here leaves older views stale.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= self.spec.batch:
            raise ValueError(f"n must be an integer in 1..batch={self.spec.batch} (got {n!r})")
        view = object.__new__(KVCache)
        view.spec, view.device, view.xp = dataclasses.replace(self.spec, batch=int(n)), self.device, self.xp
        view.k, view.v = self.k[:n], self.v[:n]                    # [n, kv_heads, slots, head_dim] views
        view.sink_k, view.sink_v = (None, None) if self.sink_k is None else (self.sink_k[:n], self.sink_v[:n])
        view.lengths, view.last_counts, view.held_from = self.lengths[:n], self.last_counts[:n], self.held_from[:n]
        view.view_of = self
        view.counters = None if self.counters is None else self.counters.head(n)
        view.step, view._undo, view._lone, view._fed = self.step, {}, None, self._fed
        return view

    def _grow(self, need: int) -> None:
        if self.view_of is not None:
            raise ValueError(f"this head() view would need {need} slots (has {self.slots}); reserve({need}) "
                             f"on the cache it views before making the view")
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
        if self.sink_k is not None:
            self.sink_k[slice(None) if b is None else check_sequence_index("b", b, self.spec.batch)] = 0
            self.sink_v[slice(None) if b is None else b] = 0
        if b is None:
            self.k[...] = 0
            self.v[...] = 0
            self.lengths[:] = 0
            self.last_counts[:] = 0
            self.held_from[:] = self.spec.sinks
            return
        b = check_sequence_index("b", b, self.spec.batch)
        self.k[b] = 0
        self.v[b] = 0
        self.lengths[b] = 0
        self.last_counts[b] = 0
        self.held_from[b] = self.spec.sinks

    # -- what can be attended -------------------------------------------------------------------
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

    def truncate(self, b: int, k: int) -> None:
        """Drop the last ``k`` tokens of sequence ``b`` without asking whether that is exact: zero their
        slots, ``last_counts[b] = 0``, lower ``held_from[b]`` to at most the new length.
        :func:`streamattn.kv.state.rewind` checks the rule first; tests call this to show the check is needed."""
        b = check_sequence_index("b", b, self.spec.batch)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= self.lengths[b]:
            raise ValueError(f"k must be an integer in 0..lengths[{b}]={int(self.lengths[b])} (got {k!r})")
        if k == 0:
            return
        n_s, L = self.spec.sinks, int(self.lengths[b])
        Lp = L - int(k)
        # dropped positions still in a slot: sinks Lp..n_s-1, and ring positions >= L - R (older are gone)
        sink_pos, ring_pos = np.arange(Lp, min(L, n_s)), np.arange(max(Lp, n_s, L - self.ring), L)
        if self.sink_k is not None:
            self.sink_k[b][:, sink_pos] = 0
            self.sink_v[b][:, sink_pos] = 0
            idx = self.xp.asarray((ring_pos - n_s) % self.ring)
        else:
            idx = self.xp.asarray(self.slots_of(np.concatenate([sink_pos, ring_pos])))
        self.k[b][:, idx] = 0
        self.v[b][:, idx] = 0
        self.lengths[b] = Lp
        self.last_counts[b] = 0
        if self.spec.window is not None:
            self.held_from[b] = max(n_s, min(int(self.held_from[b]), Lp))

    # -- inspection -----------------------------------------------------------------------------
    def temporal_view(self, b: int):
        """The tokens sequence ``b`` still holds, in temporal order, widened to float32 on the host
        (after a window rewind, ring positions below ``held_from[b]`` are not held).

        Returns
        -------
        k, v : [kv_heads, n, head_dim] float32, as stored (a ``rotate_k`` cache's keys are ``k @ H``)
        positions : int64 [n], ascending absolute positions
        """
        n_s, L = self.spec.sinks, int(self.lengths[b])
        split = self.sink_k is not None
        if split:                       # the ring alone: a window cache without sinks, positions shifted by n_s
            pos = slot_positions(L - n_s, slots=self.ring, sinks=0)                # [R]
            pos = np.where(pos >= 0, pos + n_s, -1)
        else:
            pos = slot_positions(L, slots=self.slots, sinks=n_s)                   # [slots]
        order = np.argsort(pos, kind="stable")
        p = pos[order]
        order = order[(p >= 0) & ((p < n_s) | (p >= self.held_from[b]))]  # lost to a rewind: not held
        out = []
        for store, sink, dt in ((self.k, self.sink_k, self.spec.dtype), (self.v, self.sink_v, self.spec.v_dtype)):
            rows = to_host(store[b][:, self.xp.asarray(order)], copy=False)  # [kv_heads, n, width]
            rows = widen(rows, dt, self.spec.head_dim)                       # [kv_heads, n, head_dim]
            if split:                                                        # the sinks first, as stored
                rows = np.concatenate([to_host(sink[b, :, :min(L, n_s)]).astype(np.float32), rows], axis=1)
            out.append(rows)
        pos = pos[order] if not split else np.concatenate([np.arange(min(L, n_s)), pos[order]])
        return out[0], out[1], pos.astype(np.int64)

    # -- whole state and one sequence: copy, restore, rewrite (streamattn.kv.state, streamattn.kv.snapshot, the
    #    server's prompt cache) ------------------------------------------------------------------
    def export_state(self, rows: slice = slice(None)) -> dict:
        """Host copies of the state of sequences ``rows``: what a snapshot stores.

        Returns
        -------
        dict with
            k, v : [n, kv_heads, U, width] storage dtype, slots 0 .. U-1 with U = min(slots, max length)
                (every slot at or past U is zero; with the sinks apart, slots 0 .. n_s-1 are zero too)
            lengths, last_counts, held_from : int64 [n]
            sink_k, sink_v : [n, kv_heads, n_s, head_dim] of ``spec.sink_dtype``, only with the sinks apart
        """
        lengths = self.lengths[rows]
        used = min(self.slots, int(lengths.max()) if lengths.size else 0)
        state = {"lengths": lengths.copy(), "last_counts": self.last_counts[rows].copy(),
                 "held_from": self.held_from[rows].copy()}
        if self.sink_k is None:
            return {"k": to_host(self.k[rows, :, :used]), "v": to_host(self.v[rows, :, :used]), **state}
        n_s = self.spec.sinks
        for n, store in (("k", self.k), ("v", self.v)):   # the layout of a cache with its sinks inside
            ring = to_host(store[rows, :, :max(0, used - n_s)])                # [n, kv_heads, U - n_s, width]
            state[n] = np.concatenate([np.zeros(ring.shape[:2] + (min(used, n_s),) + ring.shape[3:], ring.dtype),
                                       ring], axis=2)
        state["sink_k"], state["sink_v"] = to_host(self.sink_k[rows]), to_host(self.sink_v[rows])
        return state

    @classmethod
    def from_state(cls, spec: CacheSpec, state: dict, *, slots: int, device: str = "cpu") -> "KVCache":
        """A new cache of ``slots`` slots holding ``state`` (as :meth:`export_state` gives it for all rows).

        The caller vouches that the counters fit the spec (streamattn.kv.snapshot checks a file's before).
        """
        kinds = {"k": (spec.storage_dtype, spec.k_width), "v": (spec.storage_dtype_v, spec.v_width)}
        for n in ("k", "v"):
            a = state[n]
            dt, width = kinds[n]
            if a.dtype != dt or a.shape[:2] + a.shape[3:] != (spec.batch, spec.kv_heads, width) \
                    or a.shape[2] > slots:
                raise ValueError(f"state[{n!r}] must be {dt} [{spec.batch}, {spec.kv_heads}, "
                                 f"<={slots}, {width}] (got {a.dtype} {tuple(a.shape)})")
        cache = cls(spec, device=device)
        first = _check_sinks(cache, state.get("sink_k"), state.get("sink_v"), "state: ", (spec.batch,))
        for n in ("k", "v"):   # a window cache is allocated in full already; a causal one may need more
            store = getattr(cache, n)
            shape = (spec.batch, spec.kv_heads, slots - first, kinds[n][1])
            store = store if store.shape == shape else storage_zeros(cache.xp, shape, kinds[n][0])
            store[:, :, :max(0, state[n].shape[2] - first)] = cache.xp.asarray(state[n][:, :, first:])
            setattr(cache, n, store)
        if first:
            cache.sink_k[...] = cache.xp.asarray(state["sink_k"])
            cache.sink_v[...] = cache.xp.asarray(state["sink_v"])
        cache.lengths, cache.last_counts, cache.held_from = (
            np.array(state[n], dtype=np.int64) for n in ("lengths", "last_counts", "held_from"))
        return cache

    def take_state(self, other: "KVCache") -> None:
        """Make this cache hold ``other``'s state (same spec, ``check_finite`` aside; same device).

        Only reference swaps, so it cannot fail halfway: restoring many layers builds every new state
        first (:meth:`from_state`) and then takes them all. ``other`` must not be used afterwards.
        """
        if other.device != self.device or dataclasses.replace(other.spec, check_finite=self.spec.check_finite) \
                != self.spec:
            raise ValueError(f"take_state needs a cache with the same spec and device "
                             f"(got {other.spec} on {other.device}, this is {self.spec} on {self.device})")
        self.k, self.v, self.sink_k, self.sink_v = other.k, other.v, other.sink_k, other.sink_v
        self.lengths, self.last_counts, self.held_from = other.lengths, other.last_counts, other.held_from

    def write_sequence(self, b: int, k, v, *, length: int, last_count: int = 0, held_from: int | None = None,
                       sink_k=None, sink_v=None) -> None:
        """Make sequence ``b`` hold ``k``, ``v`` in slots 0..n-1 (zeros after) and these counters.

        Parameters
        ----------
        k, v : [kv_heads, n, width] in the storage dtype, host or this cache's device; slot order
            (as another cache with this spec stores them), n <= min(capacity, length)
        length, last_count : tokens seen and queries of the last append (0 <= last_count <= length)
        held_from : oldest ring position still held; default ``max(n_s, length - R)`` (appends alone) for a
            window cache, 0 for a causal one
        sink_k, sink_v : [kv_heads, n_s, head_dim] of ``spec.sink_dtype``, the sinks of a cache that keeps them
            apart (required there, where slots 0 .. n_s-1 of k and v are not read; refused elsewhere)

        A causal cache grows first when n exceeds its slots (keeping every row), so a later failure
        changes nothing. Raises ValueError before writing anything.
        """
        b = check_sequence_index("b", b, self.spec.batch)
        s = self.spec
        for name, x, dt, width in (("k", k, s.storage_dtype, s.k_width), ("v", v, s.storage_dtype_v, s.v_width)):
            if x.ndim != 3 or (x.shape[0], x.shape[2]) != (s.kv_heads, width) or x.dtype != dt:
                raise ValueError(f"{name} must be {dt} [{s.kv_heads}, n, {width}] "
                                 f"(got {x.dtype} {tuple(x.shape)})")
        first = _check_sinks(self, sink_k, sink_v, "", ())
        n = k.shape[1]
        cap = self.slots if s.window is not None else (s.max_len or max(n, length))
        if v.shape[1] != k.shape[1] or not 0 <= last_count <= length or n > min(cap, length):
            raise ValueError(f"write_sequence: k {tuple(k.shape)} / v {tuple(v.shape)}, length={length}, "
                             f"last_count={last_count} are inconsistent (n <= min(slots={cap}, length))")
        if held_from is None:
            held_from = max(s.sinks, length - (cap - s.sinks)) if s.window is not None else 0
        if n > self.slots:
            self.reserve(n)
        self.k[b] = 0
        self.v[b] = 0
        self.k[b][:, :max(0, n - first)] = self.xp.asarray(k[:, first:])
        self.v[b][:, :max(0, n - first)] = self.xp.asarray(v[:, first:])
        if first:
            self.sink_k[b] = self.xp.asarray(sink_k)
            self.sink_v[b] = self.xp.asarray(sink_v)
        self.lengths[b], self.last_counts[b], self.held_from[b] = length, last_count, held_from


def _check_sinks(cache: KVCache, sink_k, sink_v, where: str, batch: tuple) -> int:
    """ValueError unless ``sink_k``, ``sink_v`` are [*batch, kv_heads, n_s, head_dim] of ``spec.sink_dtype``
    for a cache that keeps its sinks apart and None for any other; returns the slots the state's k, v hold
    in front of the ring (n_s or 0)."""
    s = cache.spec
    if cache.sink_k is None:
        if sink_k is not None or sink_v is not None:
            raise ValueError(f"{where}sink_k / sink_v are for caches that keep their sinks apart "
                             f"(this spec: {s})")
        return 0
    shape = batch + (s.kv_heads, s.sinks, s.head_dim)
    for name, x in (("sink_k", sink_k), ("sink_v", sink_v)):
        if x is None or x.dtype != s.sink_storage or tuple(x.shape) != shape:
            raise ValueError(f"{where}{name} must be {s.sink_dtype} {list(shape)} for a cache with {s.sink_dtype} "
                             f"sinks (got {None if x is None else (x.dtype, tuple(x.shape))})")
    return s.sinks


def _recode_keys(k, ks, q, xp):
    """q4_0 rows ks [B, kv_heads, T, row bytes] of keys k [B, kv_heads, T, D] re-rounded for the queries q
    [B, heads, T, D] of the same tokens, each kv head for its group of query heads
    (:func:`streamattn.kv.storage.recode_for_queries`; on the host, as the quantizer runs): returns ks."""
    from ..runtime.arrays import to_host
    k, q = (np.ascontiguousarray(to_host(a, copy=False), np.float32) for a in (k, q))
    out = np.ascontiguousarray(to_host(ks, copy=False))
    B, Hk, T, D = k.shape
    G = q.shape[1] // Hk
    for b in range(B):
        for h in range(Hk):
            recode_for_queries(k[b, h], q[b, h * G:(h + 1) * G], out[b, h])
    return out if xp is np else xp.asarray(out)
