"""Launch plan of the packed GEMV kernels (kernels/gemv_packed.cu) and the embedding rows (kernels/embed.cu),
with no CuPy import.

A decode step embeds its tokens (``embed_with``: the rows of their ids) and multiplies each weight matrix by
one activation row per sequence. :class:`GGUFMatrix` is a matrix as its GGUF file stores it: the type's
blocks, row by row, the bytes unchanged (the loader's ``GGUFFile`` tensors are views of exactly these bytes);
the kernels dequantize them in registers, so a device holds the file's bytes and nothing wider. ``gemv_with``
runs on any array module ``xp`` through a ``launch(name, grid, block, args)`` callable, as
``gpu_plan.attend_with`` does: CuPy on a device (``streamattn.kv.backends.gpu.gemv``), numpy in the CPU
emulation of the tests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .gpu_source import EMBED_THREADS, GEMV_BATCHES, GEMV_THREADS, GEMV_TYPES, embed_name, gemv_name


@dataclass(frozen=True)
class GGUFMatrix:
    """A weight matrix ``[rows, cols]`` in its GGUF type's blocks (``y = W x`` multiplies by its rows).

    Attributes
    ----------
    gguf_type : str
        A type of ``gpu_source.GEMV_TYPES``: "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K".
    shape : (rows, cols)
        cols a multiple of the type's block (32 values; 256 for the K-quants).
    blocks : array of uint8 [rows, cols / block values * block bytes]
        The file's bytes, C-contiguous (numpy on the host, CuPy on a device).

    Examples
    --------
    >>> from streamattn.gguf.reader import GGUFFile
    >>> t = GGUFFile("SmolLM2-135M-Instruct.Q4_1.gguf").tensors[1]             # doctest: +SKIP
    >>> w = GGUFMatrix.from_tensor(t)                                            # doctest: +SKIP
    """

    gguf_type: str
    shape: tuple
    blocks: object

    def __post_init__(self):
        if self.gguf_type not in GEMV_TYPES:
            raise ValueError(f"gguf_type must be one of {', '.join(GEMV_TYPES)} for the gemv kernels "
                             f"(got {self.gguf_type!r}); dequantize other types once at load")
        if len(self.shape) != 2 or not all(isinstance(n, (int, np.integer)) and 1 <= n < 2**31 for n in self.shape):
            raise ValueError(f"shape must be (rows, cols) of ints in 1 .. 2**31 - 1 (the kernels' int32 "
                             f"arguments; got {self.shape!r})")
        rows, cols = self.shape
        _, values, nbytes = GEMV_TYPES[self.gguf_type]
        if cols % values:
            raise ValueError(f"cols of a {self.gguf_type} matrix must be a multiple of its {values}-value block "
                             f"(got {cols})")
        want = (rows, cols // values * nbytes)
        dtype = getattr(self.blocks, "dtype", None)
        if dtype is None or dtype.name != "uint8" or tuple(self.blocks.shape) != want:
            raise ValueError(f"blocks of a {self.gguf_type} matrix {tuple(self.shape)} must be uint8 {want} (got "
                             f"{getattr(dtype, 'name', type(self.blocks).__name__)} "
                             f"{tuple(getattr(self.blocks, 'shape', ()))})")
        if not self.blocks.flags.c_contiguous:
            raise ValueError("blocks must be C-contiguous: the kernels address row r at r x row bytes")

    @classmethod
    def from_tensor(cls, tensor) -> "GGUFMatrix":
        """The matrix of a 2-D tensor of ``streamattn.gguf.reader.GGUFFile`` (its ``data``: a view of the file's
        bytes, [rows, row bytes]); ValueError for a type without a gemv kernel."""
        cols, rows = (int(n) for n in tensor.shape)      # the file's dims: fastest-varying first
        return cls(gguf_type=tensor.tensor_type.name, shape=(rows, cols), blocks=tensor.data)

    def with_blocks(self, blocks) -> "GGUFMatrix":
        """The same matrix over another copy of its bytes (e.g. ``cupy.asarray(w.blocks)``: the device's)."""
        return GGUFMatrix(gguf_type=self.gguf_type, shape=self.shape, blocks=blocks)


def _address(a) -> int:
    interface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return int(interface["data"][0])


def batch_width(batch: int) -> int:
    """NB of the kernel a batch of ``batch`` vectors launches: the smallest of GEMV_BATCHES that holds it, at
    most the largest (a larger batch takes ceil(batch / NB) launch rows, each reading the weight again)."""
    return next((nb for nb in GEMV_BATCHES if nb >= batch), GEMV_BATCHES[-1])


def gemv_with(xp, launch, weight: GGUFMatrix, x, *, out=None):
    """``y = x @ W.T`` for a packed GGUF matrix, through ``launch``; see ``streamattn.kv.backends.gpu.gemv``.

    Parameters
    ----------
    xp : module
        Array module of the arguments (cupy, or numpy for the emulation harness).
    launch : callable
        ``launch(name, grid, block, args)``: runs gemv specialisation ``name`` (gpu_source.gemv_name).
    weight : GGUFMatrix
        ``[rows, cols]``; its blocks start on a 16-byte boundary.
    x : array float32 [cols] or [batch, cols], C-contiguous, 16-byte aligned
    out : array float32 [batch, rows] (or [rows] for 1-D x), optional
        Written in place and returned (a decode loop allocates it once).

    Returns
    -------
    array float32 [batch, rows], or [rows] for 1-D x
    """
    if not isinstance(weight, GGUFMatrix):
        raise TypeError(f"weight must be a GGUFMatrix (got {type(weight).__name__})")
    rows, cols = weight.shape
    if getattr(x, "ndim", None) not in (1, 2) or x.shape[-1] != cols:
        raise ValueError(f"x must be [cols] or [batch, cols] with cols = {cols} (got shape "
                         f"{tuple(getattr(x, 'shape', ()))})")
    if x.dtype.name != "float32" or not x.flags.c_contiguous:
        raise TypeError(f"x must be C-contiguous float32 (got {x.dtype}, contiguous={x.flags.c_contiguous})")
    batch = 1 if x.ndim == 1 else x.shape[0]
    if batch < 1:
        raise ValueError("x must hold at least one vector (got batch 0)")
    for name, arr in (("weight.blocks", weight.blocks), ("x", x)):
        if _address(arr) % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary for the kernels' vector loads "
                             f"(address {_address(arr):#x})")
    shape = (rows,) if x.ndim == 1 else (batch, rows)
    if out is None:
        out = xp.empty(shape, dtype=xp.float32)
    elif tuple(out.shape) != shape or out.dtype.name != "float32" or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 {shape} (got {out.dtype} {tuple(out.shape)})")
    nb = batch_width(batch)
    i32 = np.int32
    launch(gemv_name(weight.gguf_type, nb), (math.ceil(rows * 32 / GEMV_THREADS), math.ceil(batch / nb), 1),
           (GEMV_THREADS, 1, 1), [weight.blocks, x, out, i32(rows), i32(cols), i32(batch)])
    return out


