"""A GPU cache's counters on the device, and one finite check per step instead of two per layer.

``DeviceCounters`` keeps int32 ``lengths`` and ``counts`` [batch] on the device beside the cache's int64 host
copies (which the host schedules with, no sync needed): the append kernel (kernels/append.cu) reads them,
``lengths += counts`` advances them on the device, and attention launches read them, so a decode step
uploads nothing. A host copy of what the device holds (the mirror) tells when the host changed the
counters some other way (reset, truncate, a restored state): then the next use uploads them, once.

``DeviceStep`` is one step over any number of caches (a model's layers): every append lowers the step's
device flag where a row is NaN or inf as stored, and :meth:`DeviceStep.finish` reads that flag once, at
the step's end. A non-finite step is rolled back: the written slots get their old bytes back (the kernel
saved them) and every cache's host counters return to before the step, so attention sees every cache
exactly as before it; then the CPU path's error is raised (``storage.non_finite_error``, naming the
first layer's K, else its V, and the sequence).
"""
from __future__ import annotations

import contextlib

import numpy as np

from .backends.gpu_append import FLAG_CLEAR
from .storage import non_finite_error


class DeviceCounters:
    """int32 device copies of a cache's ``lengths`` and ``last_counts`` [batch], and a host mirror of them.

    ``lengths``, ``counts``: device int32 [batch]; ``mirror``: host int64 [2, batch], what they hold.
    """

    def __init__(self, xp, batch: int):
        self.xp = xp
        self.lengths = xp.zeros(batch, dtype=np.int32)          # [batch] device
        self.counts = xp.zeros(batch, dtype=np.int32)           # [batch] device
        self.mirror = np.zeros((2, batch), np.int64)            # [2, batch] host: lengths, counts as on device

    def head(self, n: int) -> "DeviceCounters":
        """The first n sequences' counters, sharing these arrays (a KVCache.head view)."""
        view = object.__new__(DeviceCounters)
        view.xp, view.lengths, view.counts = self.xp, self.lengths[:n], self.counts[:n]
        view.mirror = self.mirror[:, :n]
        return view

    def match(self, lengths, counts):
        """The device arrays (lengths, counts), made to hold the host values given: uploaded only where the
        mirror says they differ (the first step, after a reset or a restored state, a new count). Raises
        ValueError, changing nothing, where a position would pass int32 (the device counters' type)."""
        end = int(np.max(lengths, initial=0)) + int(np.max(counts, initial=0))
        if end >= 2 ** 31:
            raise ValueError(f"positions up to {end} (lengths + counts) reach the device counters' int32 limit "
                             f"2**31; a GPU cache holds positions < 2**31")
        if not np.array_equal(self.mirror[0], lengths):
            self.lengths[...] = self.xp.asarray(np.asarray(lengths, np.int32))
            self.mirror[0] = lengths
        if not np.array_equal(self.mirror[1], counts):
            self.counts[...] = self.xp.asarray(np.asarray(counts, np.int32))
            self.mirror[1] = counts
        return self.lengths, self.counts

    def advance(self) -> None:
        """lengths += counts, on the device (no sync) and in the mirror."""
        self.lengths += self.counts
        self.mirror[0] += self.mirror[1]

    def forget(self) -> None:
        """Mark the device copies stale: the next :meth:`match` uploads."""
        self.mirror[...] = -1


