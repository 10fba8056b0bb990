"""How a loaded model's packed matrices sit in memory: fused row groups, and one buffer for all of them.

Both are layout only: every matrix keeps its values (the parts of a fused group are row views of it).
"""

from __future__ import annotations

import numpy as np

from streamattn.models import quant
from streamattn.models.quant import QWeight, concat_rows, row_slice

#: Row groups multiplied as one matrix (one read of the layer's input for all of them).
FUSED = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_gate_up": ("ffn_gate", "ffn_up")}


def fuse(weights: dict, n_layers: int) -> dict:
    """Each layer's :data:`FUSED` row groups as one matrix; the parts in ``weights`` become row views of
    it (one copy in memory). Groups whose packed kinds differ stay apart (the model multiplies them
    one by one)."""
    fused = {}
    for i in range(n_layers):
        for key, parts in FUSED.items():
            names = [f"blk.{i}.{p}.weight" for p in parts]
            ws = [weights[n] for n in names]
            if all(isinstance(w, QWeight) for w in ws):
                f = concat_rows(ws)
            elif not any(isinstance(w, QWeight) for w in ws):
                f = np.ascontiguousarray(np.concatenate(ws, 0), np.float32)
            else:
                f = None
            if f is None:
                continue
            fused[f"blk.{i}.{key}.weight"] = f
            _slice_parts(weights, f, names)
    return fused


def _slice_parts(weights: dict, whole, names) -> None:
    """weights[name] for each of ``names`` (in row order): its rows of the fused matrix ``whole``, as views."""
    row = 0
    for n in names:
        rows = weights[n].shape[0]
        weights[n] = row_slice(whole, row, row + rows)
        row += rows


_USE_ORDER = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_gate_up", "ffn_down")


def into_one_buffer(weights: dict, fused: dict, n_layers: int) -> None:
    """Move every packed matrix into one allocation in the order a forward pass reads them (layer by
    layer, then the output head): :func:`streamattn.models.quant.move_planes`. The parts of a fused
    group become row views of its moved copy again."""
    parts_of = {f"blk.{i}.{key}.weight": [f"blk.{i}.{p}.weight" for p in ps]
                for i in range(n_layers) for key, ps in FUSED.items()}
    viewed = {p for f in fused for p in parts_of[f]}             # row views of a fused copy: not owners

    def order(name):
        bits = name.split(".")
        if bits[0] != "blk":
            return (n_layers, 0, name)
        rank = _USE_ORDER.index(bits[2]) if bits[2] in _USE_ORDER else len(_USE_ORDER)
        return (int(bits[1]), rank, name)

    def moved(name, new):
        if name not in fused:
            weights[name] = new
            return
        fused[name] = new
        _slice_parts(weights, new, parts_of[name])

    owners = sorted(((n, w) for n, w in (*weights.items(), *fused.items()) if isinstance(w, QWeight)
                     and n not in viewed), key=lambda nw: order(nw[0]))
    quant.move_planes(owners, moved)                   # consumes owners: each old copy goes at once
