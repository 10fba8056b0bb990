"""Decoder-only transformer forward pass (llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma-2, Gemma-3) on streamattn's KV
caches.

The model owns weights and arithmetic; it never touches cache slots. ``forward`` embeds the tokens, runs
every layer, then the output norm and the logits (``hidden_states``: the same, on caches of its own,
stopping after the norm: what embeddings pool). A layer is :func:`streamattn.models.layer.decoder_layer`,
the one description of a block: run as array code (:class:`~streamattn.models.array_ops.ArrayOps`, on
numpy), on the GPU once weights are moved with :meth:`Transformer.to` (:class:`~streamattn.models.gpu_ops.GpuOps`:
the row work as fused kernels, RoPE at positions uploaded once a call), or on the CPU with packed integer
weights as one compiled call of the same function (:mod:`streamattn.models.compiled`; the same bits).
RoPE at absolute positions (``cache.lengths`` before the append), "write, then attend". With
``positions="cache"`` a sinks cache also gets the query rotated at its position inside the cache,
min(i, n_s + n_c - 1), which is scored against the sink keys only (docs/DESIGN.md §5).

Model (pre-norm; gemma3 extras in brackets)::

    x = embed[tok] [* sqrt(d_model)]
    for each layer:                                # decoder_layer
        h = rmsnorm(x) @ Wqkv.T [+ bqkv] -> q, k, v   # fused: one matmul; bias: qwen2
        [q, k = rmsnorm_per_head(q), rmsnorm_per_head(k)]   # gemma3, qwen3
        q, k = rope(q, pos), rope(k, pos)          # base per layer (gemma3: 1e4 local, 1e6 global); scaled
        a = attend(q, cache.append(k, v)) @ Wo.T   # scale 1/sqrt(head_dim)
        x = x + [rmsnorm_post_attn](a)
        g, u = rmsnorm(x) @ Wgu.T                  # fused: one matmul
        x = x + [rmsnorm_post_ffw](act(g) * u @ Wdown.T)   # act: silu (llama) / gelu-tanh (gemma3)
    logits = rmsnorm(x) @ embed.T (tied) or @ output.T
    [logits = cap * tanh(logits / cap)]            # gemma2's final soft-capping (and its attention
                                                   # scores' before the softmax, in every backend)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import numba
import numpy as np

from streamattn import CacheSpec, KVCache
from streamattn.kv import storage
from streamattn.kv.device_step import DeviceStep
from streamattn.models.feed import Feed
from streamattn.runtime.arrays import to_host
from streamattn.models import compiled
from streamattn.models.architectures import ARCHITECTURES
from streamattn.models.array_ops import ArrayOps, embed_rows, rms_norm, rotates_sink_queries
from streamattn.models.gpu_graph import StepGraph, graphable
from streamattn.models.gpu_ops import GpuOps
from streamattn.models.config import (EMBEDDING, OUTPUT, OUTPUT_NORM, ROPE_FREQS, ROPE_LONG, ROPE_SHORT, ModelConfig,
                                      tensor_name)
from streamattn.models.layer import LayerWeights, decoder_layer
from streamattn.models.rope import RopeTables, inverse_frequencies, rope_tables, yarn_divisors
from streamattn.quant.matmul import KernelPlan, Matmuls
from streamattn.kv.backends import gpu
from streamattn.kv.backends.gpu_gemv import GGUFMatrix
from streamattn.quant.weights import QWeight, concat_rows
from streamattn.runtime.threads import serial_kernels, thread_count

#: Prompt chunks run as a wavefront of row blocks, one Python thread each (:meth:`Transformer._wavefront`),
#: when the thread count is at most WAVEFRONT_MAX_LANES and every block gets WAVEFRONT_MIN_ROWS rows.
WAVEFRONT = True
WAVEFRONT_MIN_ROWS = 32
WAVEFRONT_MAX_LANES = 2                  # measured on 2 (docs/DESIGN.md §12); more keep the parallel kernels

CACHE_MODES = ("full", "window", "sinks")
POSITIONS = ("absolute", "cache")


def _cat_rows(parts):
    """One weight holding the rows of ``parts`` in order (packed when their kinds agree, else a tuple)."""
    if all(isinstance(p, GGUFMatrix) for p in parts) and len({p.gguf_type for p in parts}) == 1:
        rows = sum(p.shape[0] for p in parts)
        return GGUFMatrix(parts[0].gguf_type, (rows, parts[0].shape[1]), np.concatenate([p.blocks for p in parts]))
    if any(isinstance(p, GGUFMatrix) for p in parts):
        return tuple(parts)
    if all(isinstance(p, QWeight) for p in parts):
        return concat_rows(parts) or tuple(parts)
    if any(isinstance(p, QWeight) for p in parts):
        return tuple(parts)
    return np.ascontiguousarray(np.concatenate(parts, 0), np.float32)


def _layer_weight(c: ModelConfig, field: str, names: tuple, w: dict, fused: dict):
    """The LayerWeights ``field`` made of the tensors ``names``: one tensor; a row group (the loader's
    single fused copy, else concatenated here); for ``qk_norm`` the q-norm row per q head, then the k-norm
    row per kv head."""
    if field == "qk_norm":
        q, k = names
        return np.concatenate([np.tile(w[q], (c.n_heads, 1)), np.tile(w[k], (c.n_kv_heads, 1))])
    if len(names) == 1:
        return w[names[0]]
    f = fused.get(names)
    return f if f is not None else _cat_rows([w[n] for n in names])


def _rope_factors(c: ModelConfig, w: dict, context: int) -> tuple:
    """(which, [hd/2] per-dimension RoPE divisors or None) of a model run for ``context`` positions per
    sequence: llama3's ``rope_freqs`` (times YaRN's divisors, where the file has both, as ggml composes
    them); or Phi-3's long set when ``context`` exceeds the original context (llama.cpp's
    ``n_ctx_per_seq > n_ctx_orig_yarn``), else its short set."""
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < 1:
        raise ValueError(f"context must be a positive integer (positions per sequence; got {context!r})")
    long, short = w.get(tensor_name(ROPE_LONG)), w.get(tensor_name(ROPE_SHORT))
    if long is None and short is None:
        factors = w.get(tensor_name(ROPE_FREQS))
        if c.rope_yarn is not None:
            y = yarn_divisors(c.rope_base, c.head_dim, factor=c.rope_yarn,
                              context_orig=c.context_length if c.rope_orig_context is None else c.rope_orig_context)
            factors = y if factors is None else np.asarray(factors, np.float64) * y
        return None, factors
    if long is None or short is None:
        raise ValueError(f"RoPE factors {tensor_name(ROPE_LONG)!r} and {tensor_name(ROPE_SHORT)!r} come as a "
                         f"pair; the model has only {tensor_name(ROPE_SHORT if long is None else ROPE_LONG)!r}")
    orig = c.context_length if c.rope_orig_context is None else c.rope_orig_context
    return ("long", long) if context > orig else ("short", short)


def _to_device(xp, w):
    """A weight as an ``xp`` array: a GGUFMatrix keeps the file's bytes (the packed GEMV kernels read them),
    other packed blocks are dequantized to float32."""
    if isinstance(w, GGUFMatrix):
        return w.with_blocks(xp.ascontiguousarray(xp.asarray(w.blocks)))
    if isinstance(w, tuple) and any(isinstance(p, GGUFMatrix) for p in w):
        return tuple(_to_device(xp, p) for p in w)
    if isinstance(w, QWeight):
        w = w.dequantize()
    elif isinstance(w, tuple):
        w = np.concatenate([p.dequantize() if isinstance(p, QWeight) else p for p in w], 0)
    return xp.asarray(w)


def _device_id(a):
    """The id of the GPU holding array ``a`` (CuPy's ``a.device.id``), None where it has no device."""
    return getattr(getattr(a, "device", None), "id", None)


def _checked_counts(counts, B: int, T: int) -> np.ndarray:
    """``counts`` as int64 [B], each in 0..T; else ValueError naming what came (before any state moves, on
    every path: a wrong length whose values all equal T would otherwise pass as "every row real")."""
    try:
        raw = np.asarray(counts)
    except (ValueError, TypeError) as e:
        raise ValueError(f"counts must be an int array of shape ({B},) in 0..T={T} (got {type(counts).__name__}: "
                         f"{e})") from None
    if not (raw.dtype.kind in "iu" and raw.shape == (B,) and raw.min(initial=0) >= 0 and raw.max(initial=0) <= T):
        values = f", values {raw.min()}..{raw.max()}" if raw.dtype.kind in "iuf" and raw.size else ""
        raise ValueError(f"counts must be an int array of shape ({B},) in 0..T={T} (got dtype {raw.dtype}, "
                         f"shape {raw.shape}{values})")
    return raw.astype(np.int64)


class Transformer:
    """A GGUF model ready to run on streamattn caches.

    Parameters
    ----------
    model : streamattn.gguf.loader.GGUFModel
        From :func:`streamattn.gguf.loader.load_gguf`: its config, weights and fused row groups.
    xp : module, optional
        Array module (numpy default; cupy after :meth:`to`).
    plan : streamattn.quant.matmul.KernelPlan, optional
        Which packed-weight kernels its matmuls run (default: this CPU's best, ``KernelPlan()``); every
        plan gives the same bits. Kept for the model's life (:attr:`plan`, :attr:`matmuls`).
    context : int, optional
        The positions per sequence this model is run for (default: the file's ``context_length``, as
        llama.cpp's default context). It picks Phi-3's long RoPE factors when above the file's
        ``rope_orig_context``, else the short ones, once for the model's life (:attr:`rope_factors`;
        docs/DESIGN.md §21); other models ignore it.

    Examples
    --------
    >>> tf = Transformer(load_gguf(path))                           # doctest: +SKIP
    >>> caches = tf.new_caches(batch=1, max_chunk=64)
    >>> logits = tf.forward(np.array([[1, 2, 3]]), caches)          # [1, 3, vocab]
    """

    def __init__(self, model, xp=np, *, plan: KernelPlan | None = None, context: int | None = None):
        self.config: ModelConfig = model.config
        self.xp = xp
        self._plan = KernelPlan() if plan is None else plan
        #: The model's packed matmuls under its plan, with the drivers bound to each weight.
        self.matmuls = Matmuls(self._plan)
        c, w = self.config, model.weights
        self.weights_kind = model.weights_kind
        self.embed = w[tensor_name(EMBEDDING)]                          # [vocab, d_model]
        self.output = w.get(tensor_name(OUTPUT), self.embed)            # [vocab, d_model] (tied when absent)
        self.output_norm = w[tensor_name(OUTPUT_NORM)]                  # [d_model]
        arch = ARCHITECTURES[c.arch]
        self.layers = [LayerWeights(**{f: _layer_weight(c, f, names, w, model.fused)
                                       for f, names in arch.layer_tensors(i).items()})
                       for i in range(c.n_layers)]
        #: Run the layers as compiled calls on the CPU where they allow it (:mod:`streamattn.models.compiled`:
        #: the same bits); False runs every layer as array code.
        self.compile_layers = True
        self._compiled = None
        self._value_rounding = {}                    # layer -> (its W_o, value_rounding's factors)
        # RoPE scaling (linear, per-dimension divisors, the attention factor) applies to the global base; a
        # distinct local base is unscaled (Gemma-3: HF's local rotary is the default one, llama.cpp's
        # rope_freq_scale_train_swa is 1)
        #: Which of Phi-3's RoPE factor sets this model runs: "long", "short", or None (the file has none).
        self.rope_factors, factors = _rope_factors(c, w, c.context_length if context is None else context)
        self._rope = RopeTables({base: inverse_frequencies(base, c.head_dim, **(
                                    dict(linear=c.rope_linear, factors=factors) if base == c.rope_base else {}))
                                 for base in {c.rope_base, c.rope_base_local}}, c.rope_style,
                                scale={c.rope_base: c.rope_attn_factor})
        #: On the GPU (after :meth:`to`): {base: (inverse frequencies float64 [hd/2] on the device, attention
        #: factor)}, what the layer kernels rotate by (:class:`~streamattn.models.gpu_ops.GpuOps`); else None.
        self.rope_device = None
        #: Run a GPU decode step's layer row work as CUDA graphs (:mod:`streamattn.models.gpu_graph`),
        #: captured at a batch size's second step; off by default until a device run has checked it.
        self.cuda_graphs = False
        #: batch size -> its :class:`~streamattn.models.gpu_graph.StepGraph` (fixed buffers, segment graphs).
        self.step_graphs = {}
        #: The GPU decode steps' :class:`~streamattn.kv.device_step.DeviceStep` (its finite flag allocated
        #: once, pointed at each call's caches); None before the first step on the device.
        self.device_step = None

    @property
    def plan(self) -> KernelPlan:
        """The kernel plan this model was made with."""
        return self._plan

    def to(self, xp):
        """Move every weight array to array module ``xp`` (e.g. cupy); returns self. Matrices loaded with
        ``weights="gguf"`` keep the file's blocks (the packed GEMV kernels read them); other packed weights
        are dequantized to float32 on the way."""
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
        self._compiled = None
        self.step_graphs = {}
        self.device_step = None
        self.rope_device = None if xp is np else {
            base: (xp.asarray(inv), float(self._rope.scale[base])) for base, inv in self._rope.inv_freq.items()}
        return self

    # ------------------------------------------------------------------ caches
    def layer_window(self, i: int, mode: str, window: int | None):
        """Window n_c of layer i under a user cache mode (None: causal)."""
        own = self.config.layer_windows[i]
        if own is not None:                       # the model's own sliding layers (gemma3 local)
            return own if mode == "full" or window is None else min(own, window)
        return None if mode == "full" else window

    def new_caches(self, *, batch: int = 1, mode: str = "full", window: int | None = None, sinks: int = 0,
                   max_chunk: int = 1, dtype: str = "float32", max_len: int | None = None,
                   dtype_v: str | None = None, sink_dtype: str | None = "auto",
                   rotate_k: bool | None = None) -> list:
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
        dtype : {"float32", "float16", "bfloat16", "q8_0", "q4_0"}
            K's storage (and V's unless ``dtype_v``): :class:`~streamattn.kv.spec.CacheSpec`.
        dtype_v : str, optional
            V's storage where it differs.
        sink_dtype : {"auto", "float16", None}
            The sink tokens' storage (:class:`~streamattn.kv.spec.CacheSpec`): "auto" keeps them in float16
            when K or V is quantized; None stores them like every other token.
        rotate_k : bool, optional
            Store keys rotated (:class:`~streamattn.kv.spec.CacheSpec`); None: on for a quantized K.
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
                                            dtype=dtype, dtype_v=dtype_v, window=w, sinks=s, max_chunk=max_chunk,
                                            sink_dtype=sink_dtype if s else None, rotate_k=rotate_k,
                                            max_len=max_len if w is None else None),
                                  device="cpu" if self.xp is np else "gpu"))
        return caches

    # ------------------------------------------------------------------ forward
    def rope_tables_at(self, pos, base):
        """(cos, sin) [B, T, 1, hd] of RoPE base ``base`` at positions ``pos`` [B, T], computed now."""
        cos, sin = rope_tables(pos[:, :, None], self._rope.inv_freq[base], self.config.rope_style,
                               self._rope.scale[base])
        return self.xp.asarray(cos), self.xp.asarray(sin)

    def rope_base_of(self, i: int) -> float:
        """RoPE base of layer i (gemma3: local layers have their own)."""
        c = self.config
        return c.rope_base if c.layer_windows[i] is None else c.rope_base_local

    def value_rounding(self, i: int, spec: CacheSpec):
        """How layer i's V rows are rounded into ``spec``'s storage: None (to nearest) unless V is q4_0;
        then float64 [kv_heads, head_dim, head_dim] factors (:func:`streamattn.kv.storage.rounding_factor`) of
        H = sum of W_o,hᵀ W_o,h over the query heads h of each kv head, W_o,h the output projection's
        columns that head h's attention output meets (docs/DESIGN.md §6). A V row's rounding error e
        reaches the layer's output as W_o,h e weighted by the attention, so rounding each row for eᵀ H e
        rather than element by element keeps less of it. Made from the weights once (again when W_o is
        replaced), the same for every chunking of a sequence: stateless, like rounding to nearest."""
        if spec.v_dtype != "q4_0":
            return None
        wo = self.layers[i].wo
        got = self._value_rounding.get(i)
        if got is None or got[0] is not wo:
            c = self.config
            w = wo.dequantize() if isinstance(wo, QWeight) else wo
            w = to_host(w, copy=False).astype(np.float64)                          # [d_model, n_heads * hd]
            g, hd = c.n_heads // c.n_kv_heads, c.head_dim
            u = np.empty((c.n_kv_heads, hd, hd))
            for h in range(c.n_kv_heads):
                cols = w[:, h * g * hd:(h + 1) * g * hd].reshape(w.shape[0], g, hd)
                u[h] = storage.rounding_factor(np.einsum("dgi,dgj->ij", cols, cols))
            got = self._value_rounding[i] = (wo, u)
        return got[1]

    @staticmethod
    def key_search(spec: CacheSpec) -> bool:
        """Whether K rows are stored in ``spec``'s storage with searched block scales and codes rounded for
        their own token's queries: True for q4_0 keys (``streamattn.kv.storage.quantize_rows(..., search=True)``:
        each block's scale the one of 16, 0.70-1.0 of gguf's, that leaves the least squared error; then
        :func:`streamattn.kv.storage.recode_for_queries`: attention pays a key's error e as q·e over the queries
        that read it, and the token's own query group is the nearest sample of those, which took issue 28's
        q4_0 run from +6.2% to +3.0% perplexity; docs/DESIGN.md §6), False (gguf's rule) otherwise. A
        function of each token's own k and q alone, so every chunking, fork, rewind and draft stores the
        same bytes."""
        return spec.dtype == "q4_0"

    def _compiled_layers(self, backend, hook, positions, caches):
        """The compiled layers (:mod:`streamattn.models.compiled`) where this call may use them — CPU
        arrays, the CPU backend, no hook, no query rotated for sinks, no cache with float16 sinks (attended in
        two parts by streamattn.kv.dispatch) — else None (the array layers then raise what is wrong)."""
        if not (self.compile_layers and self.xp is np and backend in ("cpu", "auto")
                and hook is None and not rotates_sink_queries(positions, caches)
                and not any(k.sink_k is not None for k in caches)):
            return None
        if self._compiled is None:
            self._compiled = compiled.CompiledLayers(self)
        return self._compiled

    def _device_step(self, caches) -> DeviceStep:
        """The step over GPU ``caches``: :attr:`device_step`, pointed at them; a fresh one where that is open
        (a forward inside another's step, from a hook), on another array module or another device (the
        flag must live where the caches' append kernels write it)."""
        step = self.device_step
        if step is None or step.xp is not caches[0].xp or _device_id(step.flag) != _device_id(caches[0].k):
            step = self.device_step = DeviceStep(caches)
        return step.over(caches) if not (step.open or step.entries) else DeviceStep(caches)

    def _device_positions(self, caches, pos, cnt):
        """The tokens' positions ``pos`` [B, T] as device int32: the first cache's device lengths (which its
        append reads too: uploaded only where the host changed them) plus 0..T-1, else one upload."""
        counters, T = caches[0].counters, pos.shape[1]
        if counters is None or counters.lengths.shape[0] != pos.shape[0]:
            return self.xp.asarray(pos.astype(np.int32))
        lengths, _ = counters.match(caches[0].lengths, cnt)                               # [B] int32
        return lengths[:, None] + self.xp.arange(T, dtype=np.int32)[None, :]

    @staticmethod
    def _lanes(B: int, T: int, attn_counts) -> int:
        """How many row blocks a chunk runs in as a wavefront: the thread count, where that is 2..
        :data:`WAVEFRONT_MAX_LANES` and each block gets :data:`WAVEFRONT_MIN_ROWS` rows of one sequence
        whose rows are all real; else 1 (the layers' own parallel kernels)."""
        n = thread_count()
        if not WAVEFRONT or B != 1 or attn_counts is not None or not 2 <= n <= WAVEFRONT_MAX_LANES:
            return 1
        return n if T >= n * WAVEFRONT_MIN_ROWS else 1

    def _wavefront(self, x, pos, tables, caches, fast, backend: str, positions: str, lanes: int) -> None:
        """Every layer on the rows of x [1, T, d] (in place; ``pos``, ``tables``: the chunk's positions and
        RoPE tables, as :meth:`forward` made them), cut into ``lanes`` blocks of consecutive
        rows, each block on its own thread with serial kernels, block k entering layer i once block
        k - 1 has left it (its K/V rows are then in layer i's cache). A block's rows see the same keys in
        the same cache slots as in one call, so logits and caches are the same bits (attention does not
        depend on how rows are chunked; matmuls and norms work row by row). Why (docs/DESIGN.md §12): a
        chunk's layers otherwise make ~10 parallel regions a layer, and beside a busy neighbour each one's
        join waits for the slowed thread; here threads meet once per layer, and only the later block waits.
        The first exception on any thread is raised after all have stopped, each at a layer's edge; the
        caches are then part-written, as after one call that fails at a layer (there every layer below it
        holds the chunk; here an earlier block may be a few layers further than a later one)."""
        T = x.shape[1]
        cuts = [T * k // lanes for k in range(lanes + 1)]
        done, failed = [0] * lanes, []                 # layers each block has left; exceptions
        cond = threading.Condition()

        def lane(k: int) -> None:
            try:
                numba.set_num_threads(1)               # (this thread's count: nothing inside forks)
                r0, r1 = cuts[k], cuts[k + 1]
                n, xb, posb = r1 - r0, x[:, r0:r1], pos[:, r0:r1]          # views (one sequence)
                tab = {base: (cos[:, r0:r1], sin[:, r0:r1]) for base, (cos, sin) in tables.items()}
                ops = ArrayOps(self, caches, tab, posb, backend, None, None, positions)
                status, cnt, real = np.zeros(1, np.int64), np.array([n], np.int64), np.arange(n, dtype=np.int64)
                steps = {base: fast.step(cos.reshape(n, -1), sin.reshape(n, -1), 1, True, status, cnt, real)
                         for base, (cos, sin) in tab.items()}
                x2 = xb.reshape(n, x.shape[2])
                for i, lw in enumerate(self.layers):
                    if k:
                        with cond:
                            cond.wait_for(lambda: done[k - 1] > i or failed)
                    if failed:                             # another block raised: stop at a layer's edge
                        return
                    if not fast.run(i, x2, caches[i], steps[self.rope_base_of(i)]):
                        decoder_layer(xb, lw, ops.at_layer(i))
                    with cond:
                        done[k] = i + 1
                        cond.notify_all()
            except BaseException as e:                 # noqa: B036 (re-raised by the caller's thread)
                with cond:
                    failed.append(e)
                    cond.notify_all()

        count = numba.get_num_threads()
        workers = [threading.Thread(target=lane, args=(k,), name=f"streamattn-lane-{k}", daemon=True)
                   for k in range(1, lanes)]
        for w in workers:
            w.start()
        try:
            lane(0)
        finally:
            for w in workers:                          # an interrupt here still stops and waits for them
                while w.is_alive():
                    try:
                        w.join()
                    except BaseException as e:         # noqa: B036 (raised below)
                        with cond:
                            failed.append(e)
                            cond.notify_all()
            numba.set_num_threads(count)
        if failed:
            raise failed[0]
        for cache in caches:                           # the last append was the whole chunk, as in one call
            cache.last_counts[:] = T

    def forward(self, tokens, caches: list, *, counts=None, backend: str = "cpu", last_only: bool = False,
                logits_at=None, attn_hook: Callable | None = None, positions: str = "absolute", head_threads=None):
        """:meth:`run` of ``Feed(tokens, counts, *logits_at, last_only)``: the same pass with the feed's
        fields as keywords (``logits_at``: the (rows, cols) pair, or None)."""
        rows, cols = logits_at if logits_at is not None else (None, None)
        return self.run(Feed(tokens, counts, rows, cols, last_only), caches, backend=backend, attn_hook=attn_hook,
                        positions=positions, head_threads=head_threads)

    def run(self, feed: Feed, caches: list, *, backend: str = "cpu", attn_hook: Callable | None = None,
            positions: str = "absolute", head_threads=None):
        """Run ``feed``'s T new tokens per sequence through every layer, appending their K/V to ``caches``.

        Parameters
        ----------
        feed : Feed
            The tokens [B, T], the real ones per row, and which positions' logits come back.
        caches : list of KVCache
            From :meth:`new_caches` (one per layer), ``max_chunk >= T``.
        backend : str
            Attention backend for :func:`streamattn.kv.dispatch`.
        attn_hook : callable(layer, q, k, v, out), optional
            Sees each layer's post-RoPE q: [B, Hq, T, hd], k, v: [B, Hkv, T, hd] and attention output.
        positions : {"absolute", "cache"}
            "absolute": RoPE at each token's position in the text. "cache": as StreamingLLM, positions
            within the cache, so a query never sees a key farther than n_s + n_c - 1 positions back
            (only sinks caches differ: windows and full caches give the same scores either way).
        head_threads : callable, optional
            Returns a context manager the output head (final norm and vocabulary matmul) runs inside: the
            engine's thread chooser, which runs it on its own count (one long parallel region, where a
            descheduled worker costs little: docs/DESIGN.md §12). The same bits on any count.

        Returns
        -------
        logits : float32 [B, T, vocab], [B, vocab] (``feed.last_only``) or [N, vocab] (``feed.rows``)
        """
        x, cnt, ops = self._layers(feed.tokens, caches, counts=feed.counts, backend=backend, attn_hook=attn_hook,
                                   positions=positions)                          # [B, T, d]
        xp, c, B = self.xp, self.config, x.shape[0]
        T = x.shape[1]
        if feed.last_only and xp is not np and (T == 1 or (cnt == T).all()):
            # on the device, no index array uploaded
            x = xp.ascontiguousarray(x[:, T - 1])                                       # [B, d]
        elif feed.last_only:
            x = x[xp.arange(B), xp.asarray(cnt - 1)]                                    # [B, d]
        elif feed.rows is not None:
            x = x[xp.asarray(feed.rows), xp.asarray(feed.cols)]                          # [N, d]
        with head_threads() if head_threads is not None else contextlib.nullcontext():
            logits = ops.norm_linear(x, self.output_norm, self.output)                 # [..., vocab]
        if c.final_softcap is not None:                     # gemma2: cap * tanh(logits / cap), in float32
            cap = np.float32(c.final_softcap)
            logits = xp.tanh(logits / cap) * cap
        return logits

    def hidden_states(self, tokens, *, chunk: int = 256, backend: str = "cpu"):
        """The final hidden states of one sequence: every layer, then the output norm, and no output head
        (what an embedding pools), run on caches made here for it alone and dropped after, so that no
        other caller's state is touched.

        Parameters
        ----------
        tokens : int array [T]
            The sequence (T >= 1), fed from position 0.
        chunk : int
            Tokens per call of the layers (the caches' ``max_chunk``); the result depends on it at most by
            float32 rounding (matmuls of another row count).
        backend : str
            Attention backend, as for :meth:`forward`.

        Returns
        -------
        float32 [T, d_model], an array of this model's ``xp``

        Raises
        ------
        ValueError
            ``tokens`` not a non-empty 1-D integer array, an id outside the vocabulary, ``chunk`` < 1.

        Examples
        --------
        >>> h = tf.hidden_states(np.array([1, 2, 3]))                   # doctest: +SKIP
        >>> h.shape                                                      # (3, d_model)
        """
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
            raise ValueError(f"tokens must be a non-empty 1-D array of token ids (got shape {tokens.shape}, "
                             f"dtype {tokens.dtype})")
        if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1 (got {chunk!r})")
        xp, c, T = self.xp, self.config, tokens.size
        caches = self.new_caches(batch=1, max_chunk=min(chunk, T), max_len=T)
        out = xp.empty((T, c.d_model), np.float32)                                      # [T, d]
        for s in range(0, T, chunk):
            x, _, _ = self._layers(tokens[None, s:s + chunk], caches, counts=None, backend=backend, attn_hook=None,
                                   positions="absolute")                               # [1, t, d]
            out[s:s + x.shape[1]] = rms_norm(xp, x[0], self.output_norm, c.norm_eps)
        return out

    def _layers(self, tokens, caches: list, *, counts, backend: str, attn_hook, positions: str):
        """``forward`` up to the output head: (x float32 [B, T, d] after the last layer, cnt int [B], the call's
        layer ops, whose ``norm_linear`` the output head runs)."""
        xp, c = self.xp, self.config
        on_device = hasattr(tokens, "__cuda_array_interface__")      # ids from a device argmax: not uploaded
        if on_device and not (self.rope_device is not None and isinstance(self.embed, GGUFMatrix)):
            tokens, on_device = to_host(tokens), False   # a float table is indexed by ids checked on the host
        tokens = tokens if on_device else np.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, T] (got shape {tokens.shape})")
        B, T = tokens.shape
        if len(caches) != c.n_layers:
            raise ValueError(f"caches has {len(caches)} entries, expected one per layer ({c.n_layers})")
        if on_device:
            # read on the device: an id outside the table embeds as a NaN row, which the step's finite
            # check refuses (caches unchanged) where a cache checks finiteness (else NaN logits, no error)
            if tokens.dtype.kind not in "iu":
                raise ValueError(f"tokens on the device must be integer ids (got dtype {tokens.dtype})")
        elif tokens.min() < 0 or tokens.max() >= c.vocab_size:
            raise ValueError(f"token ids must be in 0..{c.vocab_size - 1} (got {tokens.min()}..{tokens.max()})")
        if positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS} (got {positions!r})")
        cnt = np.full(B, T, np.int64) if counts is None else _checked_counts(counts, B, T)     # [B] int64
        pos = np.asarray(caches[0].lengths, np.int64)[:, None] + np.arange(T)[None, :]   # [B, T]
        x = xp.asarray(embed_rows(xp, self.embed, tokens.reshape(-1), c.embed_scale))                 # [B*T, d]
        x = x.reshape(B, T, c.d_model)                                                            # [B, T, d]
        attn_counts = None if counts is None or (cnt == T).all() else cnt    # None: every row real (one-call path)
        graph = None
        if self.rope_device is not None and not rotates_sink_queries(positions, caches):
            if pos.max() >= 2**31:
                raise ValueError(f"positions must be below 2**31 for the GPU layer kernels (got {pos.max()})")
            tables = None                       # RoPE from device positions, for every layer
            pos_dev = self._device_positions(caches, pos, cnt)                              # [B, T] int32
            if graphable(self, B, T, positions, caches):     # fixed buffers: the segments' graphs read them
                graph = self.step_graphs.get(B) or self.step_graphs.setdefault(
                    B, StepGraph(xp, B, c.d_model, c.n_heads * c.head_dim))
                graph.x[...] = x
                graph.pos[...] = pos_dev
                x, pos_dev = graph.x, graph.pos
                graph.begin_step()
            ops = GpuOps(self, caches, pos, backend, attn_counts, attn_hook, positions, pos_dev, gpu.launch, graph)
        else:
            tables = {base: (xp.asarray(cos), xp.asarray(sin)) for base, (cos, sin) in self._rope(pos).items()}
            ops = ArrayOps(self, caches, tables, pos, backend, attn_counts, attn_hook, positions)
        fast = self._compiled_layers(backend, attn_hook, positions, caches)
        if fast is not None:                          # the compiled layers' RoPE rows, per base: [B*T, hd]
            serial, status = serial_kernels(), np.zeros(1, np.int64)
            real = np.flatnonzero(np.arange(T)[None, :] < cnt[:, None])   # [n] real rows of [B*T]
            steps = {base: fast.step(cos.reshape(B * T, -1), sin.reshape(B * T, -1), B, serial, status, cnt, real)
                     for base, (cos, sin) in tables.items()}
            x2 = x.reshape(B * T, c.d_model)
        lanes = self._lanes(B, T, attn_counts) if fast is not None else 1
        if lanes > 1 and fast.accepts(caches, T):
            self._wavefront(x, pos, tables, caches, fast, backend, positions, lanes)
        else:   # GPU caches: one finite check for all layers, at the step's end (kv.device_step)
            with self._device_step(caches) if caches[0].device == "gpu" else contextlib.nullcontext():
                try:
                    for i, lw in enumerate(self.layers):
                        if fast is not None and fast.run(i, x2, caches[i], steps[self.rope_base_of(i)]):
                            continue
                        decoder_layer(x, lw, ops.at_layer(i))
                    if graph is not None:                 # the last segment; the output head runs plain
                        graph.close()
                        ops.graph = None
                except BaseException:
                    if graph is not None:                 # a capture cut short: this batch size starts over
                        graph.abort()
                        self.step_graphs.pop(B, None)
                    raise
        return x, cnt, ops
