"""Test support: the full K/V history kept beside a cache, and the tolerances, stated once."""

from __future__ import annotations

import numpy as np

from streamattn.kv.reference import TOLERANCE, attention

# max |out - oracle| / max |oracle| (streamattn.kv.reference.TOLERANCE says what it measures; quantized
# storage against the dequantized stored values, as_stored).
TOL = TOLERANCE
LSE_TOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2, "q8_0": 1e-4, "q4_0": 1e-4}  # absolute, natural log
_GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0"}


def rel_err(got, ref, floor: float = 1e-30) -> float:
    """The suite's error measure: max |got - ref| / max(max |ref|, floor), in float64 (compared on finite
    entries; the non-finite ones, e.g. a mask's -inf, must sit in the same places, else inf)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.array_equal(np.isfinite(got), np.isfinite(ref)):
        return np.inf
    fin = np.isfinite(ref)
    if not fin.any():
        return 0.0
    return float(np.abs(got[fin] - ref[fin]).max() / max(np.abs(ref[fin]).max(), floor))


def rotation(head_dim: int) -> np.ndarray:
    """The key rotation of a ``rotate_k`` cache, built apart from streamattn.kv.rotation (scipy's Sylvester
    Hadamard): float64 [head_dim, head_dim], block diagonal, blocks of 32 and the tail's powers of two."""
    from scipy.linalg import hadamard, block_diag
    sizes, rest = [32] * (head_dim // 32), head_dim % 32
    sizes += [1 << b for b in range(5, -1, -1) if rest & (1 << b)]
    return block_diag(*[hadamard(n) / np.sqrt(n) for n in sizes])


def as_stored(x, dtype: str):
    """float32 values of ``x`` as a cache of storage ``dtype`` holds them (round to nearest even; ml_dtypes for
    bfloat16, independent of the cache's own conversion). An oracle over these isolates the kernels'
    arithmetic from storage rounding, so it can be checked at the float32 tolerance at any head_dim."""
    if dtype == "float32":
        return np.asarray(x, np.float32)
    if dtype in _GGUF_TYPES:   # gguf-py's own quantizer and dequantizer, rows zero-padded to blocks of 32
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize
        qt = GGMLQuantizationType[_GGUF_TYPES[dtype]]
        x = np.asarray(x, np.float32)
        d = x.shape[-1]
        pad = np.zeros(x.shape[:-1] + (-d % 32,), np.float32)
        return dequantize(quantize(np.concatenate([x, pad], axis=-1), qt), qt)[..., :d]
    import ml_dtypes
    store = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    return np.asarray(x, np.float32).astype(store).astype(np.float32)


class History:
    """Every K/V row ever appended, per sequence, in temporal order: what full attention sees."""

    def __init__(self, batch: int, spec=None):
        self.k = [[] for _ in range(batch)]   # per sequence: list of [kv_heads, t, d]
        self.v = [[] for _ in range(batch)]
        # a quantized cache's rows are kept as stored (gguf-py's round trip): see TOL
        self.stored = [dt if spec is not None and dt in _GGUF_TYPES else "float32"
                       for dt in ((spec.dtype, spec.v_dtype) if spec is not None else ("float32",) * 2)]
        # sinks apart (spec.sink_dtype float16 / float32): positions < n_s kept as that dtype rounds them
        self.sink_dtype = getattr(spec, "sink_dtype", None) if spec is not None else None
        self.sinks_apart = spec.sinks if self.sink_dtype else 0
        # a rotate_k cache stores k @ H (rounded once to float32, then cast) and scores q @ H: kept and scored the same here
        self.H = rotation(spec.head_dim) if spec is not None and spec.rotate_k else None

    def append(self, k, v, counts):
        if self.H is not None:
            k = (np.asarray(k, np.float64) @ self.H).astype(np.float32)      # k @ H rounded once, as stored
        raw = k, v
        if self.stored != ["float32", "float32"]:
            k, v = as_stored(k, self.stored[0]), as_stored(v, self.stored[1])
        for b, c in enumerate(counts):
            if c:
                rows = [np.asarray(x[b, :, :c], np.float64) for x in (k, v)]
                # (length() walks the whole history: asked only where sinks are kept apart, or a long
                # stream would spend quadratic time here)
                s = min(max(self.sinks_apart - self.length(b), 0), int(c)) if self.sinks_apart else 0
                for i in range(2 if s else 0):
                    rows[i][:, :s] = as_stored(raw[i][b, :, :s], self.sink_dtype)
                self.k[b].append(rows[0])
                self.v[b].append(rows[1])

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
        if self.H is not None:
            q = np.asarray(q, np.float64) @ self.H
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
