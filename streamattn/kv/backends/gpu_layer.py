"""Launch plan of the decoder layer's kernels (kernels/layer_ops.cu), with no CuPy import.

The model's GPU ops (:class:`streamattn.models.gpu_ops.GpuOps`) run a layer's RMSNorms, residual adds,
heads split with RoPE, and GLU through these functions, one launch each. Like ``gpu_gemv.gemv_with`` they
run on any array module ``xp`` through a ``launch(name, grid, block, args)`` callable: CuPy on a device
(``streamattn.kv.backends.gpu.launch``), numpy in the CPU emulation of the tests. Every array is float32
and C-contiguous (positions int32, inverse frequencies float64); what is not raises before any launch.
"""
from __future__ import annotations

import math

import numpy as np

from .gpu_source import LAYER_HEAD_WARPS, LAYER_ROW_THREADS

ROPE_STYLES = ("interleaved", "neox")
ACTIVATIONS = ("silu", "gelu_tanh")


def _check(name: str, a, dtype: str = "float32", shape: tuple | None = None):
    if getattr(a, "dtype", None) is None or a.dtype.name != dtype or not a.flags.c_contiguous:
        raise TypeError(f"{name} must be a C-contiguous {dtype} array (got {getattr(a, 'dtype', type(a).__name__)}"
                        f"{'' if getattr(a, 'flags', None) is None else f', contiguous={a.flags.c_contiguous}'})")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (got {tuple(a.shape)})")


def _rows(x) -> tuple[int, int]:
    n = x.shape[-1] if x.ndim else 0
    if n < 1:
        raise ValueError(f"rows must have at least one value (got shape {tuple(x.shape)})")
    return x.size // n, n


def rms_norm_with(xp, launch, x, w, eps: float, *, out=None):
    """``x / sqrt(mean(x²) + eps) * w`` over the last axis, one block a row.

    Parameters
    ----------
    x : float32 [..., n]
    w : float32 [n]
    eps : float
    out : float32 like x, optional
        Written and returned.

    Returns
    -------
    float32 array like x
    """
    _check("x", x)
    rows, n = _rows(x)
    _check("w", w, shape=(n,))
    if out is None:
        out = xp.empty(x.shape, dtype=xp.float32)
    _check("out", out, shape=x.shape)
    if rows:
        launch("layer_norm", (rows, 1, 1), (LAYER_ROW_THREADS, 1, 1),
               [out, x, w, np.int32(n), np.float32(eps)])
    return out


def residual_with(xp, launch, x, y, w=None, eps: float = 0.0):
    """``x += rms_norm(y, w, eps)`` in place (``x += y`` where ``w`` is None), one pass over the rows.

    Parameters
    ----------
    x : float32 [..., n]
        The residual rows, updated.
    y : float32 like x
    w : float32 [n], optional
        The post-norm's weights (Gemma's post_attn / post_ffw norms).
    eps : float

    Returns
    -------
    x
    """
    _check("x", x)
    rows, n = _rows(x)
    _check("y", y, shape=x.shape)
    if w is not None:
        _check("w", w, shape=(n,))
    if rows:
        launch("layer_add" if w is None else "layer_addnorm", (rows, 1, 1), (LAYER_ROW_THREADS, 1, 1),
               [x, y, y if w is None else w, np.int32(n), np.float32(eps)])
    return x


