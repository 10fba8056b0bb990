"""Decoder-only transformer forward pass (llama family and Gemma-3) on streamattn's KV caches.

The model owns weights and arithmetic; it never touches cache slots. Each layer: project q/k/v, apply
RoPE at absolute positions (``cache.lengths`` before the append), ``cache.append(k, v)`` ("write, then
attend"), ``attend(q, cache)``, project out, MLP. With ``positions="cache"`` a sinks cache also gets the
query rotated at its position inside the cache, min(i, n_s + n_c - 1), which is scored against the sink
keys only (docs/DESIGN.md §13). Written once against an array module ``xp`` (numpy
on the CPU; CuPy on the GPU once weights are moved with :meth:`Transformer.to`). Weight matrices are
float arrays or packed GGUF blocks (:class:`~streamattn.models.quant.QWeight`); :func:`linear` and
:func:`embed_rows` are the two operations that look at which.

Layer recipe (pre-norm; gemma3 extras in brackets)::

    x = embed[tok] [* sqrt(d_model)]
    for each layer:
        h = rmsnorm(x) @ Wqkv.T -> q, k, v        # fused: one matmul
        [q, k = rmsnorm_per_head(q), rmsnorm_per_head(k)]
        q, k = rope(q, pos), rope(k, pos)          # base per layer (gemma3: 1e4 local, 1e6 global)
        a = attend(q, cache.append(k, v)) @ Wo.T   # scale 1/sqrt(head_dim)
        x = x + [rmsnorm_post_attn](a)
        g, u = rmsnorm(x) @ Wgu.T                  # fused: one matmul
        x = x + [rmsnorm_post_ffw](act(g) * u @ Wdown.T)   # act: silu (llama) / gelu-tanh (gemma3)
    logits = rmsnorm(x) @ embed.T (tied) or @ output.T
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from streamattn import CacheSpec, KVCache
from streamattn.dispatch import _append_attend   # attend() without re-checking what forward built
from streamattn.models.arrange import FUSED
from streamattn.models.loader import GGUFModel, ModelConfig
from streamattn.models.quant import QWeight, concat_rows
from streamattn.models.rope import RopeTables, rope, rope_tables

CACHE_MODES = ("full", "window", "sinks")
POSITIONS = ("absolute", "cache")


@dataclass
class LayerWeights:
    """One block's weights, matrices ``[out, in]`` (multiply as ``x @ W.T``; float arrays, QWeight, or a
    tuple of row groups of different block kinds)."""

    attn_norm: object   # [d_model]
    wqkv: object        # [q_dim + 2*kv_dim, d_model]  (q rows, then k rows, then v rows)
    wo: object          # [d_model, q_dim]
    ffn_norm: object    # [d_model]
    wgu: object         # [2*d_ff, d_model]  (gate rows, then up rows)
    wdown: object       # [d_model, d_ff]
    qk_norm: object = None         # [n_heads + n_kv_heads, head_dim]  gemma3 (q_norm rows, then k_norm rows)
    post_attn_norm: object = None  # [d_model]   gemma3
    post_ffw_norm: object = None   # [d_model]   gemma3


@functools.cache
def _cpu_kernels(name: str):
    """Module ``streamattn.models.<name>`` (qmatmul, heads_kernel): imported on first use, since their Numba
    kernels load then and a GPU model never needs them; cached because an import statement in a function
    costs ~0.6 us a call, ~150 calls a decode step."""
    import importlib
    return importlib.import_module(f"streamattn.models.{name}")


def linear(xp, x, w):
    """``x @ w.T``: x [..., in], w [out, in] a float array or a :class:`QWeight` -> [..., out]."""
    if _int_kernel(w):
        return _cpu_kernels("qmatmul").plain_qmatmul(x, w)
    if isinstance(w, QWeight):
        return _cpu_kernels("qmatmul").qmatmul(x, w)
    if isinstance(w, tuple):                     # row groups of different block kinds
        return xp.concatenate([linear(xp, x, p) for p in w], axis=-1)
    return x @ w.T


def _int_kernel(w) -> bool:
    return isinstance(w, QWeight) and w.kind in ("q4", "q8")


def norm_linear(xp, x, norm_w, eps, w):
    """``rms_norm(x, norm_w) @ w.T``; on packed integer weights the norm is fused into the quantization
    of the activations (one compiled pass)."""
    if _int_kernel(w):
        return _cpu_kernels("qmatmul").norm_qmatmul(x, norm_w, eps, w)
    return linear(xp, rms_norm(xp, x, norm_w, eps), w)


def glu_linear(xp, gu, activation, w):
    """``(act(g) * u) @ w.T`` for gu = [g | u] [..., 2*d_ff]; act 'silu' or 'gelu_tanh'. Fused like
    :func:`norm_linear` on packed integer weights."""
    if _int_kernel(w):
        return _cpu_kernels("qmatmul").glu_qmatmul(gu, activation == "gelu_tanh", w)
    d_ff = gu.shape[-1] // 2
    g, u = gu[..., :d_ff], gu[..., d_ff:]
    return linear(xp, (gelu_tanh(xp, g) if activation == "gelu_tanh" else silu(xp, g)) * u, w)


def embed_rows(xp, w, ids):
    """Rows ``ids`` (int [n]) of an embedding table (float array or :class:`QWeight`) as float32 [n, d]."""
    if isinstance(w, QWeight):
        return w.rows(ids)
    return w[xp.asarray(ids)]


def _cat_rows(parts):
    """One weight holding the rows of ``parts`` in order (packed when their kinds agree, else a tuple)."""
    if all(isinstance(p, QWeight) for p in parts):
        return concat_rows(parts) or tuple(parts)
    if any(isinstance(p, QWeight) for p in parts):
        return tuple(parts)
    return np.ascontiguousarray(np.concatenate(parts, 0), np.float32)


def _to_device(xp, w):
    """A weight as an ``xp`` array: packed blocks are dequantized to float32 (the GPU path's copy)."""
    if isinstance(w, QWeight):
        w = w.dequantize()
    elif isinstance(w, tuple):
        w = np.concatenate([p.dequantize() if isinstance(p, QWeight) else p for p in w], 0)
    return xp.asarray(w)


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
        return _cpu_kernels("heads_kernel").heads_rope_cpu(h, cos, sin, style=style, n_heads=n_heads,
                                                           n_kv_heads=n_kv_heads, qk_norm=qk_norm, eps=eps)
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


class Transformer:
    """A GGUF model ready to run on streamattn caches.

    Parameters
    ----------
    model : GGUFModel
        From :func:`streamattn.models.loader.load_gguf`.
    xp : module, optional
        Array module (numpy default; cupy after :meth:`to`).

    Examples
    --------
    >>> tf = Transformer(load_gguf(path))                           # doctest: +SKIP
    >>> caches = tf.new_caches(batch=1, max_chunk=64)
    >>> logits = tf.forward(np.array([[1, 2, 3]]), caches)          # [1, 3, vocab]
    """

    def __init__(self, model: GGUFModel, xp=np):
        self.config: ModelConfig = model.config
        self.xp = xp
        c, w = self.config, model.weights
        self.weights_kind = model.weights_kind
        self.embed = w["token_embd.weight"]                       # [vocab, d_model]
        self.output = w.get("output.weight", self.embed)          # [vocab, d_model] (tied when absent)
        self.output_norm = w["output_norm.weight"]                # [d_model]
        self.layers = []
        def fused(p, key):
            """One layer's fused row groups (the loader's single copy, else concatenated here)."""
            f = model.fused.get(p + key + ".weight")
            return f if f is not None else _cat_rows([w[p + n + ".weight"] for n in FUSED[key]])

        for i in range(c.n_layers):
            p = f"blk.{i}."
            self.layers.append(LayerWeights(
                attn_norm=w[p + "attn_norm.weight"],
                wqkv=fused(p, "attn_qkv"),
                wo=w[p + "attn_output.weight"], ffn_norm=w[p + "ffn_norm.weight"],
                wgu=fused(p, "ffn_gate_up"),
                wdown=w[p + "ffn_down.weight"],
                qk_norm=None if not c.qk_norm else np.concatenate(
                    [np.tile(w[p + "attn_q_norm.weight"], (c.n_heads, 1)),
                     np.tile(w[p + "attn_k_norm.weight"], (c.n_kv_heads, 1))]),
                post_attn_norm=w.get(p + "post_attention_norm.weight"),
                post_ffw_norm=w.get(p + "post_ffw_norm.weight")))
        half = c.head_dim // 2
        self._rope = RopeTables({base: (1.0 / base ** (np.arange(half, dtype=np.float64) * 2 / c.head_dim))
                                 for base in {c.rope_base, c.rope_base_local}}, c.rope_style)

    def to(self, xp):
        """Move every weight array to array module ``xp`` (e.g. cupy); returns self. Packed weights are
        dequantized to float32 on the way (the GPU has no packed kernels yet)."""
        def conv(w):
            return _to_device(xp, w)
        tied = self.output is self.embed
        self.embed = conv(self.embed)
        self.output = self.embed if tied else conv(self.output)
        self.output_norm = conv(self.output_norm)
        for lw in self.layers:
            for k, v in vars(lw).items():
                if v is not None:
                    setattr(lw, k, conv(v))
        self.xp = xp
        return self

    # ------------------------------------------------------------------ caches
    def layer_window(self, i: int, mode: str, window: int | None):
        """Window n_c of layer i under a user cache mode (None: causal)."""
        own = self.config.layer_windows[i]
        if own is not None:                       # the model's own sliding layers (gemma3 local)
            return own if mode == "full" or window is None else min(own, window)
        return None if mode == "full" else window

    def new_caches(self, *, batch: int = 1, mode: str = "full", window: int | None = None, sinks: int = 0,
                   max_chunk: int = 1, dtype: str = "float32", max_len: int | None = None) -> list:
        """One KVCache per layer.

        Parameters
        ----------
        batch : int
        mode : {"full", "window", "sinks"}
            "full": causal caches on global layers; "window": sliding window of ``window`` keys
            everywhere; "sinks": window plus ``sinks`` attention-sink tokens. Layers the model itself
            slides (gemma3 local layers) always keep their own window, without sinks (as trained),
            unless the user's window is smaller: then they take it, with the sinks.
        window, sinks : int
        max_chunk : int
            Largest chunk that ``forward`` will be given (prefill chunk size).
        dtype : {"float32", "float16", "bfloat16"}
        max_len : int, optional
            Cap for causal caches.
        """
        if mode not in CACHE_MODES:
            raise ValueError(f"mode must be one of {CACHE_MODES} (got {mode!r})")
        if mode != "full" and (window is None or window < 1):
            raise ValueError(f"mode={mode!r} needs window >= 1 (got {window!r})")
        if mode == "sinks" and sinks < 1:
            raise ValueError(f"mode='sinks' needs sinks >= 1 (got {sinks!r}); use mode='window' for none")
        c = self.config
        caches = []
        for i in range(c.n_layers):
            w, own = self.layer_window(i, mode, window), c.layer_windows[i]
            # sinks where the user's window binds; a layer the model slides itself within the user's
            # window keeps exactly the attention it was trained with (its own window, no sinks)
            s = sinks if (mode == "sinks" and w is not None and (own is None or w < own)) else 0
            caches.append(KVCache(CacheSpec(batch=batch, kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                                            dtype=dtype, window=w, sinks=s, max_chunk=max_chunk,
                                            max_len=max_len if w is None else None),
                                  device="cpu" if self.xp is np else "gpu"))
        return caches

    # ------------------------------------------------------------------ forward
    def _rope_tables(self, pos, base):
        """(cos, sin) [B, T, 1, hd] of RoPE base ``base`` at positions ``pos`` [B, T], computed now."""
        cos, sin = rope_tables(pos[:, :, None], self._rope.inv_freq[base], self.config.rope_style)
        return self.xp.asarray(cos), self.xp.asarray(sin)

    def forward(self, tokens, caches: list, *, counts=None, backend: str = "cpu", last_only: bool = False,
                attn_hook: Callable | None = None, positions: str = "absolute"):
        """Run T new tokens per sequence through every layer, appending their K/V to ``caches``.

        Parameters
        ----------
        tokens : int array [B, T]
            New tokens; row b's first ``counts[b]`` entries are real, the rest padding.
        caches : list of KVCache
            From :meth:`new_caches` (one per layer), ``max_chunk >= T``.
        counts : int array [B], optional
            Real tokens per sequence (ragged batch). Default: all T.
        backend : str
            Attention backend for :func:`streamattn.dispatch`.
        last_only : bool
            Return logits of each sequence's last real token only: [B, vocab].
        attn_hook : callable(layer, q, k, v, out), optional
            Sees each layer's post-RoPE q: [B, Hq, T, hd], k, v: [B, Hkv, T, hd] and attention output.
        positions : {"absolute", "cache"}
            "absolute": RoPE at each token's position in the text. "cache": as StreamingLLM, positions
            within the cache, so a query never sees a key farther than n_s + n_c - 1 positions back
            (only sinks caches differ: windows and full caches give the same scores either way).

        Returns
        -------
        logits : float32 [B, T, vocab] (or [B, vocab] with ``last_only``)
        """
        xp, c = self.xp, self.config
        tokens = np.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, T] (got shape {tokens.shape})")
        B, T = tokens.shape
        if len(caches) != c.n_layers:
            raise ValueError(f"caches has {len(caches)} entries, expected one per layer ({c.n_layers})")
        if tokens.min() < 0 or tokens.max() >= c.vocab_size:
            raise ValueError(f"token ids must be in 0..{c.vocab_size - 1} (got {tokens.min()}..{tokens.max()})")
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS} (got {positions!r})")
        cnt = np.full(B, T, np.int64) if counts is None else np.asarray(counts, np.int64)
        pos = np.asarray(caches[0].lengths, np.int64)[:, None] + np.arange(T)[None, :]   # [B, T]
        tables = {base: (xp.asarray(cos), xp.asarray(sin)) for base, (cos, sin) in self._rope(pos).items()}
        sink_tables = {}    # (base, n_s + n_c - 1) -> tables at the queries' cache positions
        H, Hk, hd = c.n_heads, c.n_kv_heads, c.head_dim
        x = xp.asarray(embed_rows(xp, self.embed, tokens.reshape(-1))).reshape(B, T, c.d_model)  # [B, T, d]
        if c.embed_scale != 1.0:
            x = x * np.float32(c.embed_scale)
        attn_counts = None if counts is None or (cnt == T).all() else cnt    # None: every row real (one-call path)
        for i, (lw, cache) in enumerate(zip(self.layers, caches)):
            h = norm_linear(xp, x, lw.attn_norm, c.norm_eps, lw.wqkv)                  # [B, T, qd+2kvd]
            base = c.rope_base if c.layer_windows[i] is None else c.rope_base_local
            q, k, v = heads_rope(xp, h, *tables[base], style=c.rope_style, n_heads=H, n_kv_heads=Hk,
                                 qk_norm=lw.qk_norm, eps=c.norm_eps)  # q [B, H, T, hd], k, v [B, Hk, T, hd]
            q_sink = None
            if positions == "cache" and cache.spec.sinks:                               # [B, H, T, hd]
                newest = cache.spec.sinks + cache.spec.window - 1
                if (base, newest) not in sink_tables:
                    sink_tables[base, newest] = self._rope_tables(np.minimum(pos, newest), base)
                qs = _qk_heads(xp, h, H + Hk, hd, lw.qk_norm, c.norm_eps)[:, :, :H]
                q_sink = xp.ascontiguousarray(
                    rope(xp, qs, *sink_tables[base, newest], c.rope_style).transpose(0, 2, 1, 3))
            o, _ = _append_attend(q, k, v, cache, backend=backend, scale=float(c.attn_scale),
                                  counts=attn_counts, q_sink=q_sink)                    # write, then attend
            if attn_hook is not None:
                attn_hook(i, q, k, v, o)
            a = linear(xp, o.transpose(0, 2, 1, 3).reshape(B, T, H * hd), lw.wo)       # [B, T, d]
            if c.post_norms:
                a = rms_norm(xp, a, lw.post_attn_norm, c.norm_eps)
            x += a                                                                      # x: this call's own array
            gu = norm_linear(xp, x, lw.ffn_norm, c.norm_eps, lw.wgu)                   # [B, T, 2*d_ff]
            m = glu_linear(xp, gu, c.activation, lw.wdown)                               # [B, T, d]
            if c.post_norms:
                m = rms_norm(xp, m, lw.post_ffw_norm, c.norm_eps)
            x += m                                                                      # [B, T, d]
        if last_only:
            x = x[xp.arange(B), xp.asarray(cnt - 1)]                                    # [B, d]
        return norm_linear(xp, x, self.output_norm, c.norm_eps, self.output)          # [..., vocab]
