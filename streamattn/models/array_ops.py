"""The array-module ops of the model: what :func:`streamattn.models.layer.decoder_layer` runs as Python.

Written against an array module ``xp`` (numpy on the CPU; CuPy on the GPU once weights are moved with
``Transformer.to``). Weight matrices are float arrays or packed GGUF blocks
(:class:`~streamattn.quant.weights.QWeight`; on the GPU, the file's own blocks,
:class:`~streamattn.kv.backends.gpu_gemv.GGUFMatrix`); :func:`linear` and :func:`embed_rows` are the two
operations that look at which (on numpy, packed integer weights go to the fused kernels of
:mod:`streamattn.quant.matmul`). :class:`ArrayOps` binds them to one forward call as the layer's ops.
"""

from __future__ import annotations

import math

import gguf
import numpy as np

from streamattn.kv.backends.gpu_gemv import GGUFMatrix
from streamattn.kv.dispatch import append_attend   # attend() without re-checking what forward built
from streamattn.models.heads_kernel import heads_rope_cpu
from streamattn.models.rope import rope, rope_tables  # noqa: F401  (rope_tables: heads_rope's doctest)
from streamattn.quant import matmul as qmatmul
from streamattn.quant.weights import INT_KINDS, QWeight


def linear(xp, x, w, mm):
    """``x @ w.T``: x [..., in], w [out, in] a float array or a :class:`QWeight` -> [..., out]; ``mm``:
    the model's :class:`~streamattn.quant.matmul.Matmuls` (its kernel plan and bound drivers)."""
    if _int_kernel(w):
        return mm.plain(x, w)
    if _int_pieces(w):
        return mm.pieces(qmatmul.PLAIN, x, _NO_NORM, 0.0, w)
    if isinstance(w, QWeight):
        return qmatmul.qmatmul(x, w, group_rows=mm.plan.rows, vnni=mm.plan.vnni)
    if isinstance(w, GGUFMatrix):                # the file's blocks on the GPU: the packed GEMV kernels
        from streamattn.kv.backends import gpu
        flat = xp.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=xp.float32)
        return gpu.gemv(w, flat).reshape(*x.shape[:-1], w.shape[0])
    if isinstance(w, tuple):                     # row groups of different block kinds
        return xp.concatenate([linear(xp, x, p, mm) for p in w], axis=-1)
    return x @ w.T


def _int_kernel(w) -> bool:
    return isinstance(w, QWeight) and w.kind in INT_KINDS


def _int_pieces(w) -> bool:
    """Row groups of different kinds, each a packed integer weight: one activation quantization for all."""
    return isinstance(w, tuple) and all(map(_int_kernel, w))


_NO_NORM = np.zeros(1, np.float32)


def norm_linear(xp, x, norm_w, eps, w, mm):
    """``rms_norm(x, norm_w) @ w.T``; on packed integer weights the norm is fused into the quantization
    of the activations (one compiled pass)."""
    if _int_kernel(w):
        return mm.norm(x, norm_w, eps, w)
    if _int_pieces(w):
        return mm.pieces(qmatmul.NORM, x, norm_w, eps, w)
    return linear(xp, rms_norm(xp, x, norm_w, eps), w, mm)


def glu_linear(xp, gu, activation, w, mm):
    """``(act(g) * u) @ w.T`` for gu = [g | u] [..., 2*d_ff]; act 'silu' or 'gelu_tanh'. Fused like
    :func:`norm_linear` on packed integer weights."""
    if _int_kernel(w):
        return mm.glu(gu, activation == "gelu_tanh", w)
    if _int_pieces(w):
        return mm.pieces(qmatmul.GELU if activation == "gelu_tanh" else qmatmul.SILU, gu, _NO_NORM, 0.0, w)
    d_ff = gu.shape[-1] // 2
    g, u = gu[..., :d_ff], gu[..., d_ff:]
    return linear(xp, (gelu_tanh(xp, g) if activation == "gelu_tanh" else silu(xp, g)) * u, w, mm)


