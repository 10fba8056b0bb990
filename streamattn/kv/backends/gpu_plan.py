"""Launch plan of the GPU backend: validation, workspace, grids and kernel order, with no CuPy import.

``attend_with`` runs on any array module ``xp`` (CuPy on a device; numpy in the CPU emulation
harness of tests/cuda_emu/) through a ``launch(name, grid, block, args)`` callable, so the emulation
tests exercise this exact orchestration, not a copy of it.
"""
from __future__ import annotations

import math

import numpy as np

from .gpu_source import (BLOCK_THREADS, HEAD_DIMS, MAX_GROUP, MERGE_THREADS, MIXED_PAIRS, choose_splits, spec_name,
                         storage_tag)

LOG2E = 1.4426950408889634


def _host(a):
    """numpy copy of a host array, or None for a device array (its values are not checked)."""
    return None if hasattr(a, "__cuda_array_interface__") else np.asarray(a)


def _address(a) -> int:
    """Address of an array's first element (device or host)."""
    interface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return int(interface["data"][0])


def validate(q, k, v, lengths, counts, *, window: int, sinks: int) -> None:
    """Check shapes, dtypes and (for host arrays) values; raise ValueError/TypeError naming the argument."""
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, q_heads, T, head_dim] (got shape {tuple(q.shape)})")
    if k.ndim != 4 or v.ndim != 4 or tuple(k.shape[:3]) != tuple(v.shape[:3]):
        raise ValueError(f"k and v must both be [batch, kv_heads, slots, head_dim] "
                         f"(got {tuple(k.shape)} and {tuple(v.shape)})")
    if q.dtype.name not in ("float32", "float16"):
        raise TypeError(f"q dtype must be float32 or float16 (got {q.dtype})")
    batch, q_heads, _, head_dim = q.shape
    kv_batch, kv_heads, slots, _ = k.shape
    tags = []
    for name, arr in (("k", k), ("v", v)):
        tags.append(storage_tag(arr.dtype, arr.shape[3], head_dim))
        width = head_dim if tags[-1] in ("q8", "q4") else arr.shape[3]   # a row of blocks: storage_tag checked it
        if kv_batch != batch or width != head_dim:
            raise ValueError(f"q {tuple(q.shape)} and {name} {tuple(arr.shape)} disagree on batch or head_dim")
    if tags[0] != tags[1] and tuple(tags) not in MIXED_PAIRS:
        raise TypeError(f"k and v are stored as {k.dtype} ({tags[0]}) and {v.dtype} ({tags[1]}); the gpu kernels "
                        f"read K and V of one storage dtype, or one of the pairs "
                        f"{', '.join(f'{a}/{b}' for a, b in MIXED_PAIRS)} (K/V)")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} (got {head_dim})")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if not (k.flags.c_contiguous and v.flags.c_contiguous):
        raise ValueError("k and v must be C-contiguous: the kernels index rows as slot * head_dim")
    for name, arr in (("k", k), ("v", v)):
        if _address(arr) % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary for the kernels' vector loads "
                             f"(address {_address(arr):#x}); pass the whole cache array or a row-aligned view")
    if window < 0 or sinks < 0:
        raise ValueError(f"window and sinks must be >= 0 (got window={window}, sinks={sinks})")
    if window == 0 and sinks:
        raise ValueError(f"sinks={sinks} needs a window; window=0 means full causal attention")
    if window and slots <= sinks:
        raise ValueError(f"slots ({slots}) must exceed sinks ({sinks}): the ring needs room")
    for name, arr in (("lengths", lengths), ("counts", counts)):
        if tuple(arr.shape) != (batch,):
            raise ValueError(f"{name} must be [batch] = ({batch},) (got {tuple(arr.shape)})")
    lens, cnts = _host(lengths), _host(counts)
    if lens is None or cnts is None:
        return
    if (cnts < 0).any() or (cnts > q.shape[2]).any() or (cnts > lens).any():
        raise ValueError(f"counts must satisfy 0 <= counts <= min(T={q.shape[2]}, lengths) "
                         f"(got counts={cnts.tolist()}, lengths={lens.tolist()})")
    if window == 0 and (lens > slots).any():
        raise ValueError(f"causal lengths must be <= slots ({slots}) (got {lens.tolist()})")
    need = sinks + window + max(int(cnts.max(initial=1)), 1) - 1
    if window and slots < need:
        raise ValueError(f"a window ring must hold sinks + window + chunk - 1 = {need} slots so a chunk "
                         f"written before it is attended overwrites nothing it needs (got {slots})")


def max_visible_keys(lengths, *, window: int, sinks: int, slots: int) -> int:
    """Upper bound of the keys one decode query sees (exact for host lengths)."""
    lens = _host(lengths)
    longest = int(lens.max(initial=0)) if lens is not None else slots
    return longest if window == 0 else min(longest, sinks + window)


