"""The decoder layer's ops on the GPU: :class:`GpuOps`, the row work as the fused kernels of kernels/layer_ops.cu.

:class:`~streamattn.models.array_ops.ArrayOps` on CuPy runs a layer as about fifty array operations (each
RMSNorm five, RoPE a dozen over tables computed on the host every step, GLU six, the residual adds).
Here each of RMSNorm + its matmul's input, q/k/v bias + heads split + per-head norm + RoPE, GLU, and the
residual add with its post norm is one launch (:mod:`streamattn.kv.backends.gpu_layer`), RoPE reading positions from
the device, uploaded once a step for every layer. The matmuls stay ``array_ops.linear`` (the packed GEMV
kernels on the file's blocks, else cuBLAS) and attention stays ``append_attend``. With a
:class:`~streamattn.models.gpu_graph.StepGraph` the row work between attentions runs as its CUDA graphs.
"""
from __future__ import annotations

from streamattn.kv.backends import gpu_layer
from streamattn.models.array_ops import ArrayOps, rotates_sink_queries


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
    graph : streamattn.models.gpu_graph.StepGraph, optional
        The decode step's graphs: each row op goes through ``graph.op`` (plain, captured or replayed), each
        attention closes the segment before it and copies its output into ``graph.o``.
    """

    def __init__(self, tf, caches, pos, backend, counts, hook, positions, pos_dev, launch, graph=None):
        if rotates_sink_queries(positions, caches):
            raise ValueError("GpuOps rotates queries at their text positions only; positions='cache' with a "
                             "sinks cache needs the array ops (ArrayOps)")
        super().__init__(tf, caches, None, pos, backend, counts, hook, positions)
        self.pos_dev, self.launch, self.rope, self.graph = pos_dev, launch, tf.rope_device, graph
        self.q_sink = None
        self.held_bias = None           # (rows, bias) from bias(), for the next heads_rope's kernel to add

    def _op(self, name, args, run):
        return run() if self.graph is None else self.graph.op(name, args, run)

    def _keep(self, a):
        """``a``, a temporary the op's launches write and read: with a graph, held as long as it (a replay
        writes it again), not freed to the memory pool when the op returns."""
        return a if self.graph is None else self.graph.keep(a)

    def norm_linear(self, x, norm_w, w):
        xp = self.xp
        return self._op("norm_linear", (x, norm_w, w), lambda: super(GpuOps, self).linear(self._keep(
            gpu_layer.rms_norm_with(xp, self.launch, xp.ascontiguousarray(x), norm_w, self.c.norm_eps)), w))

    def bias(self, x, b):
        """``x`` itself: the q/k/v bias ``b`` (Qwen2) is added by the kernel of the :meth:`heads_rope` that
        follows on these rows (``decoder_layer`` calls the two in turn), not by an array add."""
        self.held_bias = None if b is None else (x, b)
        return x

    def heads_rope(self, h, qk_norm):
        c, xp = self.c, self.xp
        inv_freq, scale = self.rope[self.base]
        bias, self.held_bias = self.held_bias, None
        if bias is not None:
            if bias[0] is not h:
                raise RuntimeError("GpuOps.heads_rope: the q/k/v bias held by bias() belongs to other rows; "
                                   "bias() must come right before heads_rope on the same rows")
            bias = bias[1]
        return self._op("heads_rope", (h, qk_norm, self.base, bias), lambda: gpu_layer.heads_rope_with(
            xp, self.launch, xp.ascontiguousarray(h), self.pos_dev, inv_freq, style=c.rope_style,
            n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, qk_norm=qk_norm, eps=c.norm_eps, scale=scale, bias=bias))

    def glu_linear(self, gu, w):
        xp = self.xp
        return self._op("glu_linear", (gu, w), lambda: super(GpuOps, self).linear(self._keep(
            gpu_layer.glu_with(xp, self.launch, xp.ascontiguousarray(gu), self.c.activation)), w))

    def linear(self, x, w):
        return self._op("linear", (x, w), lambda: super(GpuOps, self).linear(x, w))

    def residual(self, x, y, norm_w):
        self._op("residual", (x, y, norm_w), lambda: gpu_layer.residual_with(
            self.xp, self.launch, x, self.xp.ascontiguousarray(y), norm_w, self.c.norm_eps))

    def attend(self, q, k, v):
        """Attention as :class:`ArrayOps` runs it; with a graph, after the segment before it and with its
        output copied into the graph's fixed buffer (what the next segment reads)."""
        if self.graph is None:
            return super().attend(q, k, v)
        self.graph.close()
        o = super().attend(q, k, v)                                                      # [B, T, H*hd]
        self.graph.o[...] = o
        return self.graph.o