def embed_with(xp, launch, weight: GGUFMatrix, ids, *, scale: float = 1.0, out=None):
    """Rows ``ids`` of a packed GGUF matrix as float32, times ``scale``, through ``launch``: the embedding of
    a step's tokens, dequantized where the matrix lives (kernels/embed.cu).

    Parameters
    ----------
    xp : module
        Array module of the arguments (cupy, or numpy for the emulation harness).
    launch : callable
        ``launch(name, grid, block, args)``: runs embed specialisation ``name`` (gpu_source.embed_name).
    weight : GGUFMatrix
        ``[rows, cols]``; its blocks start on a 16-byte boundary.
    ids : array int32 [n], C-contiguous, on ``xp``
        Token ids; the kernel reads them, so the host never sees them. An id outside ``[0, rows)`` gives
        a row of NaN (a step's finite check then refuses it), not an error.
    scale : float
        Multiplies every value (the model's embedding scale; Gemma's sqrt(d_model)), rounded once to float32
        as the CPU path's ``rows * float32(scale)``.
    out : array float32 [n, cols], optional
        Written in place and returned (a decode loop allocates it once).

    Returns
    -------
    array float32 [n, cols]
        Equal bit for bit to ``gguf.quants.dequantize`` of the rows' blocks times ``float32(scale)``.
    """
    if not isinstance(weight, GGUFMatrix):
        raise TypeError(f"weight must be a GGUFMatrix (got {type(weight).__name__})")
    if getattr(ids, "ndim", None) != 1 or ids.dtype.name != "int32" or not ids.flags.c_contiguous:
        raise TypeError(f"ids must be a C-contiguous 1-D int32 array (got {getattr(ids, 'dtype', type(ids).__name__)} "
                        f"shape {tuple(getattr(ids, 'shape', ()))})")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float (got {scale!r})")
    rows, cols = weight.shape
    n = ids.shape[0]
    if out is None:
        out = xp.empty((n, cols), dtype=xp.float32)
    elif tuple(out.shape) != (n, cols) or out.dtype.name != "float32" or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 {(n, cols)} (got {out.dtype} {tuple(out.shape)})")
    if _address(weight.blocks) % 16:
        raise ValueError(f"weight.blocks must start on a 16-byte boundary for the kernels' loads "
                         f"(address {_address(weight.blocks):#x})")
    _, values, _ = GEMV_TYPES[weight.gguf_type]
    piece = 8 if values == 32 else 16                 # SaGemvType<TYPE>::PIECE
    if n:
        launch(embed_name(weight.gguf_type), (n, math.ceil(cols // piece / EMBED_THREADS), 1), (EMBED_THREADS, 1, 1),
               [weight.blocks, ids, out, np.int32(rows), np.int32(cols), np.float32(scale)])
    return out