def attend_with(xp, launch, q, k, v, lengths, counts, *, window: int, sinks: int, scale: float,
                sm_count: int, splits: int | None = None, q_sink=None, softcap: float | None = None,
                device_lengths=None, device_counts=None):
    """Attention of q against the cache through ``launch``; see streamattn.kv.backends.gpu.attend.

    Parameters
    ----------
    xp : module
        Array module of the arguments (cupy, or numpy for the emulation harness).
    launch : callable
        ``launch(name, grid, block, args)``: runs specialisation ``name`` (see gpu_source.spec_name).
    q, k, v, lengths, counts, window, sinks, scale
        As in ``streamattn.kv.backends.gpu.attend``.
    sm_count : int
        Multiprocessors of the device; with the keys it sets the number of decode splits.
    splits : int, optional
        Force the number of decode splits (tests use it to exercise the merge on small caches).
    q_sink : array like q, optional
        The queries scored against sink keys (default q), as in ``streamattn.kv.backends.gpu.attend``.
    softcap : float, optional
        Attention logit soft-capping (None: none): launches the ``_softcap`` kernel variants.
    device_lengths, device_counts : int32 [batch] arrays of ``xp``, optional
        lengths and counts already on the device: the kernels read these, nothing is uploaded.

    Returns
    -------
    out : array [batch, q_heads, T, head_dim], q's dtype
    lse : array [batch, q_heads, T], float32
    """
    validate(q, k, v, lengths, counts, window=window, sinks=sinks)
    if softcap is not None and not (isinstance(softcap, (int, float, np.floating)) and not isinstance(softcap, bool)
                                    and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite number > 0, or None for none (got {softcap!r})")
    if q_sink is not None and tuple(q_sink.shape) != tuple(q.shape):
        raise ValueError(f"q_sink must have q's shape {tuple(q.shape)} (got {tuple(q_sink.shape)})")
    batch, q_heads, rows, head_dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    tag, v_tag = storage_tag(k.dtype, k.shape[3], head_dim), storage_tag(v.dtype, v.shape[3], head_dim)
    if k.dtype.name == "bfloat16":  # ml_dtypes on the host: the kernels read raw bits (bf16 is never mixed)
        k, v = k.view(np.uint16), v.view(np.uint16)
    qf = xp.ascontiguousarray(q, dtype=xp.float32)  # [batch, q_heads, T, head_dim]; q is tiny
    qsf = qf if q_sink is None else xp.ascontiguousarray(q_sink, dtype=xp.float32)  # [batch, q_heads, T, hd]
    lens = device_lengths if device_lengths is not None else \
        xp.ascontiguousarray(xp.asarray(lengths), dtype=xp.int32)  # [batch]; host arrays are copied over
    cnts = device_counts if device_counts is not None else \
        xp.ascontiguousarray(xp.asarray(counts), dtype=xp.int32)  # [batch]
    i32, f32 = np.int32, np.float32
    scale_log2 = f32(scale * LOG2E)  # kernels work in log2 units: exp2f is one instruction
    cap = softcap is not None
    softcap_log2 = f32(softcap * LOG2E if cap else 0.0)  # the cap in the same units (unused when None)
    out = xp.empty((batch, q_heads, rows, head_dim), dtype=xp.float32)
    lse = xp.empty((batch, q_heads, rows), dtype=xp.float32)

    if rows == 1:
        chunks = math.ceil(group / MAX_GROUP)
        n_splits = splits or choose_splits(max_visible_keys(lengths, window=window, sinks=sinks, slots=slots),
                                           batch * kv_heads * chunks, sm_count)
        if n_splits < 1:
            raise ValueError(f"splits must be >= 1 (got {n_splits})")
        if n_splits == 1:  # the single partial is the answer: same memory layout as out/lse
            part_out, part_lse = out, lse
        else:
            part_out = xp.empty((batch, q_heads, n_splits, head_dim), dtype=xp.float32)
            part_lse = xp.empty((batch, q_heads, n_splits), dtype=xp.float32)
        launch(spec_name("decode", head_dim, tag, softcap=cap, v_tag=v_tag), (n_splits, kv_heads * chunks, batch),
               (BLOCK_THREADS, 1, 1),
               [qf, qsf, k, v, lens, cnts, part_out, part_lse, i32(q_heads), i32(kv_heads), i32(slots),
                i32(window), i32(sinks), i32(n_splits), scale_log2, softcap_log2])
        if n_splits > 1:
            launch(spec_name("merge", head_dim), (batch * q_heads, 1, 1), (MERGE_THREADS, 1, 1),
                   [part_out, part_lse, out, lse, i32(n_splits)])
    else:
        block_rows = (2 if head_dim == 256 else 4) * (BLOCK_THREADS // 32)  # SaPrefillShape::ROWS
        launch(spec_name("prefill", head_dim, tag, softcap=cap, v_tag=v_tag),
               (math.ceil(rows * group / block_rows), kv_heads, batch), (BLOCK_THREADS, 1, 1),
               [qf, qsf, k, v, lens, cnts, out, lse, i32(q_heads), i32(kv_heads), i32(slots), i32(rows),
                i32(window), i32(sinks), scale_log2, softcap_log2])
    return (out if q.dtype == xp.float32 else out.astype(q.dtype)), lse
