"""Peer implementations the benchmark times beside ours, over the same ring storage.

* ``numpy_attention``: the textbook expression (scores, mask, softmax, weighted sum) in float32 numpy.
* ``torch_attention``: torch's ``scaled_dot_product_attention`` on CPU, when torch is importable
  (the optional ``peer`` extra). Not installed on the development machine: untested there.

Both read the ring in slot order under a boolean visibility mask built from (slot, length) outside the
timed region (softmax does not depend on key order; see cache.py). They are yardsticks, not backends:
no ragged batches, no padding rows.
"""

from __future__ import annotations

import numpy as np

from ..kv.storage import slot_positions, widen_bf16
from ..kv.reference import visible


def visibility(lengths, T: int, *, slots: int, sinks: int, window: int | None):
    """bool [B, T, slots]: may query t (at position lengths[b] - T + t) see the key in each slot?"""
    B = len(lengths)
    mask = np.zeros((B, T, slots), bool)
    for b in range(B):
        pos = slot_positions(int(lengths[b]), slots=slots, sinks=sinks)    # [slots], -1 = empty
        i = np.arange(lengths[b] - T, lengths[b])[:, None]                   # [T, 1]
        mask[b] = (pos >= 0) & visible(i[:, 0], pos, window=window, sinks=sinks)
    return mask


def _float32(x, kind: str):
    return widen_bf16(x) if kind == "bfloat16" else x.astype(np.float32, copy=False)


def numpy_attention(q, k, v, mask, *, scale: float, kind: str):
    """softmax(q K^T scale + mask) V in float32 numpy, the way a textbook writes it.

    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D] storage; mask: bool [B, T, S] -> out [B, Hq, T, D] float32
    """
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    kf, vf = _float32(k, kind), _float32(v, kind)                         # [B, Hkv, S, D]
    qg = q.reshape(B, Hkv, G * T, D)                                        # query head h*G+g, row g*T+t
    s = (qg @ kf.transpose(0, 1, 3, 2)).reshape(B, Hkv, G, T, S) * np.float32(scale)
    s = np.where(mask[:, None, None], s, np.float32(-np.inf))              # [B, Hkv, G, T, S]
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    out = p.reshape(B, Hkv, G * T, S) @ vf                                  # [B, Hkv, G*T, D]
    return out.reshape(B, Hq, T, D)


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def torch_attention(q, k, v, mask, *, scale: float, kind: str):
    """torch.nn.functional.scaled_dot_product_attention over the same storage (shares memory, no copy of K/V).

    q: [B, Hq, T, D] float32; k, v: [B, Hkv, S, D] storage; mask: bool [B, T, S] -> out [B, Hq, T, D] float32
    """
    import torch
    import torch.nn.functional as F
    tk = torch.from_numpy(k)
    tv = torch.from_numpy(v)
    if kind == "bfloat16":                       # raw bits -> torch's own bfloat16, same bytes
        tk, tv = tk.view(torch.bfloat16), tv.view(torch.bfloat16)
    tq = torch.from_numpy(np.ascontiguousarray(q)).to(tk.dtype)
    tm = torch.from_numpy(mask)[:, None]         # [B, 1, T, S], broadcast over heads
    with torch.no_grad():
        out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, scale=scale,
                                             enable_gqa=tq.shape[1] != tk.shape[1])
    return out.float().numpy()
