"""The layers' row work of a GPU decode step as CUDA graphs, captured once per batch size and replayed.

A decode step (T = 1) on the GPU is a few hundred short launches; the host's Python between them, not the
device, sets the pace. Between two attentions every launch of the step (the output projection, the
residual adds, the feed-forward half, the next layer's norm, q/k/v projection, heads split and RoPE) reads
only the residual rows, the attention output, the positions and the weights, so it is the same sequence
of kernels with the same arguments at every step of one batch size, as long as those inputs sit at the
same addresses. :class:`StepGraph` holds those inputs in fixed device buffers and the step's segments
(the launches before the first attention, between attentions, after the last) as graphs:

======  =====================================================================
step    what runs
======  =====================================================================
first   plain launches (kernels built, the memory pool warmed by the step)
second  each segment captured on the graph's stream, then launched on the current stream
later   each segment's graph launched; the ops' Python only looks up results
======  =====================================================================

Attention stays outside: its split count follows the context length, its cache appends move host
counters (and sinks kept apart upload their parts' lengths while a text's first rows fill them), so it is
launched as before, between segments.
"""
from __future__ import annotations

import numpy as np

from streamattn.kv.backends.gpu_gemv import GGUFMatrix
from streamattn.models.array_ops import rotates_sink_queries


def graphable(tf, B: int, T: int, positions: str, caches) -> bool:
    """True where the step can run as :class:`StepGraph` segments: graphs switched on (``tf.cuda_graphs``),
    a decode step (T = 1) and every layer matrix in GGUF blocks (the packed GEMV kernels; a float matrix is a
    cuBLAS call, a row group tuple a concatenation). A q/k/v bias is added by the heads kernel."""
    if not tf.cuda_graphs or T != 1 or B < 1 or rotates_sink_queries(positions, caches):
        return False
    return all(isinstance(getattr(lw, f), GGUFMatrix) for lw in tf.layers for f in ("wqkv", "wo", "wgu", "wdown"))


class StepGraph:
    """The fixed buffers and segment graphs of one batch size's decode step (owned by the Transformer, keyed
    by the batch size in ``tf.step_graphs``).

    Attributes
    ----------
    x : float32 [B, 1, d_model] on the device
        The residual rows: the step's embedding is copied in, the segments update it in place.
    pos : int32 [B, 1] on the device
        The step's positions, written (one upload) before the first segment.
    o : float32 [B, 1, n_heads * head_dim] on the device
        Each attention's output, copied in for the next segment.
    steps : int
        Steps begun with these buffers: 0 before any, 1 after the plain one, then capture, then replay.
    """

    def __init__(self, xp, B: int, d_model: int, o_width: int):
        self.xp = xp
        self.x = xp.zeros((B, 1, d_model), dtype=xp.float32)         # [B, 1, d]
        self.pos = xp.zeros((B, 1), dtype=xp.int32)                   # [B, 1]
        self.o = xp.zeros((B, 1, o_width), dtype=xp.float32)          # [B, 1, H*hd]
        self.stream = xp.cuda.Stream(non_blocking=True)    # captures; ordered with the step by events
        self.steps = 0
        self.segments = []     # [(graph, [(op name, argument addresses, result)])], in step order
        self.kept = []         # the captured ops' temporaries (see keep): every replay writes them again
        self._next = 0         # the segment the running step reaches next
        self._open = None      # the segment being captured or replayed: its index
        self._calls = None     # capture: the open segment's calls so far; replay: the next call's index

    @property
    def mode(self) -> str:
        """"plain", "capture" or "replay": what the step now running does."""
        return ("plain", "capture")[self.steps - 1] if self.steps <= 2 else "replay"

    def begin_step(self) -> None:
        """A step begins: the next mode, from its first segment."""
        self.steps += 1
        self._next, self._open = 0, None

    def op(self, name: str, args: tuple, run):
        """An op of the layers' row work: run it (plain), run it into the open segment's capture (capture),
        or give the result it gave at capture, after checking it is the same op on the same buffers
        (replay)."""
        mode = self.mode
        if mode == "plain":             # on the graph's stream too: CuPy's pool keeps free blocks per stream,
            step = self.xp.cuda.get_current_stream()    # so this step warms what the capture allocates from;
            self.stream.wait_event(step.record())       # after the step's work so far, before what follows
            with self.stream:
                result = run()
            step.wait_event(self.stream.record())
            return result
        keys = tuple(_address(a) for a in args)
        if mode == "capture":
            if self._open is None:
                self._open, self._calls = self._next, []
                self.stream.begin_capture()
            with self.stream:                       # the launches go into the capture
                result = run()
            self._calls.append((name, keys, result))
            return result
        if self._open is None:
            if self._next >= len(self.segments):
                raise RuntimeError(f"decode step graph: segment {self._next} was not captured; the graph's key "
                                   f"misses what changed")
            self._open, self._calls = self._next, 0
        calls = self.segments[self._open][1]
        if self._calls >= len(calls) or calls[self._calls][:2] != (name, keys):
            raise RuntimeError(f"decode step graph: op {self._calls} of segment {self._open} is {name} on other "
                               f"buffers than at capture; the graph's key misses what changed")
        result = calls[self._calls][2]
        self._calls += 1
        return result

    def keep(self, a):
        """Hold ``a``, a temporary that an op's captured launches write (an input it makes for the next
        launch), as long as the graph: a replay writes the same address, which must not go back to the
        memory pool when the op returns. Returns ``a``."""
        if self.mode == "capture":
            self.kept.append(a)
        return a

    def close(self) -> None:
        """End the segment now reached (at an attention, or after the last layer): capture makes and launches
        its graph, replay launches it, after checking that all its ops were asked for; the work after it
        then sees the segment's results. A segment of no ops is kept as one (replay checks it is still empty)."""
        mode = self.mode
        if mode == "capture":
            graph = None if self._open is None else self.stream.end_capture()
            self.segments.append((graph, self._calls if self._open is not None else []))
            self._open = None          # the capture has ended: an abort after a failed launch must not end it again
        elif mode == "replay":
            if self._next >= len(self.segments):
                raise RuntimeError(f"decode step graph: segment {self._next} was not captured; the graph's key "
                                   f"misses what changed")
            graph, calls = self.segments[self._next]
            ran = self._calls if self._open is not None else 0
            if ran != len(calls):
                raise RuntimeError(f"decode step graph: segment {self._next} ran {ran} of its {len(calls)} ops")
        if mode != "plain" and graph is not None:       # on the step's stream: after the attention before it
            graph.launch(stream=self.xp.cuda.get_current_stream())
        self._open, self._next = None, self._next + 1

    def abort(self) -> None:
        """A step that raised: end a capture left open (its graph dropped)."""
        if self._open is not None and self.mode == "capture":
            self.stream.end_capture()
        self._open = None


def _address(a):
    """Where an op's argument lives: a device array by its data pointer and shape, anything else as is."""
    interface = getattr(a, "__cuda_array_interface__", None)
    if interface is None:
        return a if a is None or isinstance(a, (int, float, str, np.generic)) else id(a)
    return interface["data"][0], tuple(interface["shape"])
