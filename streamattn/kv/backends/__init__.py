"""Backends: one signature, picked by name.

Every backend is ``fn(q, k, v, lengths, counts, *, window, sinks, scale, kind, q_sink=None, kind_v=None,
softcap=None) -> (out, lse)`` over the
ring storage of one layer (see ``streamattn.kv.backends.cpu.attend`` for the argument contract).
"""

from __future__ import annotations

import numpy as np

from ...runtime.arrays import to_host
from ..storage import slot_positions, widen
from .. import reference

BACKENDS = ("reference", "cpu", "gpu")


def reference_backend(q, k, v, lengths, counts, *, window, sinks, scale, kind, q_sink=None, kind_v=None, softcap=None):
    """The float64 oracle applied to what the ring holds (slots decoded to positions; quantized rows
    dequantized: the values the kernels read)."""
    q, k, v = (to_host(a, copy=False) for a in (q, k, v))
    qs = q if q_sink is None else to_host(q_sink, copy=False)
    B, Hq, T, D = q.shape
    kind_v = kind if kind_v is None else kind_v
    wide = lambda a, dt: widen(a, dt, D).astype(np.float64)  # noqa: E731
    out = np.zeros((B, Hq, T, D), np.float64)
    lse = np.full((B, Hq, T), -np.inf, np.float64)
    for b in range(B):
        c = int(counts[b])
        if c == 0:
            continue
        pos = slot_positions(int(lengths[b]), slots=k.shape[2], sinks=sinks)  # [slots], -1 = empty
        held = np.nonzero(pos >= 0)[0]
        q_pos = np.arange(lengths[b] - c, lengths[b])
        out[b, :, :c], lse[b, :, :c] = reference.attention(
            q[b, :, :c], wide(k[b][:, held], kind), wide(v[b][:, held], kind_v), q_pos,
            window=window or None, sinks=sinks, scale=scale, k_pos=pos[held], q_sink=qs[b, :, :c],
            softcap=softcap)
    return out.astype(q.dtype), lse.astype(np.float32)


def get(name: str, device: str):
    """The backend function called ``name`` ("reference", "cpu", "gpu" or "auto") for a cache on ``device``."""
    if name == "auto":  # the cache's device decides: a GPU cache is built only where CuPy sees a device
        name = "gpu" if device == "gpu" else "cpu"
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS + ('auto',)} (got {name!r})")
    if name == "gpu" and device != "gpu":
        raise ValueError("backend='gpu' needs a cache built with device='gpu' (this one lives on the cpu)")
    if name == "cpu" and device != "cpu":
        raise ValueError("backend='cpu' needs a cache built with device='cpu' (this one lives on the gpu)")
    if name == "reference":
        return reference_backend
    if name == "cpu":
        from . import cpu
        return cpu.attend
    from . import gpu

    def gpu_attend(q, k, v, lengths, counts, *, window, sinks, scale, kind, q_sink=None, kind_v=None, softcap=None,
                   device_lengths=None, device_counts=None):
        return gpu.attend(q, k, v, lengths, counts, window=window, sinks=sinks, scale=scale,
                          q_sink=q_sink, kind=kind, kind_v=kind_v, softcap=softcap,
                          device_lengths=device_lengths, device_counts=device_counts)
    gpu_attend.reads_device_counters = True   # a GPU cache's counters on the device (streamattn.kv.dispatch)
    return gpu_attend
