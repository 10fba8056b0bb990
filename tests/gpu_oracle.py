"""The float64 oracle in the batched form the GPU tests use, and ring-filling helpers (independent of the kernels)."""
from __future__ import annotations

import numpy as np

from oracle import rel_err  # noqa: F401  (go.rel_err: the suite's one error measure)
from streamattn.kv import reference

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes is a core dependency
    ml_dtypes = None

TOL = reference.TOLERANCE  # max abs diff / max abs ref


def attention(q, k_hist, v_hist, q_pos, *, window, sinks, scale, softcap=None):
    """Batched front of streamattn.kv.reference.attention (the project's one float64 oracle).

    q: [batch, q_heads, T, d]; k_hist, v_hist: [batch, kv_heads, n, d] (position j at index j);
    q_pos: [batch, T] absolute positions, -1 for a padding row (zeros, lse = -inf).
    Returns out [batch, q_heads, T, d] float64 and lse [batch, q_heads, T] float64.
    """
    q_pos = np.asarray(q_pos)
    out = np.zeros(q.shape, np.float64)
    lse = np.full(q.shape[:3], -np.inf)
    for b in range(q.shape[0]):
        rows = np.nonzero(q_pos[b] >= 0)[0]
        if rows.size:
            out[b][:, rows], lse[b][:, rows] = reference.attention(
                q[b][:, rows], k_hist[b], v_hist[b], q_pos[b][rows], window=window or None, sinks=sinks,
                scale=scale, softcap=softcap)
    return out, lse


def slot_of(j: int, *, window: int, sinks: int, slots: int) -> int:
    """Cache slot of absolute position j (docs/DESIGN.md §2)."""
    return j if window == 0 or j < sinks else sinks + (j - sinks) % (slots - sinks)


def fill_cache(k_hist, v_hist, lengths, *, window, sinks, slots):
    """Ring contents after writing positions 0..lengths[b]-1 in order: k, v [batch, kv_heads, slots, d]."""
    batch, kv_heads, _, d = k_hist.shape
    # Never-written slots hold NaN (bf16 bits 0x7fc0; quantized rows 0xff bytes: NaN scales): a kernel that
    # reads one poisons its output.
    poison = {np.dtype(np.uint16): 0x7FC0, np.dtype(np.uint8): 0xFF}.get(k_hist.dtype, np.nan)
    k = np.full((batch, kv_heads, slots, d), poison, k_hist.dtype)
    v = k.copy()
    for b in range(batch):
        for j in range(lengths[b]):
            s = slot_of(j, window=window, sinks=sinks, slots=slots)
            k[b, :, s], v[b, :, s] = k_hist[b, :, j], v_hist[b, :, j]
    return k, v


def storage(a, dtype: str):
    """float64 array -> (stored array the kernels read, its float64 value) for dtype name."""
    if dtype == "bfloat16":
        stored = np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)
        return stored.view(np.uint16), stored.astype(np.float64)
    if dtype in ("q8_0", "q4_0"):   # gguf-py's blocks and their values (head_dim a multiple of 32 here)
        try:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize, quantize
        except ImportError:         # a GPU image without gguf (scripts/gpu_check.sh installs nothing): our
            from streamattn.kv import storage   # quantizer, the same bytes (tests/test_kv_quant.py checks them)
            stored = storage.quantize(np.asarray(a, np.float32), dtype)[0]
            return stored, storage.dequantize(stored, dtype, a.shape[-1]).astype(np.float64)
        qt = GGMLQuantizationType[dtype.upper()]
        stored = quantize(np.asarray(a, np.float32), qt)
        return stored, dequantize(stored, qt).astype(np.float64)
    stored = np.asarray(a).astype(dtype)
    return stored, stored.astype(np.float64)


def lse_err(got, ref) -> float:
    """:func:`rel_err` of log-sum-exps with its scale floored at 1: an lse is a log, so its absolute error
    is the relative error of exp(lse); where every lse is near 0 (short histories) a plain relative error
    measured float32's last bit of a tiny number (hypothesis found lse ~0.05 off by 6e-7: "1.3e-5")."""
    return rel_err(got, ref, 1.0)


def case(rng, *, batch, q_heads, kv_heads, head_dim, lengths, counts, T, window, sinks, dtype, q_dtype="float32",
         softcap=None, q_gain=1.0, dtype_v=None):
    """Random history, ring, queries (N(0, q_gain²)) and oracle answer for one attention call ("write, then
    attend"), with the scores soft-capped by ``softcap`` (None: not); V stored as ``dtype_v`` (default
    ``dtype``).

    Returns dict with q, k, v (stored), lengths, counts, ref_out, ref_lse, scale, softcap.
    """
    lengths, counts = np.asarray(lengths), np.asarray(counts)
    n = int(lengths.max())
    k_hist = rng.standard_normal((batch, kv_heads, n, head_dim))
    v_hist = rng.standard_normal((batch, kv_heads, n, head_dim))
    k_store, k_val = storage(k_hist, dtype)
    v_store, v_val = storage(v_hist, dtype_v or dtype)
    if window:
        slots = sinks + window + max(int(counts.max()), 1) - 1
    else:
        slots = n + 3  # spare slots past the longest sequence are never visible
    if dtype_v is None:
        k, v = fill_cache(k_store, v_store, lengths, window=window, sinks=sinks, slots=slots)
    else:                                            # filled apart: each side keeps its own dtype and row width
        k = fill_cache(k_store, k_store, lengths, window=window, sinks=sinks, slots=slots)[0]
        v = fill_cache(v_store, v_store, lengths, window=window, sinks=sinks, slots=slots)[0]
    q = (q_gain * rng.standard_normal((batch, q_heads, T, head_dim))).astype(q_dtype)
    q_pos = np.full((batch, T), -1)
    for b in range(batch):
        q_pos[b, :counts[b]] = lengths[b] - counts[b] + np.arange(counts[b])
    scale = 1.0 / np.sqrt(head_dim)
    ref_out, ref_lse = attention(q.astype(np.float64), k_val, v_val, q_pos, window=window, sinks=sinks, scale=scale,
                                 softcap=softcap)
    return dict(q=q, k=k, v=v, lengths=lengths, counts=counts, ref_out=ref_out, ref_lse=ref_lse, scale=scale,
                window=window, sinks=sinks, softcap=softcap)
