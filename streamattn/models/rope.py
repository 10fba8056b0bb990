"""Rotary position embedding: the float32 tables, the rotation, and a lookup that computes each table once.

RoPE turns each pair of a head's coordinates by the angle ``pos * inv_freq[i]``. Tables are computed in
float64 (angles reach 1e5 radians over long texts, where float32 would lose the phase) and rounded to
float32 once; the rotation itself runs in float32 (:func:`rope`, or the model's compiled heads kernel).
"""

from __future__ import annotations

import math

import numpy as np

#: Positions per block of :class:`RopeTables` (a decode stream recomputes tables every ROPE_BLOCK steps).
ROPE_BLOCK = 64


def inverse_frequencies(base: float, head_dim: int, *, linear: float = 1.0, factors=None) -> np.ndarray:
    """float64 [head_dim/2] inverse frequencies ``base ** (-2i / head_dim) / (factors[i] * linear)``.

    ``factors``: float [head_dim/2] per-dimension divisors (llama.cpp's ``rope_freqs.weight``, ggml's
    rope ``freq_factors``: how its converter stores Llama-3.x scaling), or None; ``linear``: linear
    scaling (``rope.scaling.factor``; ggml's ``freq_scale`` = 1/linear). With both at 1 this is plain
    RoPE, bit for bit.

    >>> inverse_frequencies(1e4, 4, factors=np.array([1.0, 8.0]))
    array([1.     , 0.00125])
    """
    inv = 1.0 / base ** (np.arange(head_dim // 2, dtype=np.float64) * 2 / head_dim)
    if factors is not None:
        f = np.asarray(factors, np.float64)
        if f.shape != inv.shape or not (np.isfinite(f).all() and (f > 0).all()):
            raise ValueError(f"RoPE frequency factors must be {inv.shape[0]} finite numbers > 0 (got shape "
                             f"{f.shape}, min {f.min() if f.size else None})")
        inv = inv / f
    return inv / linear if linear != 1.0 else inv


#: YaRN's ramp ends, in rotations over the original context: llama.cpp's defaults (its loader reads no
#: file key for them), and HF's when a config names none.
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def yarn_divisors(base: float, head_dim: int, *, factor: float, context_orig: int) -> np.ndarray:
    """float64 [head_dim/2] per-dimension divisors of YaRN (ggml's rope with ext_factor 1), for
    :func:`inverse_frequencies`' ``factors``.

    Dimension i turns at ``inv_i * ((1 - r_i) / factor + r_i)``: r_i = 1 (unchanged: extrapolated) for the
    fast dimensions, which turn more than :data:`YARN_BETA_FAST` times over ``context_orig`` positions, 0
    (divided by ``factor``: interpolated) for the slow ones, which turn less than :data:`YARN_BETA_SLOW`
    times, and a linear ramp over i between (ends floored and ceiled to whole dimensions, as ggml's
    ``ggml_rope_yarn_corr_dims`` and HF's ``truncate``). The attention factor 1 + 0.1 ln(factor) is
    applied to the tables, not here.

    >>> yarn_divisors(1e4, 8, factor=4.0, context_orig=4096).round(3)
    array([1.   , 1.   , 1.6  , 4.   ])
    """
    def dim(rotations):
        return head_dim * math.log(context_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(0.0, math.floor(dim(YARN_BETA_FAST))), min(head_dim - 1.0, math.ceil(dim(YARN_BETA_SLOW)))
    i = np.arange(head_dim // 2, dtype=np.float64)
    r = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)              # [hd/2] 1: extrapolated
    return 1.0 / ((1.0 - r) / factor + r)


def rope(xp, x, cos, sin, style):
    """Rotate pairs of x: [..., hd] by full-width tables cos, sin: [..., hd] (see ``rope_tables``).

    Each pair (a, b) becomes (a cos - b sin, a sin + b cos): ``x * cos + partner(x) * sin`` where
    ``partner`` swaps each pair's members and ``sin`` carries the sign (-sin on a, +sin on b).
    Pairs are (2i, 2i+1) for 'interleaved' (llama.cpp's llama GGUFs) and (i, i + hd/2) for 'neox'.
    """
    hd = x.shape[-1]
    if style == "interleaved":
        partner = x.reshape(*x.shape[:-1], hd // 2, 2)[..., ::-1].reshape(x.shape)
    else:
        partner = xp.concatenate([x[..., hd // 2:], x[..., : hd // 2]], axis=-1)
    return x * cos + partner * sin


def rope_tables(pos, inv_freq, style, scale: float = 1.0):
    """Full-width (cos, signed sin) float32 tables [*pos.shape, hd] for :func:`rope`, both multiplied by
    ``scale`` (an attention factor: ggml rope's ``mscale``; 1 leaves the tables as they were, bit for bit)."""
    ang = pos[..., None].astype(np.float64) * inv_freq                            # [..., hd/2]
    c, s = np.cos(ang), np.sin(ang)
    if scale != 1.0:
        c, s = c * scale, s * scale
    if style == "interleaved":
        return (np.repeat(c, 2, axis=-1).astype(np.float32),
                np.stack([-s, s], axis=-1).reshape(*s.shape[:-1], -1).astype(np.float32))
    return (np.concatenate([c, c], -1).astype(np.float32), np.concatenate([-s, s], -1).astype(np.float32))


class RopeTables:
    """The (cos, sin) tables of every RoPE base of a model at given positions, each computed once.

    The tables of a block of :data:`ROPE_BLOCK` positions are computed together, with
    :func:`rope_tables` itself (the same float64 arithmetic, so the same values: ``np.cos`` is
    elementwise), and looked up until a position falls outside the block; then the block restarts at
    the lowest position asked for. Positions spread wider than a block (a long prefill chunk, sequences
    far apart) are computed directly. Why a lookup: docs/DESIGN.md §23.

    Parameters
    ----------
    inv_freq : dict base -> float64 [hd/2]
    style : {"interleaved", "neox"}
    scale : dict base -> float, optional
        Each base's attention factor (:func:`rope_tables`' ``scale``; absent: 1).

    Examples
    --------
    >>> tabs = RopeTables({1e4: 1.0 / 1e4 ** (np.arange(2) / 2)}, "neox")
    >>> cos, sin = tabs(np.array([[5, 6]]))[1e4]                 # [B=1, T=2, 1, hd=4]
    >>> cos.shape
    (1, 2, 1, 4)
    """

    def __init__(self, inv_freq: dict, style: str, scale: dict | None = None):
        self.inv_freq, self.style = inv_freq, style
        self.scale = {b: (scale or {}).get(b, 1.0) for b in inv_freq}
        self._block = (0, None)     # (first position, {base: (cos, sin) [ROPE_BLOCK, 1, hd]}), swapped whole

    def __call__(self, pos) -> dict:
        """{base: (cos, sin) float32 [B, T, 1, hd]} at positions ``pos``: int [B, T] (maybe views of the
        block: read them, never write)."""
        one = pos.size == 1                     # one sequence decoding: the common step
        lo, hi = (int(pos.reshape(-1)[0]),) * 2 if one else (int(pos.min()), int(pos.max()))
        start, block = self._block
        if block is None or lo < start or hi >= start + ROPE_BLOCK:
            if hi - lo >= ROPE_BLOCK:
                return {b: rope_tables(pos[:, :, None], f, self.style, self.scale[b])
                        for b, f in self.inv_freq.items()}
            start = lo
            at = np.arange(start, start + ROPE_BLOCK, dtype=np.int64)[:, None]    # [ROPE_BLOCK, 1]
            block = {b: rope_tables(at, f, self.style, self.scale[b]) for b, f in self.inv_freq.items()}
            self._block = (start, block)
        if one:                                                                    # views, no gather
            i = lo - start
            return {b: (cos[None, i:i + 1], sin[None, i:i + 1]) for b, (cos, sin) in block.items()}
        idx = pos - start                                                          # [B, T]
        return {b: (cos[idx], sin[idx]) for b, (cos, sin) in block.items()}
