"""GGUF weight matrices kept in their block formats: one packed copy per tensor, never widened to float32.

A GGUF block interleaves per-block scales with the quantized values. :func:`pack` splits each tensor once,
at load time, into planes the kernels in :mod:`streamattn.quant.matmul` read with vector loads:

==========  ==========  =================================================================================
GGUF type   kind        values per row (``K`` columns), before interleaving
==========  ==========  =================================================================================
Q4_0, Q4_1  ``"q4"``    the file's nibble bytes, unchanged (byte j of a 32-block holds element j low,
                        element j+16 high); ``scale``, ``minv`` per 32-block: value = scale * q + minv
                        (Q4_0: minv = -8 * scale)
Q4_K        ``"q4k"``   the file's super-block bytes after d and dmin (12 bytes of 6-bit sub-block
                        scales and mins, 128 nibble bytes), unchanged; ``scale`` d, ``minv`` -dmin per
                        super-block (256 columns): value = d * sc * q + (-dmin) * m
Q2_K, Q3_K  ``"q4s"``   nibbles as "q4" at ``group`` 16, each 32-block's 16 bytes followed by its two
                        16-column groups' int8 scales, then mins; ``scale``, ``minv`` per super-block
                        (256 columns): value = scale * sc * q + minv * m. Q2_K: its 2-bit values, d and
                        -dmin; Q3_K: its 3-bit values plus 4, d and -4 d, the min bytes = the scales'
                        (the kernels may also take a "q4" weight at group 16, its planes per 16 columns)
Q8_0        ``"q8"``    the values as bytes ``q + 128``, ``scale`` per 32-block (Q5_0 too, the 5-bit values
                        minus 16, where it shares one matrix with Q8_0 rows: :func:`widen_q5_0`)
Q6_K        ``"q6k"``   the file's super-block bytes but d (128 bytes of low nibbles, 64 of high bit
                        pairs, 16 int8 sub-block scales), in blocks of 128 columns of 104 bytes whose
                        four-byte words come in the order the kernel reads them
                        (:data:`~streamattn.quant.levels.Q6K_WORDS`); ``scale`` d per super-block:
                        value = d * sc * (q - 32); ``group`` 16
Q5_0, Q5_1, ``"q5"``    the 5-bit values' low nibbles in the Q4_1 order, then 4 bytes of their fifth bits
Q5_K                    per 32-block (byte p, bit t: element 4t + p); ``scale``, ``minv`` per 32-block
                        (Q5_0: minv = -16 * scale; Q5_K: d * sc, -dmin * m, as Q4_K)
IQ4_NL,     ``"nl"``    the file's nibble bytes (the Q4_1 order), each an index into the 16 levels
IQ4_XS                  :data:`IQ4_VALUES`; ``scale`` per 32-block (IQ4_XS: d * (its 6-bit scale - 32))
F32, F16,   ``"f32"``,  ``qs`` the values as stored (float32, or the 16-bit patterns as uint16), row-major
BF16        ``"f16"``,
            ``"bf16"``
==========  ==========  =================================================================================

**Interleaved groups of rows.** The "q4"/"q8" planes hold rows in groups of ``lanes`` (16 on AVX-512,
8 on AVX2: :data:`streamattn.quant.kernels.LANES`; the last group padded with zero rows),
one plane row per group. Within a group, block b's bytes come as ``steps`` vectors of ``4 * lanes``
bytes, lane n of vector s holding four consecutive bytes of row n: for "q8", its values 4s .. 4s + 3
of the block (``steps`` = group / 4); for "q4"/"nl"/"q5", its nibble bytes 4s .. 4s + 3 of a 32-column
block (``steps`` = 4, whatever the group; "q5"/"q4s": a fifth vector, the bit or scale bytes), whose low nibbles are
the block's elements 4s .. 4s + 3 and high nibbles 16 + 4s ..: so a vector is one
load and each lane is one weight row of the kernels' byte dot products; for "q6k" (26 vectors per 128
columns) and "q4k" (35 per 256), four bytes of the file's block as the table says. ``scale`` and
``minv`` are ``[groups, blocks * lanes]`` ("q4s", "q6k", "q4k": one value per 256 columns), block b's
``lanes`` values in a row. The q8 bytes are ``q + 128``
because ``vpdpbusd`` multiplies unsigned by signed bytes (the kernels take 128 times the activations'
sum back out, exactly); the "nl" kernel looks its nibbles up as the same biased bytes.

Scale and min planes are stored as float16 bits (uint16) wherever float16 holds every value exactly
(the file's own float16 scales: Q4_0, Q4_1, Q8_0, Q5_0, and the K-quants' super-block d, dmin),
else as float32; the kernels widen float16 exactly, so the results are the same either way, and a
decode step reads 13% fewer bytes (SmolLM2: 111 -> 96 MB).

Every repacking is exact: :meth:`QWeight.dequantize` equals ``gguf.quants.dequantize`` of the file's
bytes. Bytes per weight: Q4_0/Q4_1 0.625 (0.5 + two float16 per 32), Q4_K 0.5625 and Q6_K 0.8203 (the
file's, whatever the values; :func:`widen_k` gives the layouts they had before, 0.625-0.75 and
1.125-1.25), Q8_0 1.0625, Q5_0, Q5_1 0.75 and Q5_K 0.75 or 0.875 (nibbles and a bit plane; Q5_0 beside
Q8_0 rows 1.0625),
Q2_K and Q3_K 0.64 (int8 sub-block scales and mins), IQ4_NL 0.5625, IQ4_XS 0.5625 or 0.625
(docs/DESIGN.md, "More GGUF types").
Any other GGUF type raises :class:`UnsupportedWeightType`, naming the tensor and its type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from streamattn.runtime.memory import trim_heap
from streamattn.quant.levels import IQ4_VALUES, Q6K_WORDS

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0", "Q6_K", "Q5_1", "Q5_K", "Q3_K",
                   "Q2_K", "IQ4_NL", "IQ4_XS")
#: The kinds the integer kernels run (:mod:`streamattn.quant.kernels`), then the float storages.
INT_KINDS = ("q4", "q8", "q5", "nl", "q4s", "q6k", "q4k")
KINDS = (*INT_KINDS, "f32", "f16", "bf16")
#: The nibble kinds: 16 bytes per 32 columns (the Q4_1 order), "nl" indexing :data:`IQ4_VALUES`, "q5"
#: followed by 4 bytes of fifth bits, "q4s" by 4 bytes of sub-block scales and mins.
NIBBLE_KINDS = ("q4", "nl", "q5", "q4s")
#: Bytes of one row of a "q6k" block (128 columns, half a Q6_K super-block): the file's 64 bytes of low
#: nibbles, 32 of high bit pairs and 8 int8 sub-block scales of that half.
Q6K_BYTES = 104
#: Bytes of one row of a "q4k" block (256 columns, a Q4_K super-block): the file's 12 bytes of 6-bit
#: sub-block scales and mins, then its 128 nibble bytes.
Q4K_BYTES = 140


#: The types :func:`pack` repacks with compiled kernels (:mod:`streamattn.quant.repack`); the others
#: through numpy (``_PACKERS``, then :func:`interleave`), which gives the same planes for these too.
REPACKED = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")


class UnsupportedWeightType(ValueError):
    """A GGUF tensor's type has no packed kernel here."""


