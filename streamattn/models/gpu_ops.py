"""The decoder layer's ops on the GPU: :class:`GpuOps`, the row work as the fused kernels of kernels/layer_ops.cu.

:class:`~streamattn.models.array_ops.ArrayOps` on CuPy runs a layer as about fifty array operations (each
RMSNorm five, RoPE a dozen over tables computed on the host every step, GLU six, the residual adds).
Here each of RMSNorm + its matmul's input, heads split + per-head norm + RoPE, GLU, and the residual add
with its post norm is one launch (:mod:`streamattn.kv.backends.gpu_layer`), RoPE reading positions from
the device, uploaded once a step for every layer. The matmuls stay ``array_ops.linear`` (the packed GEMV
kernels on the file's blocks, else cuBLAS) and attention stays ``append_attend``.
"""
from __future__ import annotations

from streamattn.kv.backends import gpu_layer
from streamattn.models.array_ops import ArrayOps


class GpuOps(ArrayOps):
    """The ops of :func:`streamattn.models.layer.decoder_layer` for one ``forward`` call of a model on the
    GPU (``Transformer.to(cupy)``).

    Parameters
    ----------
    tf : Transformer
        On the device; ``tf.rope_device`` holds each RoPE base's (inverse frequencies float64 [hd/2] on
        the device, attention factor).
    caches, pos, backend, counts, hook, positions
        As :class:`~streamattn.models.array_ops.ArrayOps` (``pos``: int [B, T] on the host); ``positions``
        "cache" with a sinks cache is not served here (its queries rotated at cache positions are the
        array ops').
    pos_dev : int32 [B, T] on the device
        ``pos``, uploaded once for every layer of the call.
    launch : callable
        ``launch(name, grid, block, args)``: ``streamattn.kv.backends.gpu.launch`` (a test passes the
        emulator's).
    """

    def __init__(self, tf, caches, pos, backend, counts, hook, positions, pos_dev, launch):
        if positions == "cache" and any(k.spec.sinks for k in caches):
            raise ValueError("GpuOps rotates queries at their text positions only; positions='cache' with a "
                             "sinks cache needs the array ops (ArrayOps)")
        super().__init__(tf, caches, None, pos, backend, counts, hook, positions)
        self.pos_dev, self.launch, self.rope = pos_dev, launch, tf.rope_device
        self.q_sink = None

    def norm_linear(self, x, norm_w, w):
        xp = self.xp
        return self.linear(gpu_layer.rms_norm_with(xp, self.launch, xp.ascontiguousarray(x), norm_w,
                                                   self.c.norm_eps), w)

    def heads_rope(self, h, qk_norm):
        c, xp = self.c, self.xp
        inv_freq, scale = self.rope[self.base]
        return gpu_layer.heads_rope_with(xp, self.launch, xp.ascontiguousarray(h), self.pos_dev, inv_freq,
                                         style=c.rope_style, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                                         qk_norm=qk_norm, eps=c.norm_eps, scale=scale)

    def glu_linear(self, gu, w):
        xp = self.xp
        return self.linear(gpu_layer.glu_with(xp, self.launch, xp.ascontiguousarray(gu), self.c.activation), w)

    def residual(self, x, y, norm_w):
        gpu_layer.residual_with(self.xp, self.launch, x, self.xp.ascontiguousarray(y), norm_w, self.c.norm_eps)
