"""CacheSpec: what one layer's KV cache holds, validated once.

Modes (absolute 0-based positions; query at position i may see key j when):

    ============  ==========================  ===============================
    mode          visible j                   spec
    ============  ==========================  ===============================
    causal        0 <= j <= i                 window=None
    window n_c    i - n_c < j <= i            window=n_c      (n_c keys, i included)
    sinks + win   j < n_s  or  i - n_c < j <= i   window=n_c, sinks=n_s
    ============  ==========================  ===============================

The window is inclusive of the current token, as in V_[i-n_c+1, i]. In the neighbours' terms:
flash-attn ``window_size=(n_c - 1, 0)``, FlashInfer ``window_left = n_c - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DTYPES = ("float32", "float16", "bfloat16", "q8_0", "q4_0")
QUANTIZED = ("q8_0", "q4_0")   # block-quantized storage: uint8 rows of GGUF blocks (streamattn.kv.storage)
SINK_DTYPES = (None, "float16", "float32")   # a separate sink store's dtype (CacheSpec.sink_dtype; None: no store)
POLICY_FIELDS = ("check_finite",)  # CacheSpec fields that are input policy, not state: never compared

# Storage dtype of each spec dtype. bfloat16 is kept as its raw uint16 bits so that Numba (which has no
# bfloat16) and CuPy (likewise) read the same bytes; widening is a 16-bit shift.
# q8_0 and q4_0 rows are uint8 runs of GGUF blocks (BLOCK_BYTES each, one per 32 values along head_dim).
STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
           "bfloat16": np.dtype(np.uint16), "q8_0": np.dtype(np.uint8), "q4_0": np.dtype(np.uint8)}
QBLOCK = 32                                  # values per block, as GGUF's Q8_0 and Q4_0
BLOCK_BYTES = {"q8_0": 2 + 32, "q4_0": 2 + 16}  # float16 scale, then 32 int8 or 32 packed 4-bit values


def row_width(dtype: str, head_dim: int) -> int:
    """Storage elements of one K or V row: head_dim, or the bytes of ceil(head_dim / 32) blocks for a
    quantized dtype (a head_dim that is no multiple of 32 fills its last block with zeros)."""
    if dtype in QUANTIZED:
        return -(-head_dim // QBLOCK) * BLOCK_BYTES[dtype]
    return head_dim


# Upper bounds of the integer fields: far above any real model, low enough that no product of them
# overflows an int64 shape and that an absurd value (a typo, or a hostile snapshot) is refused before
# anything is allocated. A window ring preallocates window + sinks + max_chunk - 1 slots.
LIMITS = {"batch": 1 << 16, "kv_heads": 1 << 12, "head_dim": 1 << 14, "window": 1 << 24, "sinks": 1 << 20,
          "max_chunk": 1 << 20, "max_len": 1 << 32}


def _positive_int(name: str, value, *, minimum: int, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} (got {value!r}){hint}")
    if value > LIMITS[name]:
        raise ValueError(f"{name} must be at most {LIMITS[name]} (got {value!r}){hint}")


@dataclass(frozen=True)
class CacheSpec:
    """Shape and policy of one layer's KV cache.

    Parameters
    ----------
    batch, kv_heads, head_dim : int
        Storage is ``[batch, kv_heads, slots, head_dim]`` for K and for V.
    dtype : {"float32", "float16", "bfloat16", "q8_0", "q4_0"}
        Storage dtype of K (and of V unless ``dtype_v`` is given); attention arithmetic is float32 whatever
        the storage. ``q8_0`` / ``q4_0`` keep each row as GGUF's Q8_0 / Q4_0 blocks of 32 values along
        head_dim with a float16 scale (byte for byte), quantized once when written.
    dtype_v : str or None
        Storage dtype of V when it differs from K's (same choices); None: ``dtype``.
    sink_dtype : {"auto", "float16", "float32", None}
        Sinks caches whose K or V is quantized: "float16" / "float32" keeps the n_s sink tokens' K and V
        in a store of that dtype beside the quantized ring (rounded once, when written; attention merges
        the two parts exactly, docs/DESIGN.md §6); None stores them like every other token. "auto"
        (default) becomes "float32" for such caches where K or V is float32 (so no side's sinks are kept
        coarser than its ring), "float16" for the others, and None for every other cache (where it means
        nothing); "float16" or "float32" elsewhere is refused.
    rotate_k : bool or None
        Store keys rotated by an orthonormal Walsh–Hadamard transform H along head_dim (after RoPE, before
        quantizing), and score them with the query rotated by the same H (:mod:`streamattn.kv.rotation`): q·k
        is unchanged in exact arithmetic, the 4-bit error of keys with outlier channels falls. None
        (default): on for a quantized K (``q8_0``, ``q4_0``), off for float storage.
    window : int or None
        ``None`` for full causal attention, else n_c >= 1 keys, the current one included.
    sinks : int
        n_s attention-sink tokens (positions 0..n_s-1) kept for ever; only with a window.
    max_chunk : int
        C, the most tokens one ``append`` may carry. A window ring gets C - 1 slots of slack.
    max_len : int or None
        Causal caches only: a hard cap on the tokens per sequence (storage never grows past it).
    check_finite : bool
        Reject appends whose K or V would be stored as NaN or inf (checked on the new chunk only, after the
        cast to the storage dtype: 1e5 overflows float16). With False, non-finite keys make ``attend``
        answer NaN on the rows that see them (never a silent zero).

    Examples
    --------
    >>> CacheSpec(batch=2, kv_heads=3, head_dim=64, window=512, sinks=4).slots
    516
    """

    batch: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    window: int | None = None
    sinks: int = 0
    max_chunk: int = 1
    max_len: int | None = None
    check_finite: bool = True
    dtype_v: str | None = None
    sink_dtype: str | None = "auto"
    rotate_k: bool | None = None

    def __post_init__(self):
        for name in ("batch", "kv_heads", "head_dim", "max_chunk", "window", "sinks", "max_len"):
            value = getattr(self, name)   # numpy integers become ints: the spec is saved as JSON
            if isinstance(value, np.integer) and not isinstance(value, (bool, np.bool_)):
                object.__setattr__(self, name, int(value))
        if isinstance(self.check_finite, np.bool_):
            object.__setattr__(self, "check_finite", bool(self.check_finite))
        if not isinstance(self.check_finite, bool):
            raise ValueError(f"check_finite must be True or False (got {self.check_finite!r})")
        if self.rotate_k is None:                       # resolved here: specs compare and save as bools
            object.__setattr__(self, "rotate_k", self.dtype in QUANTIZED)
        if isinstance(self.rotate_k, np.bool_):
            object.__setattr__(self, "rotate_k", bool(self.rotate_k))
        if not isinstance(self.rotate_k, bool):
            raise ValueError(f"rotate_k must be True, False or None for the default (on for a quantized K) "
                             f"(got {self.rotate_k!r})")
        _positive_int("batch", self.batch, minimum=1)
        _positive_int("kv_heads", self.kv_heads, minimum=1)
        _positive_int("head_dim", self.head_dim, minimum=1)
        _positive_int("max_chunk", self.max_chunk, minimum=1)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES} (got {self.dtype!r})")
        if self.dtype_v is not None and self.dtype_v not in DTYPES:
            raise ValueError(f"dtype_v must be one of {DTYPES} or None for dtype's (got {self.dtype_v!r})")
        if self.dtype_v == self.dtype:
            object.__setattr__(self, "dtype_v", None)   # one spelling per cache: specs compare equal

        if self.window is not None:
            _positive_int("window", self.window, minimum=1,
                          hint="; use window=None for full causal attention")
        _positive_int("sinks", self.sinks, minimum=0)
        if self.sinks and self.window is None:
            raise ValueError(f"sinks={self.sinks} needs a window; with window=None every token is kept "
                             "and sinks mean nothing")
        quantized_sinks = bool(self.sinks) and (self.dtype in QUANTIZED or self.v_dtype in QUANTIZED)
        if self.sink_dtype == "auto":
            wide = "float32" in (self.dtype, self.v_dtype)
            object.__setattr__(self, "sink_dtype", ("float32" if wide else "float16") if quantized_sinks else None)
        elif self.sink_dtype not in SINK_DTYPES:
            raise ValueError(f"sink_dtype must be 'auto', 'float16', 'float32' or None (got {self.sink_dtype!r})")
        elif self.sink_dtype is not None and not quantized_sinks:
            raise ValueError(f"sink_dtype={self.sink_dtype!r} needs sinks and a quantized K or V (got "
                             f"sinks={self.sinks}, dtype={self.dtype!r}, dtype_v={self.dtype_v!r}); "
                             "use 'auto' or None")
        if self.max_len is not None:
            _positive_int("max_len", self.max_len, minimum=1)
            if self.window is not None:
                raise ValueError(f"max_len={self.max_len} applies to causal caches only; a window cache "
                                 "already has fixed memory (window + sinks + max_chunk - 1 slots)")

    @property
    def mode(self) -> str:
        """``"causal"``, ``"window"`` or ``"sinks"``."""
        if self.window is None:
            return "causal"
        return "sinks" if self.sinks else "window"

    @property
    def slots(self) -> int | None:
        """Fixed slot count of a window cache (n_s + n_c + C - 1); None for causal (it grows)."""
        if self.window is None:
            return None
        return self.sinks + self.window + self.max_chunk - 1

    @property
    def storage_dtype(self) -> np.dtype:
        """numpy dtype of K's storage (uint8 for a quantized dtype)."""
        return STORAGE[self.dtype]

    @property
    def v_dtype(self) -> str:
        """V's storage dtype name (``dtype_v`` or ``dtype``)."""
        return self.dtype if self.dtype_v is None else self.dtype_v

    @property
    def storage_dtype_v(self) -> np.dtype:
        """numpy dtype of V's storage."""
        return STORAGE[self.v_dtype]

    @property
    def sink_storage(self) -> np.dtype | None:
        """numpy dtype of the sink store (``sink_dtype``), None where the sinks are not kept apart."""
        return None if self.sink_dtype is None else STORAGE[self.sink_dtype]

    @property
    def k_width(self) -> int:
        """Storage elements per K row (:func:`row_width`)."""
        return row_width(self.dtype, self.head_dim)

    @property
    def v_width(self) -> int:
        """Storage elements per V row (:func:`row_width`)."""
        return row_width(self.v_dtype, self.head_dim)
