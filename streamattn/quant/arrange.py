"""How a loaded model's packed matrices sit in memory: fused row groups, one after another in the order a
forward pass reads them, in one buffer or one file (:mod:`streamattn.quant.packed_file`).

All of it is layout only: every matrix keeps its values (the parts of a fused group are row views of it).
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


def _slice_parts(weights: dict, whole, names, rows=None) -> None:
    """weights[name] for each of ``names`` (in row order): its rows of the fused matrix ``whole``, as views
    (``rows``: name -> row count; default: the parts' own shapes)."""
    row = 0
    for n in names:
        count = weights[n].shape[0] if rows is None else rows[n]
        weights[n] = row_slice(whole, row, row + count)
        row += count


def packed_in_order(order, groups, pack_one):
    """Pack matrices one at a time, in the order a forward pass reads them, fusing row groups on the way.

    ``order``: tensor names; ``groups``: tuples of names (in row order) to fuse where their kinds allow
    (:func:`streamattn.quant.weights.concat_rows`), each group's names all packed; ``pack_one(name)``: the
    QWeight of a tensor, or None for one that is not packed. Yields ``(key, QWeight)``: key a name, or the
    tuple of a fused group, which takes the place of its first part (a group that does not fuse yields its
    parts at their own places). Only a group's parts are held at once, so a consumer that writes each
    weight out (:func:`streamattn.quant.packed_file.write`) keeps one weight in memory."""
    first = {names[0]: tuple(names) for names in groups}
    waiting = {}                                 # parts of a group that did not fuse, until their turn
    inside = set()                               # later parts of a fused group: yielded with its first
    for n in order:
        if n in waiting:
            yield n, waiting.pop(n)
            continue
        if n in inside:
            continue
        if n not in first:
            w = pack_one(n)
            if w is not None:
                yield n, w
            continue
        names = first[n]
        parts = [pack_one(m) for m in names]
        whole = concat_rows(parts)
        if whole is not None:
            del parts
            inside.update(names[1:])
            yield names, whole
            continue
        waiting.update(zip(names[1:], parts[1:]))
        yield n, parts[0]


def in_one_buffer(owners) -> list:
    """The ``(key, QWeight)`` pairs of ``owners`` (consumed) with their planes moved into one allocation, in
    that order: :func:`streamattn.quant.weights.move_planes`."""
    owners = list(owners)
    out = []
    move_planes(owners, lambda key, new: out.append((key, new)))
    return out


def place(weights: dict, fused: dict, owners, rows: dict) -> None:
    """Put the ``(key, QWeight)`` pairs of ``owners`` in ``weights`` (a name) or ``fused`` (a tuple of names,
    whose parts in ``weights`` become row views of it, ``rows[name]`` rows each)."""
    for key, w in owners:
        if isinstance(key, tuple):
            if sum(rows[n] for n in key) != w.shape[0]:
                raise ValueError(f"a fused matrix of {w.shape[0]} rows for parts {key} of "
                                 f"{[rows[n] for n in key]} rows")
            fused[key] = w
            _slice_parts(weights, w, key, rows)
        else:
            weights[key] = w