class DeviceStep:
    """One step's appends over GPU caches: a device flag, what each append changed, one read at the end.

    Use as a context manager around a step (a model's layers), or call :meth:`finish`; a cache that appends
    outside any step makes a step of its own append (one sync an append). One object serves step after step:
    its device flag is allocated once, and :meth:`over` points it at the next step's caches (a model whose
    caches are new views each step keeps one). It is one step at a time: entering it while open raises.

    Examples
    --------
    >>> with DeviceStep(caches):                          # doctest: +SKIP
    ...     logits = model.forward(tokens, caches)
    """

    def __init__(self, caches=(), xp=None):
        self.caches = list(caches)
        if xp is None and not self.caches:
            raise ValueError("DeviceStep needs the caches of the step or their array module xp (got neither)")
        self.xp = xp if xp is not None else self.caches[0].xp
        # [2] on the caches' GPU (CuPy's a.device is its context manager), one allocation for every step
        device = getattr(getattr(self.caches[0], "k", None), "device", None) if self.caches else None
        with device if hasattr(device, "__enter__") else contextlib.nullcontext():
            flags = self.xp.full(2, FLAG_CLEAR, dtype=np.int32)
        self.flag = flags[0:1]          # [1] the lowest code seen (FLAG_CLEAR again after each step)
        self.scratch = flags[1:2]       # [1] what caches that skip the check lower (never read)
        # (cache, code_base, counts, host lengths/last_counts/held_from before, undo_k, undo_v)
        self.entries = []
        self.codes = 0
        self.open = False               # inside ``with``: the caches report their appends here

    def over(self, caches) -> "DeviceStep":
        """This step object, its device flag kept, for a step over ``caches`` (same array module); returns
        self. Raises, changing nothing, RuntimeError while a step is open or holds appends, ValueError where
        a cache's ``xp`` is not this step's."""
        if self.open or self.entries:
            state = "is open" if self.open else f"holds {len(self.entries)} unfinished appends: call finish()"
            raise RuntimeError(f"DeviceStep.over: the step on this object {state}; a step inside another "
                               "needs a DeviceStep of its own")
        caches = list(caches)
        other = [c.xp for c in caches if c.xp is not self.xp]
        if other:
            raise ValueError(f"DeviceStep.over: caches on array module {getattr(other[0], '__name__', other[0])}, "
                             f"this step's flag on {getattr(self.xp, '__name__', self.xp)}: one step is one "
                             "array module")
        self.caches = caches
        return self

    def __enter__(self):
        if self.open:
            raise RuntimeError("DeviceStep entered while its step is open; a step inside another needs a "
                               "DeviceStep of its own")
        self.open = True
        for cache in self.caches:
            cache.step = self
        return self

    def __exit__(self, exc_type, exc, tb):
        self.open = False
        for cache in self.caches:
            cache.step = None
        if exc_type is None:
            self.finish()
        else:
            self.undo()
        return False

    def undo(self) -> None:
        """Roll every append of the step back, newest first, without reading the flag: a step that raised
        (an out-of-memory growth at some layer, a graph error, an interrupt) leaves the caches as before it."""
        entries, self.entries, self.codes = self.entries, [], 0
        for cache, _, counts, before, undo_k, undo_v in reversed(entries):
            _restore(cache, counts, before, undo_k, undo_v)
        self.flag[...] = FLAG_CLEAR

    def record(self, cache, counts, undo_k, undo_v):
        """Note an append to ``cache`` of ``counts`` [batch] rows (before its host counters move); returns
        (flag, code_base) for the kernel."""
        before = (cache.lengths.copy(), cache.last_counts.copy(), cache.held_from.copy())
        base = self.codes
        self.codes += _codes(cache)
        self.entries.append((cache, base, np.array(counts, np.int64), before, undo_k, undo_v))
        return (self.flag if cache.spec.check_finite else self.scratch), base

    def finish(self) -> None:
        """Read the flag (the step's one sync); if a row was NaN or inf, roll every append back and raise the
        CPU path's ValueError; else forget the step."""
        entries, self.entries, self.codes = self.entries, [], 0
        if not entries:
            return
        code = int(self.flag.get()[0])
        if code == FLAG_CLEAR:
            return
        self.flag[...] = FLAG_CLEAR
        first = None
        for cache, base, counts, before, undo_k, undo_v in reversed(entries):   # newest first
            _restore(cache, counts, before, undo_k, undo_v)
            if base <= code < base + _codes(cache):
                check, b = divmod(code - base, cache.spec.batch)     # K, V as stored; K, V of the sink store
                spec = cache.spec
                first = non_finite_error("kvkv"[check], b, (spec.dtype, spec.v_dtype, spec.sink_dtype,
                                                             spec.sink_dtype)[check])
        if first is None:
            raise RuntimeError(f"DeviceStep: the finite flag holds code {code}, which no append of the step owns")
        raise first


def _codes(cache) -> int:
    """Flag codes an append to ``cache`` takes: K and V of each sequence, twice with its sinks apart."""
    return (2 if cache.sink_k is None else 4) * cache.spec.batch


def _restore(cache, counts, before, undo_k, undo_v) -> None:
    """Undo one append: the old bytes back into the slots it wrote, its sink rows (sinks apart) zero again
    (a sink row is written once: before, it held nothing), the host counters as they were."""
    xp = cache.xp
    lengths, n_s = before[0], cache.spec.sinks
    apart = cache.sink_k is not None
    for b in np.nonzero(counts)[0]:
        L, c = int(lengths[b]), int(counts[b])
        s = min(max(n_s - L, 0), c) if apart else 0             # rows that went to the sink store
        if s:
            cache.sink_k[b, :, L:L + s] = 0
            cache.sink_v[b, :, L:L + s] = 0
        pos = np.arange(L + s, L + c)                            # [c - s] ring positions
        idx = xp.asarray((pos - n_s) % cache.ring if apart else cache.slots_of(pos))
        cache.k[b][:, idx] = undo_k[b, :, s:c]
        cache.v[b][:, idx] = undo_v[b, :, s:c]
    cache.lengths[:], cache.last_counts[:], cache.held_from[:] = before
    cache.counters.forget()