def embed_rows(xp, w, ids, scale: float = 1.0):
    """Rows ``ids`` (int [n]) of an embedding table (float array, :class:`QWeight` or a GGUFMatrix) times
    ``scale`` (the model's embedding scale, rounded once to float32) as float32 [n, d].

    A GGUFMatrix on the device is dequantized there from device ids (``gpu.embed``: the same bits; ids
    already on the device are not uploaded, nor checked: one outside 0..rows-1, of any integer dtype, gets a
    NaN row, which a step refuses where a cache checks finiteness); on the host, gguf-py dequantizes its
    rows' blocks."""
    if isinstance(w, GGUFMatrix) and xp is not np:
        from streamattn.kv.backends import gpu
        if not hasattr(ids, "__cuda_array_interface__"):
            ids = xp.asarray(np.asarray(ids, np.int32))
        elif ids.dtype.itemsize < 4 or ids.dtype == np.int32:
            ids = ids.astype(np.int32, copy=False)                     # every value kept
        else:   # int64 or uint32: an id past int32 must not wrap into the table; -1 is out of it (no sync)
            ids = xp.where((ids < 0) | (ids >= w.shape[0]), -1, ids).astype(np.int32)
        return gpu.embed(w, xp.ascontiguousarray(ids), scale=scale)
    if isinstance(w, QWeight):
        x = w.rows(ids)
    elif isinstance(w, GGUFMatrix):
        x = gguf.quants.dequantize(np.asarray(w.blocks)[np.asarray(ids)],
                                   gguf.GGMLQuantizationType[w.gguf_type]).astype(np.float32)
    else:
        x = w[xp.asarray(ids)]
    return x if scale == 1.0 else x * np.float32(scale)


def rms_norm(xp, x, w, eps):
    """RMSNorm over the last axis: ``x / sqrt(mean(x²) + eps) * w``. x: [..., n], w: [n] (broadcast)."""
    ms = (x * x).sum(axis=-1, keepdims=True) * np.float32(1.0 / x.shape[-1])
    return x * (1.0 / xp.sqrt(ms + np.float32(eps))) * w


def gelu_tanh(xp, x):
    return 0.5 * x * (1.0 + xp.tanh(np.float32(math.sqrt(2.0 / math.pi)) * (x + np.float32(0.044715) * x * x * x)))


def silu(xp, x):
    return x / (1.0 + xp.exp(-x))


def heads_rope(xp, h, cos, sin, *, style, n_heads, n_kv_heads, qk_norm=None, eps=0.0):
    """Attention heads from the fused projection: split, [per-head RMSNorm of q and k,] RoPE on q and k.

    Parameters
    ----------
    h : float32 [B, T, (H + 2*Hk) * hd]
        ``rms_norm(x) @ Wqkv.T``: q heads, then k heads, then v heads.
    cos, sin : float32 [B, T, 1, hd]
        :func:`rope_tables` at the tokens' positions.
    style : {"interleaved", "neox"}
    n_heads, n_kv_heads : int
    qk_norm : float32 [H + Hk, hd], optional
        Per-head RMSNorm weights of the q heads, then the k heads (Gemma-3), with ``eps``.

    Returns
    -------
    q : [B, H, T, hd], k, v : [B, Hk, T, hd], contiguous

    On numpy, one compiled pass (:mod:`streamattn.models.heads_kernel`); on any other ``xp`` (CuPy),
    the array code of :func:`_heads_rope_xp`. Both do the same float32 arithmetic in the same order.

    >>> h = np.ones((1, 1, 3 * 4), np.float32); c, s = rope_tables(np.zeros((1, 1, 1)), np.ones(2), "neox")
    >>> [a.shape for a in heads_rope(np, h, c, s, style="neox", n_heads=1, n_kv_heads=1)]
    [(1, 1, 1, 4), (1, 1, 1, 4), (1, 1, 1, 4)]
    """
    if xp is np:
        return heads_rope_cpu(h, cos, sin, style=style, n_heads=n_heads, n_kv_heads=n_kv_heads, qk_norm=qk_norm,
                              eps=eps)
    return _heads_rope_xp(xp, h, cos, sin, style=style, n_heads=n_heads, n_kv_heads=n_kv_heads,
                          qk_norm=qk_norm, eps=eps)


def _qk_heads(xp, h, n_qk, hd, qk_norm, eps):
    """h's q and k heads [B, T, n_qk, hd], per-head RMSNormed when ``qk_norm`` is given."""
    qk = h[..., : n_qk * hd].reshape(*h.shape[:-1], n_qk, hd)
    return qk if qk_norm is None else rms_norm(xp, qk, qk_norm, eps)


