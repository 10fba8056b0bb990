"""Whole-state and one-sequence operations of :class:`streamattn.cache.KVCache`, kept apart from the
ring's append/attend path: streamattn.state, streamattn.snapshot, the server's prompt cache and the
benchmarks use these to copy, restore and rewrite a cache's contents."""

from __future__ import annotations

import dataclasses

import numpy as np

from .arrays import check_sequence_index, to_host
from .spec import CacheSpec
from .storage import storage_zeros


class StateOps:
    """Mixed into KVCache: the methods below read and write its ``k``, ``v``, ``lengths``, ``last_counts``,
    ``held_from``, ``spec``, ``device`` and ``xp``."""

    def export_state(self, rows: slice = slice(None)) -> dict:
        """Host copies of the state of sequences ``rows``: what a snapshot stores.

        Returns
        -------
        dict with
            k, v : [n, kv_heads, U, head_dim] storage dtype, slots 0 .. U-1 with U = min(slots, max length)
                (every slot at or past U is zero)
            lengths, last_counts, held_from : int64 [n]
        """
        lengths = self.lengths[rows]
        used = min(self.slots, int(lengths.max()) if lengths.size else 0)
        return {"k": to_host(self.k[rows, :, :used]), "v": to_host(self.v[rows, :, :used]),
                "lengths": lengths.copy(), "last_counts": self.last_counts[rows].copy(),
                "held_from": self.held_from[rows].copy()}

    @classmethod
    def from_state(cls, spec: CacheSpec, state: dict, *, slots: int, device: str = "cpu") -> "KVCache":
        """A new cache of ``slots`` slots holding ``state`` (as :meth:`export_state` gives it for all rows).

        The caller vouches that the counters fit the spec (streamattn.snapshot checks a file's before).
        """
        shape = (spec.batch, spec.kv_heads, slots, spec.head_dim)
        for n in ("k", "v"):
            a = state[n]
            if a.dtype != spec.storage_dtype or a.shape[:2] + a.shape[3:] != shape[:2] + shape[3:] \
                    or a.shape[2] > slots:
                raise ValueError(f"state[{n!r}] must be {spec.storage_dtype} [{spec.batch}, {spec.kv_heads}, "
                                 f"<={slots}, {spec.head_dim}] (got {a.dtype} {tuple(a.shape)})")
        cache = cls(spec, device=device)
        for n in ("k", "v"):   # a window cache is allocated in full already; a causal one may need more
            store = getattr(cache, n)
            store = store if store.shape == shape else storage_zeros(cache.xp, shape, spec.storage_dtype)
            store[:, :, :state[n].shape[2]] = cache.xp.asarray(state[n])
            setattr(cache, n, store)
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
        self.k, self.v = other.k, other.v
        self.lengths, self.last_counts, self.held_from = other.lengths, other.last_counts, other.held_from
        self.__dict__.pop("_kernel_views", None)      # views a model kept of the old arrays (models/compiled.py)

    def write_sequence(self, b: int, k, v, *, length: int, last_count: int = 0, held_from: int | None = None) -> None:
        """Make sequence ``b`` hold ``k``, ``v`` in slots 0..n-1 (zeros after) and these counters.

        Parameters
        ----------
        k, v : [kv_heads, n, head_dim] in the storage dtype, host or this cache's device; slot order
            (as another cache with this spec stores them), n <= min(capacity, length)
        length, last_count : tokens seen and queries of the last append (0 <= last_count <= length)
        held_from : oldest ring position still held; default ``max(n_s, length - R)`` (appends alone) for a
            window cache, 0 for a causal one

        A causal cache grows first when n exceeds its slots (keeping every row), so a later failure
        changes nothing. Raises ValueError before writing anything.
        """
        b = check_sequence_index("b", b, self.spec.batch)
        s = self.spec
        want = (s.kv_heads, s.head_dim)
        for name, x in (("k", k), ("v", v)):
            if x.ndim != 3 or (x.shape[0], x.shape[2]) != want or x.dtype != s.storage_dtype:
                raise ValueError(f"{name} must be {s.storage_dtype} [{s.kv_heads}, n, {s.head_dim}] "
                                 f"(got {x.dtype} {tuple(x.shape)})")
        n = k.shape[1]
        cap = self.slots if s.window is not None else (s.max_len or max(n, length))
        if v.shape != k.shape or not 0 <= last_count <= length or n > min(cap, length):
            raise ValueError(f"write_sequence: k {tuple(k.shape)} / v {tuple(v.shape)}, length={length}, "
                             f"last_count={last_count} are inconsistent (n <= min(slots={cap}, length))")
        if held_from is None:
            held_from = max(s.sinks, length - (cap - s.sinks)) if s.window is not None else 0
        if n > self.slots:
            self.reserve(n)
        self.k[b] = 0
        self.v[b] = 0
        self.k[b][:, :n] = self.xp.asarray(k)
        self.v[b][:, :n] = self.xp.asarray(v)
        self.lengths[b], self.last_counts[b], self.held_from[b] = length, last_count, held_from
