"""The decoder layer, written once over seven ops: the one description of the architectures' blocks.

:func:`decoder_layer` is plain Python over the ops below. Each op hands its work to ``at``, the layer's
context, so the same function runs two ways:

* as Python, with ``at`` an object whose methods are array code on any ``xp`` (numpy, CuPy):
  :class:`streamattn.models.array_ops.ArrayOps`, what ``Transformer.forward`` uses on numpy, or on the
  GPU :class:`streamattn.models.gpu_ops.GpuOps`, whose row ops are fused kernels (kernels/layer_ops.cu);
* compiled by Numba, with ``at`` a tuple of arrays and numbers: :mod:`streamattn.models.compiled`
  gives each op a Numba implementation (``numba.extending.overload``) over the same CPU kernels the
  array ops call, in the same order, so both give the same bits (tests/test_compiled_layer.py). The
  CPU decode step then costs one compiled call per layer, not ~40 Python calls and array wrappers.

Layer (pre-norm; Gemma-3's extras are a per-head norm in ``heads_rope`` and the two post norms, which
are the identity on a llama-family layer; Qwen2's is the bias of q, k, v; Qwen3's the per-head norm)::

    q, k, v = heads_rope(rms_norm(x) @ Wqkv.T [+ bqkv])   # [q-norm, k-norm,] RoPE
    residual(x, attend(q, k, v) @ Wo.T)              # x += post_norm(..); attend: write k, v, then attend
    residual(x, act(g) * u @ Wdown.T)                # g, u = rms_norm(x) @ Wgu.T; act: silu, gelu-tanh

``x`` is the residual stream, updated in place. ``w`` has the fields of :class:`LayerWeights`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerWeights:
    """One block's weights, matrices ``[out, in]`` (multiply as ``x @ W.T``; float arrays, QWeight, or a
    tuple of row groups of different block kinds). Which GGUF tensors make each field is the
    architecture's (:class:`streamattn.models.config.Architecture`)."""

    attn_norm: object   # [d_model]
    wqkv: object        # [q_dim + 2*kv_dim, d_model]  (q rows, then k rows, then v rows)
    wo: object          # [d_model, q_dim]
    ffn_norm: object    # [d_model]
    wgu: object         # [2*d_ff, d_model]  (gate rows, then up rows)
    wdown: object       # [d_model, d_ff]
    qk_norm: object = None         # [n_heads + n_kv_heads, head_dim]  (q-norm rows, then k-norm rows)
    post_attn_norm: object = None  # [d_model]
    post_ffw_norm: object = None   # [d_model]
    bqkv: object = None            # [q_dim + 2*kv_dim]  (q, k, v biases: qwen2), float32


def norm_linear(x, norm_w, w, at):
    """``rms_norm(x, norm_w) @ w.T``."""
    return at.norm_linear(x, norm_w, w)


def heads_rope(h, qk_norm, at):
    """The fused q/k/v rows ``h`` -> (q, k, v) heads, [per-head RMSNorm by ``qk_norm``,] RoPE at the
    tokens' positions."""
    return at.heads_rope(h, qk_norm)


def attend(q, k, v, at):
    """Write k, v into the layer's cache, then attend q over it: the heads' outputs as rows [.., H*hd]."""
    return at.attend(q, k, v)


def linear(x, w, at):
    """``x @ w.T``."""
    return at.linear(x, w)


def glu_linear(gu, w, at):
    """``(act(g) * u) @ w.T`` for gu = [g | u]."""
    return at.glu_linear(gu, w)


def bias(x, b, at):
    """``x + b`` (b [n] broadcast over the rows of x [.., n]), or x itself where the layer has no such bias."""
    return at.bias(x, b)


def residual(x, y, norm_w, at):
    """``x += rms_norm(y, norm_w)`` in place, or ``x += y`` where the layer has no such post norm (one op: the
    GPU runs it as one pass)."""
    at.residual(x, y, norm_w)


def decoder_layer(x, w, at):
    """One decoder layer on the residual rows ``x`` (in place): see the module docstring."""
    q, k, v = heads_rope(bias(norm_linear(x, w.attn_norm, w.wqkv, at), w.bqkv, at), w.qk_norm, at)
    residual(x, linear(attend(q, k, v, at), w.wo, at), w.post_attn_norm, at)
    residual(x, glu_linear(norm_linear(x, w.ffn_norm, w.wgu, at), w.wdown, at), w.post_ffw_norm, at)
