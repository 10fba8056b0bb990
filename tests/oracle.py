"""Test support: the full K/V history kept beside a cache, and the tolerances, stated once."""

from __future__ import annotations

import numpy as np

from streamattn.reference import TOLERANCE, attention

# max |out - oracle| / max |oracle| (streamattn.reference.TOLERANCE says what it measures).
TOL = TOLERANCE
LSE_TOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}  # absolute, natural log


def as_stored(x, dtype: str):
    """float32 values of ``x`` as a cache of storage ``dtype`` holds them (round to nearest even; ml_dtypes for
    bfloat16, independent of the cache's own conversion). An oracle over these isolates the kernels'
    arithmetic from storage rounding, so it can be checked at the float32 tolerance at any head_dim."""
    if dtype == "float32":
        return np.asarray(x, np.float32)
    import ml_dtypes
    store = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    return np.asarray(x, np.float32).astype(store).astype(np.float32)


class History:
    """Every K/V row ever appended, per sequence, in temporal order: what full attention sees."""

    def __init__(self, batch: int):
        self.k = [[] for _ in range(batch)]   # per sequence: list of [kv_heads, t, d]
        self.v = [[] for _ in range(batch)]

    def append(self, k, v, counts):
        for b, c in enumerate(counts):
            if c:
                self.k[b].append(np.asarray(k[b, :, :c], np.float64))
                self.v[b].append(np.asarray(v[b, :, :c], np.float64))

    def reset(self, b):
        self.k[b], self.v[b] = [], []

    def truncate(self, b, length):
        """Keep the first ``length`` tokens of sequence b (what a rewind leaves)."""
        if length < self.length(b):
            k, v = (np.concatenate(x[b], axis=1)[:, :length] for x in (self.k, self.v))
            self.k[b], self.v[b] = ([k], [v]) if length else ([], [])

    def copy(self, src, dst, into=None):
        """Sequence ``dst`` (of ``into``, default this history) becomes a copy of sequence ``src`` (a fork)."""
        into = self if into is None else into
        into.k[dst], into.v[dst] = list(self.k[src]), list(self.v[src])

    def length(self, b):
        return sum(x.shape[1] for x in self.k[b])

    def expected(self, q, b, c, spec, scale=None, softcap=None):
        """Oracle (out, lse) for the newest ``c`` queries of sequence b: q [q_heads, c, d]."""
        k = np.concatenate(self.k[b], axis=1)
        v = np.concatenate(self.v[b], axis=1)
        L = k.shape[1]
        return attention(q, k, v, np.arange(L - c, L), window=spec.window, sinks=spec.sinks, scale=scale,
                         softcap=softcap)


def check(out, lse, q, hist, counts, spec, scale=None, what="", softcap=None):
    """Assert every real row of (out, lse) equals the oracle within the dtype's tolerance; padding is 0."""
    out = out.get() if hasattr(out, "get") else out
    lse = lse.get() if hasattr(lse, "get") else lse
    for b, c in enumerate(counts):
        c = int(c)
        assert np.all(out[b, :, c:] == 0), f"{what}: padding rows of sequence {b} are not zero"
        if c == 0:
            continue
        ro, rl = hist.expected(q[b, :, :c], b, c, spec, scale, softcap)
        err = np.abs(out[b, :, :c].astype(np.float64) - ro).max() / max(np.abs(ro).max(), 1e-30)
        assert err <= TOL[spec.dtype], f"{what}: sequence {b}: relative error {err:.3g} > {TOL[spec.dtype]}"
        lerr = np.abs(lse[b, :, :c] - rl).max()
        assert lerr <= LSE_TOL[spec.dtype], f"{what}: sequence {b}: lse error {lerr:.3g}"