@dataclass
class QWeight:
    """A weight matrix ``[rows, cols]`` in packed block planes (multiply as ``x @ W.T``).

    Attributes
    ----------
    kind : {"q4", "q8", "q5", "nl", "q4s", "q6k", "q4k", "f32", "f16", "bf16"}
    shape : (rows, cols)
    qs : array
        "q4"/"nl": uint8 [groups, cols/2 * lanes]; "q5"/"q4s": [groups, cols/32 * 20 * lanes]; "q8": uint8
        [groups, cols * lanes] (values + 128); "q6k": [groups, cols/128 * 104 * lanes]; "q4k":
        [groups, cols/256 * 140 * lanes], all interleaved (see the module docstring); "f32": float32,
        "f16"/"bf16": uint16 [rows, cols].
    scale : [groups, cols/group * lanes] ("q4s", "q6k", "q4k": cols/256) or None
        float32, or float16 bits as uint16 where float16 is exact (see the module docstring);
        :meth:`floats` gives float32 either way.
    minv : as ``scale``, or None   ("q4", "q5", "q4s", "q4k")
    group : int
        Columns per sub-block scale (32, or 16 for Q6_K, Q2_K, Q3_K).
    source : str
        The GGUF type the planes came from.
    lanes : int
        Rows per interleaved group (the integer kinds; 0 for the row-major float kinds).
    """

    kind: str
    shape: tuple
    qs: np.ndarray = field(repr=False)
    scale: np.ndarray | None = field(default=None, repr=False)
    minv: np.ndarray | None = field(default=None, repr=False)
    group: int = 32
    source: str = ""
    lanes: int = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.qs, self.scale, self.minv) if a is not None)

    @property
    def ndim(self) -> int:
        return 2

    def finite(self) -> bool:
        """Whether every value is finite (scales and mins; float kinds: the values)."""
        if self.kind in INT_KINDS:        # float16 bits: finite unless the exponent field is all ones
            return all(bool(((p & 0x7C00) != 0x7C00).all()) if p.dtype == np.uint16 else bool(np.isfinite(p).all())
                       for p in (self.scale, self.minv) if p is not None)
        return bool(np.isfinite(self.dequantize()).all())

    def rows(self, ids) -> np.ndarray:
        """Dequantized rows ``ids`` (an int array of any shape; negative ids count from the end, as numpy's)
        as float32 [*ids.shape, cols]."""
        ids = np.asarray(ids)
        flat, n = ids.reshape(-1), self.shape[0]
        if flat.size and (flat.min() < -n or flat.max() >= n):
            raise IndexError(f"row ids must be in -{n}..{n - 1} for a weight of {n} rows "
                             f"(got {flat.min()}..{flat.max()})")
        return _dequant(self, *self._planes(flat % n)).reshape(*ids.shape, self.shape[1])

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32 [rows, cols] (the reference path and the GPU's copy)."""
        return _dequant(self, *self.row_major())

    def row_major(self):
        """The planes row-major, as :meth:`_planes` gives them for every row."""
        return self._planes(np.arange(self.shape[0]))

    def _planes(self, ids):
        """Rows ``ids`` (1-D) of the planes, row-major: values [n, cols] (q4/nl: the file's nibble bytes
        [n, cols/2]; q5/q4s: 20 bytes per 32 columns; q8: signed), scale and minv as float32 [n, blocks]
        (or None)."""
        if not self.lanes:
            return self.qs[ids], None, None
        g, n = ids // self.lanes, ids % self.lanes
        steps = _steps(self.kind, self.group)
        qs = self.qs.reshape(self.qs.shape[0], -1, steps, self.lanes, 4)[g, :, :, n, :].reshape(len(ids), -1)
        if self.kind == "q8":
            qs = (qs ^ 0x80).view(np.int8)                # stored q + 128 (the module docstring)

        def plane(p):
            return None if p is None else floats(p.reshape(p.shape[0], -1, self.lanes)[g, :, n])
        return qs, plane(self.scale), plane(self.minv)


def floats(plane: np.ndarray) -> np.ndarray:
    """A scale or min plane as float32 (widening float16 bits stored as uint16)."""
    return plane.view(np.float16).astype(np.float32) if plane.dtype == np.uint16 else plane


def compact(plane: np.ndarray) -> np.ndarray:
    """A float32 scale or min plane as float16 bits (uint16) when float16 holds each value exactly, else
    unchanged: the kernels widen float16 back to the same float32."""
    with np.errstate(over="ignore"):                      # out of float16's range: kept float32 below
        h = plane.astype(np.float16)
    return h.view(np.uint16) if np.array_equal(h.astype(np.float32), plane) else plane


def _dequant(w: QWeight, qs, scale, minv) -> np.ndarray:
    n = qs.shape[0]
    if w.kind == "q6k":                                   # gguf's products: (d * sc) * (q - 32)
        q, sc = _six_bit(qs)
        v = (scale[:, :, None] * sc)[..., None] * (q.astype(np.float32) - 32).reshape(n, -1, 16, 16)
        return v.reshape(n, -1)
    if w.kind == "q4k":                                   # (d * sc) * q + (-dmin) * m, as gguf's d sc q - dmin m
        q, sc, mn = _q4k_unpack(qs)
        v = (scale[:, :, None] * sc)[..., None] * q + (minv[:, :, None] * mn)[..., None]
        return v.reshape(n, -1)
    if w.kind == "f32":
        return np.array(qs, np.float32)
    if w.kind == "f16":
        return qs.view(np.float16).astype(np.float32)
    if w.kind == "bf16":
        return (qs.astype(np.uint32) << 16).view(np.float32)
    if w.kind == "q8":
        q = qs.reshape(n, -1, w.group).astype(np.float32)
    elif w.kind == "q4s":
        b = qs.reshape(n, -1, 20)
        ints = b[..., 16:].view(np.int8).astype(np.float32)                        # [n, K/32, 4]
        sup = lambda p: np.repeat(p, 16, axis=1)[..., None]                        # noqa: E731  per 256 -> per 16
        scale = (sup(scale) * ints[..., 0:2].reshape(n, -1, 1)).reshape(n, -1)    # the kernel's products
        minv = (sup(minv) * ints[..., 2:4].reshape(n, -1, 1)).reshape(n, -1)
        q = np.concatenate([b[..., :16] & 15, b[..., :16] >> 4], -1).astype(np.float32).reshape(n, -1, 16)
    elif w.kind == "q5":
        b = qs.reshape(n, -1, 20)                                                  # 16 nibble bytes, 4 of bits
        hi = (b[..., 16:, None] >> np.arange(8, dtype=np.uint8)) & 1               # [n, K/32, p, t]: element 4t + p
        q = (np.concatenate([b[..., :16] & 15, b[..., :16] >> 4], -1)
             | (hi.transpose(0, 1, 3, 2).reshape(n, -1, 32) << 4)).astype(np.float32)
    else:
        b = qs.reshape(n, -1, 16)
        q = np.concatenate([b & 15, b >> 4], axis=-1)                              # [n, K/32, 32]
        q = (np.array(IQ4_VALUES, np.float32)[q] if w.kind == "nl" else q.astype(np.float32)).reshape(n, -1, w.group)
    v = q * scale[:, :, None]
    return (v if minv is None else v + minv[:, :, None]).reshape(n, -1)


def _steps(kind: str, group: int) -> int:
    """Four-byte vectors per block of one row: nibble kinds 16 bytes (32 columns, whatever the group;
    "q5" 4 more, its fifth bits), "q6k" 104 (128 columns), "q4k" 140 (256), "q8" ``group`` value bytes."""
    if kind in ("q6k", "q4k"):
        return (Q6K_BYTES if kind == "q6k" else Q4K_BYTES) // 4
    return 5 if kind in ("q5", "q4s") else 4 if kind in NIBBLE_KINDS else group // 4


def block_cols(kind: str, group: int) -> int:
    """Columns per block of the interleaved layout: 32 for the nibble kinds (one or two scale groups),
    128 for "q6k" (half a Q6_K super-block), 256 for "q4k", else the scale group."""
    return {"q6k": 128, "q4k": 256}.get(kind, 32 if kind in NIBBLE_KINDS else group)


def layout_error(w: QWeight) -> str | None:
    """What is wrong with ``w``'s planes for its kind, shape, group and lanes (the layout of the module
    docstring), or None: their dtypes, their shapes, which of scale and minv are there. A weight that passes
    is one the kernels read inside its planes (for planes from a file: :mod:`streamattn.quant.packed_file`)."""
    n, k = w.shape
    if w.kind in ("f32", "f16", "bf16"):
        want = np.float32 if w.kind == "f32" else np.uint16
        ok = w.lanes == 0 and w.qs.dtype == want and w.qs.shape == (n, k) and w.scale is None and w.minv is None
        return None if ok else f"a {w.kind} weight {w.shape} with planes {_described(w)}"
    if w.kind not in INT_KINDS or w.lanes not in (8, 16) or w.group not in (16, 32) or k % block_cols(w.kind, w.group):
        return f"kind {w.kind!r}, group {w.group}, lanes {w.lanes}, shape {w.shape}"
    groups = -(-n // w.lanes)
    per_scale = 256 if w.kind in ("q4s", "q6k", "q4k") else w.group
    want_qs = (groups, k // block_cols(w.kind, w.group) * _steps(w.kind, w.group) * 4 * w.lanes)
    want_scale = (groups, k // per_scale * w.lanes)
    has_min = w.kind in ("q4", "q5", "q4s", "q4k")
    ok = (w.qs.dtype == np.uint8 and w.qs.shape == want_qs and (w.minv is not None) == has_min
          and all(p.dtype in (np.uint16, np.float32) and p.shape == want_scale for p in (w.scale, w.minv)
                  if p is not None) and w.scale is not None)
    return None if ok else (f"a {w.kind} weight {w.shape} (group {w.group}, lanes {w.lanes}) needs qs uint8 "
                            f"{want_qs} and scale{' and minv' if has_min else ''} {want_scale}; it has "
                            f"{_described(w)}")


def _described(w: QWeight) -> str:
    return ", ".join(f"{name} {'none' if p is None else f'{p.dtype} {p.shape}'}"
                     for name, p in (("qs", w.qs), ("scale", w.scale), ("minv", w.minv)))


def interleave(w: QWeight, lanes: int) -> QWeight:
    """A row-major integer-kind QWeight (qs: q4/nl the nibble bytes [N, K/2], q5/q4s [N, K/32 * 20], q8 signed
    int8 [N, K], either
    also as [N, blocks, bytes] with any strides, e.g. a view of the file's blocks; float32 scale/minv
    [N, blocks]) in groups of ``lanes`` rows, the layout of the module docstring. One new copy of the
    values (the file's Q8_0 bytes are read in place: Gemma-3's 167 MB embedding was copied three times)."""
    if lanes not in (8, 16):
        raise ValueError(f"lanes must be 8 or 16, the kernels' vector widths (got {lanes!r})")
    n, k = w.shape
    groups, full = -(-n // lanes), n // lanes
    nb, steps = k // block_cols(w.kind, w.group), _steps(w.kind, w.group)
    src = w.qs.view(np.uint8).reshape(n, nb, steps, 4)
    qs = np.empty((groups, nb, steps, lanes, 4), np.uint8)
    qs[:full] = src[:full * lanes].reshape(full, lanes, nb, steps, 4).transpose(0, 2, 3, 1, 4)
    if n % lanes:                                      # the last group's rows, then zero rows
        qs[full] = 0
        qs[full, :, :, :n % lanes] = src[full * lanes:].transpose(1, 2, 0, 3)
    if w.kind == "q8":
        qs ^= 0x80                                     # int8 q -> q + 128 (two's complement), in place

    def plane(p):
        if p is None:
            return None
        p = np.pad(p, ((0, groups * lanes - n), (0, 0)))
        return compact(np.ascontiguousarray(p.reshape(groups, lanes, -1).transpose(0, 2, 1)).reshape(groups, -1))
    return QWeight(w.kind, w.shape, qs.reshape(groups, -1), plane(w.scale), plane(w.minv), w.group, w.source, lanes)


def row_slice(w, a: int, b: int):
    """Rows a..b-1 of a QWeight or float matrix as views (no copy). An interleaved QWeight is cut at
    whole groups: a a multiple of its lanes, b too or its last row."""
    if not isinstance(w, QWeight):
        return w[a:b]
    if not w.lanes:
        return QWeight(w.kind, (b - a, w.shape[1]), w.qs[a:b], source=w.source)
    if a % w.lanes or (b % w.lanes and b != w.shape[0]):
        raise ValueError(f"rows {a}..{b} of a weight interleaved by {w.lanes} rows do not start and end "
                         f"on whole groups of {w.lanes}")
    g0, g1 = a // w.lanes, -(-b // w.lanes)
    cut = (lambda arr: None if arr is None else arr[g0:g1])
    return QWeight(w.kind, (b - a, w.shape[1]), w.qs[g0:g1], cut(w.scale), cut(w.minv), w.group, w.source,
                   w.lanes)


def concat_rows(ws: list) -> QWeight | None:
    """One QWeight holding the rows of ``ws`` one after another, or None where their kinds, groups or
    lanes differ, or a part other than the last ends inside an interleaved group. Q5_0 parts beside "q8"
    ones are widened to "q8" first (:func:`widen_q5_0`)."""
    if len({w.kind for w in ws}) > 1 and any(w.kind == "q8" for w in ws):   # Q5_0 beside Q8_0: as bytes
        ws = [widen_q5_0(w) if w.kind == "q5" and w.source == "Q5_0" and w.lanes else w for w in ws]
    first = ws[0]
    if any(w.kind != first.kind or w.group != first.group or w.lanes != first.lanes
           or w.shape[1] != first.shape[1] for w in ws):
        return None
    if first.lanes and any(w.shape[0] % first.lanes for w in ws[:-1]):
        return None

    def cat(name):
        planes = [getattr(w, name) for w in ws]
        if planes[0] is None:
            return None
        if len({p.dtype for p in planes}) > 1:              # float16 bits beside float32: widen, recompact
            return compact(np.concatenate([floats(p) for p in planes], 0))
        return np.ascontiguousarray(np.concatenate(planes, 0))
    return QWeight(first.kind, (sum(w.shape[0] for w in ws), first.shape[1]), cat("qs"), cat("scale"),
                   cat("minv"), first.group, "+".join(sorted({w.source for w in ws})), first.lanes)


def move_planes(ws: list, moved) -> None:
    """Move the planes of the QWeights in ``ws`` ((name, weight) pairs, consumed) into one allocation, in
    that order, each plane 64-byte aligned; ``moved(name, new)`` is called after each, so the caller can
    drop its references to the old copy before the next is made (the peak stays about one weight above
    the total).

    Why (docs/PERF.md): hundreds of small arrays each start on a fresh 4 KiB page and a cold prefetcher
    stream; one big array gets transparent huge pages (numpy advises them from 4 MiB up); measured:
    docs/perf/2026-12-01.md."""
    size = sum(-(-p.nbytes // 64) * 64 for _, w in ws for p in (w.qs, w.scale, w.minv) if p is not None)
    buf = np.empty(size + 64, np.uint8)
    at = -buf.ctypes.data % 64
    while ws:
        name, w = ws.pop(0)
        planes = []
        for p in (w.qs, w.scale, w.minv):
            if p is not None:
                p, src = buf[at:at + p.nbytes].view(p.dtype).reshape(p.shape), p
                p[...] = src
                at += -(-p.nbytes // 64) * 64
            planes.append(p)
        new = QWeight(w.kind, w.shape, *planes, w.group, w.source, w.lanes)
        del w, p, src
        moved(name, new)
        trim_heap()


def _f16(b) -> np.ndarray:
    """float32 of little-endian float16 byte pairs b: [..., 2] uint8."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def check_type(name: str, type_name: str) -> None:
    """Raise :class:`UnsupportedWeightType` naming tensor ``name`` and the supported types unless
    ``type_name`` is one of :data:`SUPPORTED_TYPES` (what :func:`pack` takes)."""
    if type_name not in SUPPORTED_TYPES:
        raise UnsupportedWeightType(f"tensor {name!r} has GGUF type {type_name}, which has no packed kernel "
                                    f"(supported: {', '.join(SUPPORTED_TYPES)}); load with weights='f32' "
                                    "to dequantize every tensor to float32 instead")


def pack(name: str, type_name: str, data: np.ndarray, shape: tuple, lanes: int | None = None) -> QWeight:
    """Split one GGUF tensor's blocks into a :class:`QWeight`.

    Parameters
    ----------
    name : str
        Tensor name (for errors).
    type_name : str
        GGUF type name, e.g. "Q4_1" (``tensor.tensor_type.name``).
    data : array
        The tensor's data as ``gguf.GGUFReader`` gives it: uint8 block bytes [rows, bytes_per_row] for
        quantized types, the values [rows, cols] for F32/F16 (BF16: bytes or uint16). The float kinds'
        ``qs`` is a view of ``data`` where it is C-contiguous (a copy otherwise): the loader moves it into
        its buffer, or records it by its offset in the file (:mod:`streamattn.quant.packed_file`).
    shape : (rows, cols)
    lanes : int, optional
        Rows per interleaved group (default: the kernels' :data:`~streamattn.quant.kernels.LANES`).

    Raises
    ------
    UnsupportedWeightType
        A type outside :data:`SUPPORTED_TYPES`, or columns not a multiple of the block size.
    """
    n, k = shape
    check_type(name, type_name)
    block = 256 if type_name.endswith("_K") or type_name == "IQ4_XS" else 32 if "Q" in type_name else 16
    if k % block:
        raise UnsupportedWeightType(f"tensor {name!r} ({type_name}) has {k} columns, not a multiple of "
                                    f"{block} as the packed kernels need")
    if type_name == "F32":      # the file's values as they are: a view of ``data`` where it is contiguous
        return QWeight("f32", shape, np.ascontiguousarray(data, np.float32).reshape(n, k), source=type_name)
    if type_name in ("F16", "BF16"):
        return QWeight(type_name.lower(), shape, np.ascontiguousarray(data).view(np.uint16).reshape(n, k),
                       source=type_name)
    u8 = np.ascontiguousarray(data).view(np.uint8).reshape(n, -1)
    from streamattn.quant.kernels import LANES      # the kernels' vector width (imports LLVM's)
    lanes = LANES if lanes is None else lanes
    if type_name in REPACKED and lanes in (8, 16):  # compiled, parallel, the same planes (quant/repack.py)
        from streamattn.quant import repack
        qs, scale, minv = repack.repack(type_name, u8.reshape(n, k // block, -1), shape, lanes)
        kind, group = repack.TYPES[type_name][0], repack.TYPES[type_name][2]
        return QWeight(kind, shape, qs, repack.compact(scale), None if minv is None else repack.compact(minv), group,
                       type_name, lanes)
    return interleave(_PACKERS[type_name](u8.reshape(n, k // block, -1), shape), lanes)


def _q4_0(b, shape):
    d = _f16(b[..., 0:2])
    return QWeight("q4", shape, b[..., 2:18], d, -8.0 * d, source="Q4_0")


def _q4_1(b, shape):
    return QWeight("q4", shape, b[..., 4:20], _f16(b[..., 0:2]), _f16(b[..., 2:4]), source="Q4_1")


def _q8_0(b, shape):
    return QWeight("q8", shape, b[..., 2:34].view(np.int8), _f16(b[..., 0:2]), source="Q8_0")   # a view: see interleave


def _q5_0(b, shape):
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")                             # [n, nb, 1]
    qs = b[..., 6:22]                                                              # [n, nb, 16]
    j = np.arange(16, dtype=np.uint32)
    lo = (qs & 15) | (((qh >> j) & 1) << 4).astype(np.uint8)
    hi = (qs >> 4) | (((qh >> (j + 16)) & 1) << 4).astype(np.uint8)
    d = _f16(b[..., 0:2])
    return QWeight("q5", shape, _five_bit(np.concatenate([lo, hi], -1)), d, -16.0 * d, source="Q5_0")


def widen_q5_0(w: QWeight) -> QWeight:
    """A Q5_0 weight (kind "q5", min -16 d) as kind "q8" (the values minus 16 as bytes, no min), interleaved
    as ``w``: the same values, so a row group whose other parts are Q8_0 (Gemma-3's q and k beside its
    v) packs into one matrix."""
    if w.kind != "q5" or w.source != "Q5_0":
        raise ValueError(f"widen_q5_0 takes a Q5_0 weight packed as 'q5' (got kind {w.kind!r} from {w.source!r})")
    qs, scale, _ = w.row_major()
    n, k = w.shape
    b = qs.reshape(n, k // 32, 20)
    e = np.arange(32)
    nib = np.concatenate([b[..., :16] & 15, b[..., :16] >> 4], -1)                 # [n, nb, 32] low 4 bits
    fifth = (b[..., 16:20][..., e % 4] >> (e // 4)) & 1                            # byte p, bit t: 4t + p
    q = ((nib | (fifth << 4)).astype(np.int16) - 16).astype(np.int8)
    return interleave(QWeight("q8", w.shape, q.reshape(n, k), scale, None, 32, "Q5_0"), w.lanes)


def _k_scales_mins(s):
    """The eight 6-bit sub-block scales and mins of a Q4_K/Q5_K super-block: s uint8 [..., 12] ->
    two uint8 [..., 8] (ggml's get_scale_min_k4)."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def _q4_k(b, shape):
    return QWeight("q4k", shape, b[..., 4:144].reshape(shape[0], -1), _f16(b[..., 0:2]), -_f16(b[..., 2:4]),
                   source="Q4_K")


def _q4k_unpack(qs):
    """A "q4k" weight's row-major bytes [n, K/256 * 140] -> float32 (values 0..15 [n, K/256, 8, 32] per
    sub-block, the 6-bit scales and mins [n, K/256, 8] each): gguf's Q4_K unpacking."""
    n = qs.shape[0]
    b = qs.reshape(n, -1, Q4K_BYTES)
    sc, mn = _k_scales_mins(b[..., 0:12])
    q = (b[..., 12:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]) & 15   # [n, ns, 4, 2, 32]
    return q.reshape(n, -1, 8, 32).astype(np.float32), sc.astype(np.float32), mn.astype(np.float32)


def _q6_k(b, shape):
    n = shape[0]
    at = _q6k_sources()                                                            # [2, 104]
    return QWeight("q6k", shape, b[..., at].reshape(n, -1), _f16(b[..., 208:210]), group=16, source="Q6_K")


def _q6k_sources() -> np.ndarray:
    """int [2, 104]: the file's super-block byte behind each byte of a "q6k" row's two blocks."""
    word = np.array(Q6K_WORDS)
    step = np.where(word < 128, 64, np.where(word < 192, 32, 8))                   # the second half's shift
    return ((word + step * np.arange(2)[:, None])[..., None] + np.arange(4)).reshape(2, -1)


def _q6k_file_order(qs):
    """A "q6k" weight's row-major bytes [n, K/128 * 104] as the file's ql, qh and scale bytes [n, K/256, 208]."""
    n = qs.shape[0]
    out = np.empty((n, qs.shape[1] // 208, 208), np.uint8)
    out[..., _q6k_sources()] = qs.reshape(n, -1, 2, 104)
    return out


def _six_bit(qs):
    """A "q6k" weight's row-major bytes [n, K/128 * 104] -> (the 6-bit values 0..63 [n, K/256, 256] in
    column order, the int8 sub-block scales as float32 [n, K/256, 16]): gguf's Q6_K unpacking."""
    n = qs.shape[0]
    f = _q6k_file_order(qs)                                                        # [n, ns, 208]
    ql, qh = f[..., 0:128].reshape(n, -1, 2, 64), f[..., 128:192].reshape(n, -1, 2, 32)
    q = np.concatenate([(ql[..., :32] & 15) | ((qh & 3) << 4), (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
                        (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | ((qh >> 6) << 4)], -1)
    return q.reshape(n, -1, 256), f[..., 192:208].view(np.int8).astype(np.float32)


def widen_k(w: QWeight) -> QWeight:
    """A "q6k" or "q4k" weight in the layout its type had before (1.125-1.25 and 0.625-0.75 bytes per
    weight): "q6k" as kind "q8" at group 16 (the values as bytes, d times each int8 sub-block scale in a
    float plane per 16 columns), "q4k" as kind "q4" (nibbles in the Q4_1 order, d * sc and -(dmin * m)
    in float planes per 32 columns), interleaved as ``w``. The same values, and the kernels give it the
    same bits (the same float32 products, the same exact integer sums): for tests and benchmarks that
    compare the two."""
    if w.kind not in ("q6k", "q4k"):
        raise ValueError(f"widen_k takes a weight packed as 'q6k' or 'q4k' (got kind {w.kind!r} from {w.source!r})")
    qs, d, dmin = w.row_major()
    n, k = w.shape
    if w.kind == "q4k":
        q, sc, mn = _q4k_unpack(qs)
        return interleave(QWeight("q4", w.shape, _nibbles(q.reshape(n, -1, 32)), (d[:, :, None] * sc).reshape(n, -1),
                                  (dmin[:, :, None] * mn).reshape(n, -1), 32, w.source), w.lanes)
    q, sc = _six_bit(qs)
    values = (q.astype(np.int16) - 32).astype(np.int8).reshape(n, k)
    return interleave(QWeight("q8", w.shape, values, (d[:, :, None] * sc).reshape(n, -1), None, 16, w.source),
                      w.lanes)


def _nibbles(q):
    """Values 0..15 [n, blocks, 32] as the Q4_1 order's bytes [n, blocks * 16]: element j low, j + 16 high."""
    q = q.astype(np.uint8)
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1)


def _five_bit(q):
    """Values 0..31 [n, blocks, 32] as "q5" row bytes [n, blocks * 20]: the low nibbles in the Q4_1 order,
    then 4 bytes whose byte p, bit t is the fifth bit of element 4t + p (so the kernel's step t, which
    holds elements 4t .. 4t + 3 in its four bytes, takes bit t of each: one shift and one mask)."""
    n, nb = q.shape[:2]
    hi = (q >> 4).reshape(n, nb, 8, 4).astype(np.uint8)                           # [n, nb, t, p]
    bits = (hi << np.arange(8, dtype=np.uint8)[:, None]).sum(2, dtype=np.uint8)   # [n, nb, 4]
    return np.concatenate([_nibbles(q & 15).reshape(n, nb, 16), bits], -1).reshape(n, -1)


def _q5_1(b, shape):
    qh = np.ascontiguousarray(b[..., 4:8]).view("<u4")                             # [n, nb, 1]
    j = np.arange(32, dtype=np.uint32)
    lo = np.concatenate([b[..., 8:24] & 15, b[..., 8:24] >> 4], -1)                # [n, nb, 32]
    q = lo | (((qh >> j) & 1) << 4).astype(np.uint8)                               # 0..31
    return QWeight("q5", shape, _five_bit(q), _f16(b[..., 0:2]), _f16(b[..., 2:4]), source="Q5_1")


def _q5_k(b, shape):
    n = shape[0]
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]          # [n, ns, 1]
    sc, mn = _k_scales_mins(b[..., 4:16].astype(np.uint8))                         # [n, ns, 8]
    qh = b[..., 16:48][..., None, :]                                               # [n, ns, 1, 32]
    ql = b[..., 48:176].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]   # [n, ns, 4, 2, 32]
    hi = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1                        # [n, ns, 8, 32]: bit j: sub-block j
    q = (ql.reshape(n, -1, 8, 32) & 15) | (hi << 4)                                # [n, ns, 8, 32], 0..31
    return QWeight("q5", shape, _five_bit(q.reshape(n, -1, 32)), (d * sc).reshape(n, -1).astype(np.float32),
                   (-(dmin * mn)).reshape(n, -1).astype(np.float32), source="Q5_K")


def _two_bit(qs):
    """Q2_K/Q3_K's 2-bit fields: qs uint8 [n, ns, 64] -> [n, ns, 256], element 128 h + 32 s + l from
    bits 2s..2s+1 of byte 32 h + l."""
    n = qs.shape[0]
    return ((qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(n, -1, 256)


def _with_sub_scales(q, sc, mn):
    """"q4s" row bytes [n, K/32 * 20]: values 0..15 [n, K/32, 32] as nibbles (the Q4_1 order), each block
    followed by its two 16-column groups' int8 scales, then mins (sc, mn: [n, K/16])."""
    n = q.shape[0]
    ints = np.concatenate([sc.reshape(n, -1, 2), mn.reshape(n, -1, 2)], -1).astype(np.int8).view(np.uint8)
    return np.concatenate([_nibbles(q).reshape(n, -1, 16), ints], -1).reshape(n, -1)


def _q2_k(b, shape):
    n = shape[0]
    s = b[..., 0:16]                                                               # [n, ns, 16]: 4-bit scale, min
    q = _two_bit(b[..., 16:80]).reshape(n, -1, 32)                                 # [n, K/32, 32]
    d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])                             # [n, ns]
    return QWeight("q4s", shape, _with_sub_scales(q, s & 15, s >> 4), d, -dmin, group=16, source="Q2_K")


def _q3_k(b, shape):
    n = shape[0]
    s = b[..., 96:108]                                                             # 16 6-bit scales, packed
    lo = np.concatenate([s[..., 0:8] & 15, s[..., 0:8] >> 4], -1)                  # [n, ns, 16]
    hi = ((s[..., 8:12][..., None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(n, -1, 16)
    sc = (lo | (hi << 4)).astype(np.int16) - 32                                    # -32..31
    hm = (b[..., 0:32][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n, ns, 8, 32]
    q = _two_bit(b[..., 32:96]) + 4 * hm.reshape(n, -1, 256)                       # 0..7 = the value + 4
    d = _f16(b[..., 108:110])                                                      # [n, ns]
    # value = d sc (q + 4) - 4 d sc: the min's super-block factor is -4 d (exact), its bytes sc
    return QWeight("q4s", shape, _with_sub_scales(q.reshape(n, -1, 32), sc, sc), d, -4 * d, group=16,
                   source="Q3_K")


def _iq4_nl(b, shape):
    return QWeight("nl", shape, b[..., 2:18], _f16(b[..., 0:2]), source="IQ4_NL")


def _iq4_xs(b, shape):
    n = shape[0]
    d = _f16(b[..., 0:2])[..., None]                                               # [n, ns, 1]
    sh = np.ascontiguousarray(b[..., 2:4]).view("<u2")                             # [n, ns, 1]
    sl = np.concatenate([b[..., 4:8, None] & 15, b[..., 4:8, None] >> 4], -1).reshape(n, -1, 8)
    ls = sl | (((sh >> (2 * np.arange(8, dtype=np.uint16))) & 3) << 4).astype(np.uint8)      # 0..63
    return QWeight("nl", shape, b[..., 8:136], (d * (ls.astype(np.float32) - 32)).reshape(n, -1),
                   source="IQ4_XS")


_PACKERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q4_K": _q4_k, "Q6_K": _q6_k,
            "Q5_1": _q5_1, "Q5_K": _q5_k, "Q2_K": _q2_k, "Q3_K": _q3_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