def _heads_rope_xp(xp, h, cos, sin, *, style, n_heads, n_kv_heads, qk_norm, eps):
    """:func:`heads_rope` as array operations of ``xp``."""
    B, T = h.shape[:2]
    H, Hk = n_heads, n_kv_heads
    hd = h.shape[-1] // (H + 2 * Hk)
    qk = rope(xp, _qk_heads(xp, h, H + Hk, hd, qk_norm, eps), cos, sin, style)   # [B, T, H + Hk, hd]
    q = xp.ascontiguousarray(qk[:, :, :H].transpose(0, 2, 1, 3))                # [B, H, T, hd]
    k = xp.ascontiguousarray(qk[:, :, H:].transpose(0, 2, 1, 3))                # [B, Hk, T, hd]
    v = xp.ascontiguousarray(h[..., (H + Hk) * hd:].reshape(B, T, Hk, hd).transpose(0, 2, 1, 3))
    return q, k, v


def rotates_sink_queries(positions: str, caches) -> bool:
    """True where a ``forward`` call also rotates its queries at their positions inside a sinks cache
    (``positions="cache"`` and some cache keeps sinks): only :class:`ArrayOps` does that second rotation,
    so the compiled layers, the GPU ops and the step graphs stand aside for such a call."""
    return positions == "cache" and any(k.spec.sinks for k in caches)


class ArrayOps:
    """The ops of :func:`streamattn.models.layer.decoder_layer` as array code on the model's ``xp``, for
    one ``forward`` call; :meth:`at_layer` points them at a layer."""

    def __init__(self, tf, caches, tables, pos, backend, counts, hook, positions):
        self.tf, self.xp, self.c, self.mm = tf, tf.xp, tf.config, tf.matmuls
        self.caches, self.tables, self.pos, self.backend = caches, tables, pos, backend
        self.counts, self.hook, self.positions = counts, hook, positions
        self.sink_tables = {}    # (base, n_s + n_c - 1) -> tables at the queries' cache positions

    def at_layer(self, i: int):
        self.i, self.cache, self.base = i, self.caches[i], self.tf.rope_base_of(i)
        return self

    def norm_linear(self, x, norm_w, w):
        return norm_linear(self.xp, x, norm_w, self.c.norm_eps, w, self.mm)

    def heads_rope(self, h, qk_norm):
        """q, k, v; for a sinks cache under ``positions="cache"`` also the queries rotated at their cache
        positions, which score the sink keys (``self.q_sink``)."""
        xp, c, cache, base = self.xp, self.c, self.cache, self.base
        q, k, v = heads_rope(xp, h, *self.tables[base], style=c.rope_style, n_heads=c.n_heads,
                             n_kv_heads=c.n_kv_heads, qk_norm=qk_norm, eps=c.norm_eps)
        self.q_sink = None
        if self.positions == "cache" and cache.spec.sinks:                              # [B, H, T, hd]
            newest = cache.spec.sinks + cache.spec.window - 1
            if (base, newest) not in self.sink_tables:
                self.sink_tables[base, newest] = self.tf.rope_tables_at(np.minimum(self.pos, newest), base)
            qs = _qk_heads(xp, h, c.n_heads + c.n_kv_heads, c.head_dim, qk_norm, c.norm_eps)[:, :, :c.n_heads]
            self.q_sink = xp.ascontiguousarray(
                rope(xp, qs, *self.sink_tables[base, newest], c.rope_style).transpose(0, 2, 1, 3))
        return q, k, v

    def attend(self, q, k, v):
        o, _ = append_attend(q, k, v, self.cache, backend=self.backend, scale=float(self.c.attn_scale),
                              counts=self.counts, q_sink=self.q_sink, softcap=self.c.attn_softcap,
                              v_rounding=self.tf.value_rounding(self.i, self.cache.spec),
                              k_search=self.tf.key_search(self.cache.spec))                  # write, then attend
        if self.hook is not None:
            self.hook(self.i, q, k, v, o)
        B, H, T, hd = o.shape
        return o.transpose(0, 2, 1, 3).reshape(B, T, H * hd)                            # [B, T, H*hd]

    def linear(self, x, w):
        return linear(self.xp, x, w, self.mm)

    def glu_linear(self, gu, w):
        return glu_linear(self.xp, gu, self.c.activation, w, self.mm)

    def bias(self, x, b):
        return x if b is None else x + b

    def post_norm(self, x, norm_w):
        return x if norm_w is None else rms_norm(self.xp, x, norm_w, self.c.norm_eps)

    def residual(self, x, y, norm_w):
        x += self.post_norm(y, norm_w)
