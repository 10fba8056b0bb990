"""Launch plan of the K/V append kernel (kernels/append.cu), with no CuPy import.

``append_with`` runs on any array module ``xp`` through a ``launch(name, grid, block, args)`` callable, as
``gpu_plan.attend_with`` does: CuPy on a device (the GPU cache, streamattn/kv/cache.py), numpy in the CPU
emulation of the tests, so both run this exact plan.
"""
from __future__ import annotations

import numpy as np

from ..spec import row_width
from .gpu_source import HEAD_DIMS, KV_KINDS, MIXED_PAIRS, spec_name

#: The storage dtype names of a CacheSpec -> the kernels' tags.
TAGS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "q8_0": "q8", "q4_0": "q4"}
#: The flag's value while no row was NaN or inf as stored (int32's largest: the kernel lowers it by atomicMin).
FLAG_CLEAR = np.iinfo(np.int32).max


def supports(kind: str, v_kind: str, head_dim: int) -> bool:
    """True when an append kernel exists for K stored as ``kind``, V as ``v_kind`` (CacheSpec dtype names)
    and ``head_dim``: the pairs the attention kernels read, head_dim in gpu_source.HEAD_DIMS."""
    k, v = TAGS.get(kind), TAGS.get(v_kind)
    return head_dim in HEAD_DIMS and k in KV_KINDS and v in KV_KINDS and (k == v or (k, v) in MIXED_PAIRS)


def append_with(xp, launch, k, v, k_store, v_store, undo_k, undo_v, lengths, counts, flag, *, kind: str,
                v_kind: str, sinks: int, ring: int, rotate_k: bool, code_base: int, sink_k=None, sink_v=None,
                v_fed=None):
    """Write row t < counts[b] of k, v to the slot of position lengths[b] + t, as stored.

    Parameters
    ----------
    xp : module
        Array module of the arrays (cupy, or numpy in the emulation).
    launch : callable
        ``launch(name, grid, block, args)`` runs specialisation ``name`` (``append_q8_f16_hd64``).
    k, v : float [batch, kv_heads, T, head_dim] (cast to float32, C-contiguous, where they are not)
    k_store, v_store : [batch, kv_heads, slots, width] C-contiguous storage (float32, float16, uint16
        bfloat16 bits, or uint8 q8_0 / q4_0 rows)
    undo_k, undo_v : [batch, kv_heads, T, width] C-contiguous, of the storage dtypes: receive the written
        slots' old bytes (row t of sequence b, head h: the slot row t went to)
    lengths, counts : int32 [batch] on the device: positions before the step, real rows of the step
    flag : int32 [1] on the device: lowered to ``code_base + b`` where sequence b's K rows hold a NaN or
        inf as stored, else to ``code_base + batch + b`` for its V rows; untouched when all is finite
    kind, v_kind : K's and V's storage dtype names (CacheSpec's)
    sinks, ring : the slot rule (``storage.slot_of``): sinks fixed slots, then a ring of ``ring``; a causal
        cache passes 0 and its capacity
    rotate_k : store ``k @ H`` (streamattn.kv.rotation) instead of k
    code_base : int, see ``flag``
    sink_k, sink_v : float16 or float32 [batch, kv_heads, sinks, head_dim], optional: the sinks kept apart
        (a CacheSpec's ``sink_dtype``). Then a row at position j < sinks goes to row j there (keys rotated),
        position j >= sinks to ring slot (j - sinks) mod ring, every row is checked as quantized too (its
        undo row receives those bytes), and a sink row NaN or inf in the sink dtype lowers the flag to
        ``code_base + 2 batch + b`` (K) or ``code_base + 3 batch + b`` (V): the CPU's order of checks.
    v_fed : float64 [kv_heads, head_dim, head_dim] C-contiguous on the device, optional (q4_0 V only): each
        V row rounded through U[h] (streamattn.kv.storage.quantize_rows_fed), the same bytes

    The bytes written equal the CPU cast's (streamattn.kv.storage.to_storage, rotation.rotate_rows), see
    kernels/append.cu for the one exception on a device (float32 subnormals flushed to zero).
    """
    batch, kv_heads, T, head_dim = k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)} (got {tuple(v.shape)})")
    if not supports(kind, v_kind, head_dim):
        raise ValueError(f"no append kernel for K {kind}, V {v_kind}, head_dim {head_dim}")
    for name, store, dtype in (("k_store", k_store, kind), ("v_store", v_store, v_kind)):
        width = row_width(dtype, head_dim)
        if store.ndim != 4 or tuple(store.shape[:2]) != (batch, kv_heads) or store.shape[3] != width:
            raise ValueError(f"{name} must be [{batch}, {kv_heads}, slots, {width}] for {dtype} rows of head_dim "
                             f"{head_dim} (got {tuple(store.shape)})")
    for name, a, n in (("lengths", lengths, batch), ("counts", counts, batch), ("flag", flag, 1)):
        if a.dtype != np.int32 or tuple(a.shape) != (n,):
            raise ValueError(f"{name} must be int32 [{n}] (got {a.dtype} {tuple(a.shape)})")
    for name, undo, store in (("undo_k", undo_k, k_store), ("undo_v", undo_v, v_store)):
        if tuple(undo.shape) != (batch, kv_heads, T) + tuple(store.shape[3:]) or undo.dtype != store.dtype:
            raise ValueError(f"{name} must be {store.dtype} {(batch, kv_heads, T) + tuple(store.shape[3:])} "
                             f"(got {undo.dtype} {tuple(undo.shape)})")
    sink_kind = -1
    if sink_k is not None:
        sink_kind = {"float32": 0, "float16": 1}.get(sink_k.dtype.name, -2)
        sink_shape = (batch, kv_heads, sinks, head_dim)
        if sink_kind < 0 or sink_v.dtype != sink_k.dtype or tuple(sink_k.shape) != sink_shape \
                or tuple(sink_v.shape) != tuple(sink_k.shape):
            raise ValueError(f"sink_k and sink_v must be float16 or float32 {(batch, kv_heads, sinks, head_dim)} "
                             f"(got {sink_k.dtype} {tuple(sink_k.shape)}, {sink_v.dtype} {tuple(sink_v.shape)})")
    if v_fed is not None and (v_kind != "q4_0" or v_fed.dtype.name != "float64" or not v_fed.flags.c_contiguous
                              or tuple(v_fed.shape) != (kv_heads, head_dim, head_dim)):
        raise ValueError(f"v_fed must be C-contiguous float64 {(kv_heads, head_dim, head_dim)} for a q4_0 V (got "
                         f"{v_fed.dtype} {tuple(v_fed.shape)} for V {v_kind})")
    k = xp.ascontiguousarray(k, dtype=xp.float32)     # [batch, kv_heads, T, head_dim]
    v = xp.ascontiguousarray(v, dtype=xp.float32)
    i32 = np.int32
    launch(spec_name("append", head_dim, TAGS[kind], v_tag=TAGS[v_kind]), (T, kv_heads, batch),
           (head_dim, 1, 1),
           [k, v, k_store, v_store, undo_k, undo_v, lengths, counts, flag,
            k_store if sink_k is None else sink_k, v_store if sink_v is None else sink_v,
            k_store if v_fed is None else v_fed, i32(kv_heads), i32(T),
            i32(k_store.shape[2]), i32(sinks), i32(ring), i32(1 if rotate_k else 0), i32(code_base),
            i32(sink_kind), i32(0 if v_fed is None else 1)])