def heads_rope_with(xp, launch, h, pos, inv_freq, *, style: str, n_heads: int, n_kv_heads: int, qk_norm=None,
                    eps: float = 0.0, scale: float = 1.0, bias=None):
    """The fused q/k/v rows [plus their bias] as heads, [per-head RMSNorm of q and k,] RoPE at device positions.

    What ``streamattn.models.array_ops.heads_rope`` computes from the tables of
    ``streamattn.models.rope.rope_tables(pos, inv_freq, style, scale)`` (on ``h + bias``), with no tables:
    each angle in float64, its cosine and sine times ``scale`` rounded to float32, the rotation in float32.

    Parameters
    ----------
    h : float32 [B, T, (H + 2 Hk) hd]
        q heads, then k heads, then v heads; hd even.
    pos : int32 [B, T]
        Each row's position.
    inv_freq : float64 [hd / 2]
        The base's inverse frequencies (``streamattn.models.rope.inverse_frequencies``: divisors and
        linear scaling included).
    style : {"interleaved", "neox"}
    n_heads, n_kv_heads : int
    qk_norm : float32 [H + Hk, hd], optional
        Per-head RMSNorm weights of the q heads, then the k heads, with ``eps``.
    scale : float
        The attention factor both tables carry (1: none).
    bias : float32 [(H + 2 Hk) hd], optional
        Added to every row of ``h`` first, in float32 (Qwen2's q/k/v bias: no array add before the launch).

    Returns
    -------
    q : float32 [B, H, T, hd], k, v : float32 [B, Hk, T, hd]
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"style must be one of {ROPE_STYLES} (got {style!r})")
    for name, n in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be an integer >= 1 (got {n!r})")
    _check("h", h)
    if h.ndim != 3 or h.shape[-1] % (n_heads + 2 * n_kv_heads) or (h.shape[-1] // (n_heads + 2 * n_kv_heads)) % 2:
        raise ValueError(f"h must be [B, T, (H + 2 Hk) hd] with H = {n_heads}, Hk = {n_kv_heads} and hd even "
                         f"(got shape {tuple(h.shape)})")
    B, T, width = h.shape
    hd = width // (n_heads + 2 * n_kv_heads)
    _check("pos", pos, "int32", (B, T))
    _check("inv_freq", inv_freq, "float64", (hd // 2,))
    if qk_norm is not None:
        _check("qk_norm", qk_norm, shape=(n_heads + n_kv_heads, hd))
    if bias is not None:
        _check("bias", bias, shape=(width,))
    q = xp.empty((B, n_heads, T, hd), dtype=xp.float32)
    k = xp.empty((B, n_kv_heads, T, hd), dtype=xp.float32)
    v = xp.empty((B, n_kv_heads, T, hd), dtype=xp.float32)
    if B * T:
        name = f"layer_heads_{style}" + ("_qknorm" if qk_norm is not None else "")
        launch(name, (B * T, math.ceil((n_heads + 2 * n_kv_heads) / LAYER_HEAD_WARPS), 1),
               (LAYER_HEAD_WARPS * 32, 1, 1),
               [h, h if qk_norm is None else qk_norm, pos, inv_freq, q, k, v, np.int32(T), np.int32(n_heads),
                np.int32(n_kv_heads), np.int32(hd), np.float32(eps), np.float64(scale), h if bias is None else bias,
                np.int32(bias is not None)])
    return q, k, v


def glu_with(xp, launch, gu, activation: str, *, out=None):
    """``act(g) * u`` for gu = [g | u] [..., 2 d_ff]; act "silu" or "gelu_tanh" (array_ops' formulas).

    Returns
    -------
    float32 [..., d_ff]
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS} (got {activation!r})")
    _check("gu", gu)
    rows, width = _rows(gu)
    if width % 2:
        raise ValueError(f"gu must be [..., 2 d_ff] (got an odd last axis: shape {tuple(gu.shape)})")
    d_ff = width // 2
    shape = (*gu.shape[:-1], d_ff)
    if out is None:
        out = xp.empty(shape, dtype=xp.float32)
    _check("out", out, shape=shape)
    if rows:
        launch("layer_glu_gelu" if activation == "gelu_tanh" else "layer_glu_silu",
               (rows, math.ceil(d_ff / LAYER_ROW_THREADS), 1), (LAYER_ROW_THREADS, 1, 1),
               [gu, out, np.int32(d_ff)])
    return out
