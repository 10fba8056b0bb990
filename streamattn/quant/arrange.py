"""How a loaded model's packed matrices sit in memory: fused row groups, and one buffer for all of them.

Both are layout only: every matrix keeps its values (the parts of a fused group are row views of it).
"""

from __future__ import annotations

import numpy as np

from streamattn.quant.weights import QWeight, concat_rows, move_planes, row_slice


def fuse(weights: dict, groups) -> dict:
    """Each row group of ``groups`` (tuples of names in ``weights``, in row order: a layer's q, k, v) as one
    matrix, keyed by the tuple; its parts in ``weights`` become row views of it (one copy in memory).
    Groups whose packed kinds differ stay apart (the model multiplies them one by one)."""
    fused = {}
    for names in groups:
        ws = [weights[n] for n in names]
        if all(isinstance(w, QWeight) for w in ws):
            f = concat_rows(ws)
        elif not any(isinstance(w, QWeight) for w in ws):
            f = np.ascontiguousarray(np.concatenate(ws, 0), np.float32)
        else:
            f = None
        if f is None:
            continue
        fused[tuple(names)] = f
        _slice_parts(weights, f, names)
    return fused


def _slice_parts(weights: dict, whole, names) -> None:
    """weights[name] for each of ``names`` (in row order): its rows of the fused matrix ``whole``, as views."""
    row = 0
    for n in names:
        rows = weights[n].shape[0]
        weights[n] = row_slice(whole, row, row + rows)
        row += rows


def into_one_buffer(weights: dict, fused: dict, order) -> None:
    """Move every packed matrix into one allocation in the order a forward pass reads them (``order``:
    tensor names; a fused group takes the place of its first part): :func:`streamattn.quant.weights.move_planes`.
    The parts of a fused group become row views of its moved copy again."""
    group_of = {names[0]: names for names in fused}
    viewed = {n for names in fused for n in names}             # row views of a fused copy: not owners
    owners = []
    for n in order:
        key = group_of.get(n, n)
        w = fused[key] if n in group_of else None if n in viewed else weights[n]
        if isinstance(w, QWeight):
            owners.append((key, w))

    def moved(key, new):
        if key not in fused:
            weights[key] = new
            return
        fused[key] = new
        _slice_parts(weights, new, key)

    move_planes(owners, moved)                   # consumes owners: each old copy goes at once
