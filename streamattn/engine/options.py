"""The settings of decoding, stated once.

:class:`EngineConfig` holds every default of the cache, thread, chunking and speculation settings; the
command line's :class:`ModelOptions` (one set of flags, :func:`add_arguments`, shared by ``generate``,
``inspect``, ``batch``, ``perplexity`` and ``serve``), the server's ``ServeConfig`` and ``Generator`` take
theirs from it, and where one needs another default it is one line that says why. A light module: no
model code is imported.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

BACKENDS = ("reference", "cpu", "gpu", "auto")
DEVICES = ("cpu", "gpu", "auto")
CACHE_MODES = ("full", "window", "sinks")
CACHE_DTYPES = ("float32", "float16", "bfloat16", "q8_0", "q4_0")
POSITIONS = ("absolute", "cache")
WEIGHTS = ("quant", "f32")
MAX_PREFILL_CHUNK = 8192
DEFAULT_WINDOW, DEFAULT_SINKS = 256, 4


@dataclass(frozen=True)
class EngineConfig:
    """How an :class:`~streamattn.engine.core.Engine` lays out its caches and runs its steps.

    Parameters
    ----------
    slots : int
        Sequences decoded at once (the batch of the caches).
    cache : {"full", "window", "sinks"}
    window, sinks : int or None
        Window n_c (keys incl. the current one) and sink tokens, for "window" / "sinks"; None:
        :data:`DEFAULT_WINDOW` and :data:`DEFAULT_SINKS` where they apply (:attr:`window_n`, :attr:`sinks_n`).
    cache_dtype : {"float32", "float16", "bfloat16", "q8_0", "q4_0"}
        K's storage (and V's unless ``cache_dtype_v``).
    cache_dtype_v : str or None
        V's storage where it differs from ``cache_dtype``.
    quantized_sinks : bool
        Store a sinks cache's sink tokens like every other token. False (default): a sinks cache whose K or
        V is quantized keeps its sinks apart, in float16 (float32 where K or V is float32:
        ``CacheSpec.sink_dtype``, docs/DESIGN.md §6).
    rotate_k : bool or None
        Keys stored rotated by a Walsh–Hadamard transform (:class:`~streamattn.kv.spec.CacheSpec`); None: on
        for a quantized K, off for float storage.
    backend : {"reference", "cpu", "gpu", "auto"}
    prefill_chunk : int
        Prompt tokens per sequence per step, and the caches' ``max_chunk``.
    positions : {"absolute", "cache"}
        RoPE positions (see ``Transformer.forward``).
    max_queue : int
        Requests that may wait for a slot beyond the free ones; one more raises ``QueueFull``.
    prompt_cache_mb : float
        Memory for the prompt cache (0 = off).
    threads : int or None
        CPU threads of the engine's own thread (``Engine.start``); None leaves them as they are.
    adapt_threads : bool
        The thread count is a ceiling: each kind of decode step (its real rows, by powers of two, up to
        ``core.ADAPT_ROWS``) runs on one thread or on the count set, whichever recent steps measured faster
        (:class:`~streamattn.runtime.threads.ThreadChooser`; the same tokens either way). False: always the count set.
    speculative : {"ngram"} or None
        Speculative decoding for the requests that do not say otherwise (:attr:`spec_params`).
    draft_max : int
        Drafted tokens per step at most (capped at ``prefill_chunk - 1``).
    """

    slots: int = 1
    cache: str = "full"
    window: int | None = None
    sinks: int | None = None
    cache_dtype: str = "float32"
    cache_dtype_v: str | None = None
    quantized_sinks: bool = False
    rotate_k: bool | None = None
    backend: str = "cpu"
    prefill_chunk: int = 64
    positions: str = "absolute"
    max_queue: int = 64
    prompt_cache_mb: float = 0.0
    threads: int | None = None
    adapt_threads: bool = True
    speculative: str | None = None
    draft_max: int = 8

    def __post_init__(self):
        for name, least in (("slots", 1), ("prefill_chunk", 1), ("max_queue", 0), ("draft_max", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{name} must be an integer >= {least} (got {v!r})")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS} (got {self.positions!r})")
        if not isinstance(self.quantized_sinks, bool):
            raise ValueError(f"quantized_sinks must be True or False (got {self.quantized_sinks!r})")
        if not isinstance(self.adapt_threads, bool):
            raise ValueError(f"adapt_threads must be True or False (got {self.adapt_threads!r})")
        if self.speculative not in (None, "ngram"):
            raise ValueError(f"speculative must be None or 'ngram' (got {self.speculative!r})")

    @property
    def window_n(self) -> int | None:
        """The window in force: ``window``, or :data:`DEFAULT_WINDOW` for a window or sinks cache."""
        return self.window if self.window is not None or self.cache == "full" else DEFAULT_WINDOW

    @property
    def sinks_n(self) -> int:
        """The sink tokens in force: 0 unless ``cache="sinks"`` (then ``sinks`` or :data:`DEFAULT_SINKS`)."""
        return (DEFAULT_SINKS if self.sinks is None else self.sinks) if self.cache == "sinks" else 0

    @property
    def cache_kwargs(self) -> dict:
        """Keyword arguments of ``Transformer.new_caches`` (without ``batch``)."""
        return dict(mode=self.cache, window=self.window_n, sinks=self.sinks_n,
                    max_chunk=self.prefill_chunk, dtype=self.cache_dtype, dtype_v=self.cache_dtype_v,
                    sink_dtype=None if self.quantized_sinks else "auto", rotate_k=self.rotate_k)

    @property
    def spec_params(self):
        """The default :class:`~streamattn.engine.speculative.SpecParams` (None: no speculation)."""
        from streamattn.engine.speculative import SpecParams
        return SpecParams(draft_max=self.draft_max) if self.speculative else None


#: The defaults every other settings class starts from.
DEFAULTS = EngineConfig()


@dataclass(frozen=True)
class ModelOptions:
    """Which model to load and how to decode it; fields as the flags of the same names.

    Parameters
    ----------
    model : str or None
        A .gguf path or a model name (``streamattn.gguf.hub``); None = the default model.
    weights : {"quant", "f32"}
        Keep the file's packed blocks, or dequantize to float32 (the reference path).
    cache : {"full", "window", "sinks"}
        KV cache of the model's global layers (a model's own local layers always slide).
    window, sinks : int or None
        Window n_c (keys incl. the current one) and sink tokens; None = 256 and 4 where they apply.
    positions : {"absolute", "cache"}
        RoPE positions in the text, or within the cache (StreamingLLM; sinks caches only differ).
    backend : {"reference", "cpu", "gpu", "auto"}
        The attention kernels. On a model placed on the GPU it is "gpu" (set from ``device``).
    device : {"cpu", "gpu", "auto"} or None
        Where the model runs: "gpu" puts its weights (the file's blocks) and caches on the CUDA device,
        "auto" does so when CuPy sees a device, else "cpu". None: where ``backend`` says (the GPU for
        ``--backend gpu``, the older spelling of ``--device gpu``), else the CPU. A host backend
        ("cpu", "reference") with ``device="gpu"``, or ``backend="gpu"`` with ``device="cpu"``, is refused.
    cache_dtype : {"float32", "float16", "bfloat16", "q8_0", "q4_0"}
        Storage of K and V (q8_0 / q4_0: GGUF's blocks of 32 with a float16 scale, read in place).
    cache_dtype_k, cache_dtype_v : str or None
        K's and V's storage where they differ from ``cache_dtype`` (None: ``cache_dtype``).
    quantized_sinks : bool
        ``--quantized-sinks``: a sinks cache stores its sink tokens like every other token; by default
        they are kept in float16 when K or V is quantized (docs/DESIGN.md §6).
    rotate_k : bool or None
        Store keys rotated by a Walsh–Hadamard transform (``--no-rotate-k``: False); None: on for a
        quantized K, off for float storage (:class:`~streamattn.kv.spec.CacheSpec`).
    prefill_chunk : int
        Prompt tokens per forward call (and the caches' ``max_chunk``), 1..8192.
    threads : int
        CPU threads for matmuls and attention.
    chat, system : bool, str or None
        Wrap string prompts in the model's chat template, with this system message.
    speculative, draft_max : {"ngram"} or None, int
        Speculative decoding (:mod:`streamattn.engine.speculative`) and its drafted tokens per step.

    Raises
    ------
    ValueError
        Naming the flag, the value and what was expected, before anything is loaded.
    """

    model: str | None = None
    weights: str = "quant"
    cache: str = DEFAULTS.cache
    window: int | None = DEFAULTS.window
    sinks: int | None = DEFAULTS.sinks
    positions: str = DEFAULTS.positions
    backend: str = DEFAULTS.backend
    device: str | None = None
    cache_dtype: str = DEFAULTS.cache_dtype
    cache_dtype_k: str | None = None
    cache_dtype_v: str | None = DEFAULTS.cache_dtype_v
    quantized_sinks: bool = DEFAULTS.quantized_sinks
    rotate_k: bool | None = DEFAULTS.rotate_k
    # one prompt at a time, no stream waiting behind it: longer chunks than the engine's prefill faster
    prefill_chunk: int = 256
    threads: int = 1                   # the command line sets a count (the engine's None leaves it be)
    chat: bool = False
    system: str | None = None
    speculative: str | None = DEFAULTS.speculative
    draft_max: int = DEFAULTS.draft_max

    def __post_init__(self):
        def need(ok, flag, value, expected):
            if not ok:
                raise ValueError(f"{flag} must be {expected} (got {value!r})")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        for flag, value, choices in (("--weights", self.weights, WEIGHTS), ("--cache", self.cache, CACHE_MODES),
                                     ("--positions", self.positions, POSITIONS),
                                     ("--backend", self.backend, BACKENDS),
                                     ("--cache-dtype", self.cache_dtype, CACHE_DTYPES)):
            need(value in choices, flag, value, "one of " + ", ".join(choices))
        for flag, value in (("--cache-dtype-k", self.cache_dtype_k), ("--cache-dtype-v", self.cache_dtype_v)):
            need(value is None or value in CACHE_DTYPES, flag, value, "one of " + ", ".join(CACHE_DTYPES))
        need(is_int(self.prefill_chunk) and 1 <= self.prefill_chunk <= MAX_PREFILL_CHUNK, "--prefill-chunk",
             self.prefill_chunk, f"in 1..{MAX_PREFILL_CHUNK}")
        need(is_int(self.threads) and self.threads >= 1, "--threads", self.threads, ">= 1")
        need(isinstance(self.quantized_sinks, bool), "--quantized-sinks", self.quantized_sinks, "True or False")
        need(self.rotate_k is None or isinstance(self.rotate_k, bool), "rotate_k", self.rotate_k,
             "True, False or None (default)")
        if self.cache == "full" and self.window is not None:
            raise ValueError(f"--window {self.window} applies to --cache window or sinks; with --cache full "
                             "every token is kept (drop --window, or add --cache window)")
        if self.cache != "sinks" and self.sinks is not None:
            raise ValueError(f"--sinks {self.sinks} applies to --cache sinks (got --cache {self.cache})")
        need(self.window is None or (is_int(self.window) and self.window >= 1), "--window", self.window, ">= 1")
        need(self.sinks is None or (is_int(self.sinks) and self.sinks >= 1), "--sinks", self.sinks, ">= 1")
        need(self.speculative in (None, "ngram"), "--speculative", self.speculative, "ngram (or absent)")
        need(is_int(self.draft_max) and self.draft_max >= 1, "--draft-max", self.draft_max, ">= 1")
        need(self.device is None or self.device in DEVICES, "--device", self.device, "one of " + ", ".join(DEVICES))
        if self.device == "gpu" and self.backend in ("cpu", "reference"):
            raise ValueError(f"--backend {self.backend} runs attention on the host, where --device gpu keeps no "
                             "cache (use --backend gpu or auto, or --device cpu)")
        if self.device == "cpu" and self.backend == "gpu":
            raise ValueError("--backend gpu runs attention on the GPU, where --device cpu keeps no cache "
                             "(use --device gpu, or --backend cpu)")
        object.__setattr__(self, "_device_flag", "--device" if self.device is not None else "--backend")
        if self.device == "auto" and self.backend in ("auto", "gpu"):
            from streamattn.kv.backends import gpu
            object.__setattr__(self, "device", "gpu" if gpu.available() else "cpu")
        if self.device == "gpu" or (self.device is None and self.backend == "gpu"):
            object.__setattr__(self, "device", "gpu")
            object.__setattr__(self, "backend", "gpu")
        elif self.device is None or self.device == "auto":
            object.__setattr__(self, "device", "cpu")

    @property
    def spec_params(self):
        """The :class:`~streamattn.engine.speculative.SpecParams` of these options (None: no speculation)."""
        return self.engine_config().spec_params

    @classmethod
    def from_args(cls, args) -> "ModelOptions":
        """From parsed flags of :func:`add_arguments` (``chat``/``system`` where the parser has them)."""
        return cls(model=args.model, weights=args.weights, cache=args.cache, window=args.window, sinks=args.sinks,
                   positions=args.positions, device=getattr(args, "device", None),
                   backend=args.backend if args.backend is not None else
                   ("auto" if getattr(args, "device", None) in ("gpu", "auto") else DEFAULTS.backend),
                   cache_dtype=args.cache_dtype,
                   cache_dtype_k=getattr(args, "cache_dtype_k", None), cache_dtype_v=getattr(args, "cache_dtype_v", None),
                   quantized_sinks=getattr(args, "quantized_sinks", False), rotate_k=getattr(args, "rotate_k", None),
                   prefill_chunk=args.prefill_chunk, threads=args.threads, chat=getattr(args, "chat", False),
                   system=getattr(args, "system", None), speculative=getattr(args, "speculative", None),
                   draft_max=getattr(args, "draft_max", DEFAULTS.draft_max))

    @property
    def k_dtype(self) -> str:
        """K's storage in force: ``cache_dtype_k`` or ``cache_dtype``."""
        return self.cache_dtype_k or self.cache_dtype

    @property
    def v_dtype(self) -> str:
        """V's storage in force: ``cache_dtype_v`` or ``cache_dtype``."""
        return self.cache_dtype_v or self.cache_dtype

    def engine_config(self, **overrides) -> EngineConfig:
        """These options as an :class:`EngineConfig` (``overrides``: its other fields, e.g. ``slots``)."""
        return EngineConfig(cache=self.cache, window=self.window, sinks=self.sinks, backend=self.backend,
                            prefill_chunk=self.prefill_chunk, cache_dtype=self.k_dtype, cache_dtype_v=self.v_dtype,
                            positions=self.positions, quantized_sinks=self.quantized_sinks, rotate_k=self.rotate_k,
                            speculative=self.speculative, draft_max=self.draft_max, **overrides)

    @property
    def window_n(self) -> int | None:
        """The window in force: None for a full cache, else ``window`` or :data:`DEFAULT_WINDOW`."""
        return None if self.cache == "full" else self.engine_config().window_n

    @property
    def sinks_n(self) -> int:
        """The sink tokens in force: 0 unless ``cache="sinks"`` (then ``sinks`` or :data:`DEFAULT_SINKS`)."""
        return self.engine_config().sinks_n

    def describe(self) -> str:
        """'cache sinks window 256 sinks 4'-style summary for progress lines."""
        return (f"cache {self.cache}" + (f" window {self.window_n}" if self.cache != "full" else "")
                + (f" sinks {self.sinks_n}" if self.cache == "sinks" else ""))

    def load(self, *, progress=None, quiet: bool = True):
        """Set the thread count, resolve and load the model once: ``(Transformer, Tokenizer, ModelFile)``.

        ``progress(done, total, name)`` sees the tensors being read. A model placed on the GPU
        (``device == "gpu"``) without a visible CUDA device is refused before the file is read. Python's
        cyclic garbage collector is paused meanwhile (and restored as it was, also on an error).
        """
        from streamattn.gguf.hub import resolve_model
        from streamattn.gguf.loader import load_gguf
        from streamattn.text.tokenizer import Tokenizer
        from streamattn.models.transformer import Transformer
        from streamattn.runtime.memory import paused_gc
        from streamattn.runtime.threads import set_threads

        self.check_device()
        set_threads(self.threads)
        with paused_gc():           # the vocabulary's strings, the tokenizer's parts: they live with the model
            m = load_gguf(resolve_model(self.model, quiet=quiet), progress=progress,
                          weights=file_weights(self.weights, self.device))
            tf = Transformer(m)
            if self.device == "gpu":
                import cupy
                tf.to(cupy)
            return tf, Tokenizer.from_metadata(m.metadata), m


    def check_device(self) -> None:
        """ValueError naming the flag when the model is to run on the GPU and no CUDA device is visible."""
        if self.device != "gpu":
            return
        from streamattn.kv.backends import gpu
        if not gpu.available():
            flag = getattr(self, "_device_flag", "--device")
            raise ValueError(f"{flag} gpu: no CUDA device is visible (or CuPy is not installed); use {flag} cpu")


def file_weights(weights: str, device: str) -> str:
    """``load_gguf``'s ``weights`` for a model run on ``device`` ("gpu", or a backend name, "gpu" meaning
    the same): on the GPU, packed matrices stay the file's blocks ("gguf", read by the packed GEMV
    kernels) instead of the CPU kernels' layouts."""
    return "gguf" if device == "gpu" and weights == "quant" else weights


def add_arguments(p: argparse.ArgumentParser, *, prefill_chunk: int | None = None, chat: bool = True) -> None:
    """The shared flags (``--model --weights --cache --window --sinks --positions --backend --cache-dtype
    --prefill-chunk --threads``, and ``--chat --system`` unless ``chat=False``) on parser ``p``, with
    :class:`ModelOptions`' defaults (``prefill_chunk``: a subcommand's own)."""
    d = ModelOptions()
    g = p.add_argument_group("model, weights, cache and threads (the same for every subcommand)")
    g.add_argument("--model", default=None,
                   help="a .gguf path or a model name (smollm2-135m, gemma3-270m); default smollm2-135m")
    g.add_argument("--weights", choices=WEIGHTS, default=d.weights,
                   help="quant: matrices stay in the file's block formats (default); f32: dequantized "
                        "float32 reference path")
    g.add_argument("--cache", choices=CACHE_MODES, default=d.cache,
                   help="KV cache for the model's global layers (gemma3's local layers always slide)")
    g.add_argument("--window", type=int, default=None,
                   help=f"window n_c in keys, the current one included (default {DEFAULT_WINDOW} with --cache "
                        "window/sinks)")
    g.add_argument("--sinks", type=int, default=None,
                   help=f"attention-sink tokens for --cache sinks (default {DEFAULT_SINKS})")
    g.add_argument("--positions", choices=POSITIONS, default=d.positions,
                   help="RoPE positions in the text, or within the cache (StreamingLLM; --cache sinks only)")
    g.add_argument("--device", choices=DEVICES, default=None,
                   help="where the model runs: cpu (default), gpu (weights as the file's blocks and the caches "
                        "on the CUDA device), auto (the GPU when CuPy sees one)")
    g.add_argument("--backend", default=None,
                   help=f"attention kernels: reference|cpu|gpu|auto (default {d.backend}; gpu with --device gpu; "
                        "--backend gpu alone also means --device gpu)")
    g.add_argument("--cache-dtype", default=d.cache_dtype, choices=CACHE_DTYPES,
                   help="K/V cache storage (q8_0, q4_0: GGUF blocks of 32 values with a float16 scale)")
    g.add_argument("--cache-dtype-k", default=None, choices=CACHE_DTYPES, help="K's storage, if not --cache-dtype")
    g.add_argument("--cache-dtype-v", default=None, choices=CACHE_DTYPES, help="V's storage, if not --cache-dtype")
    g.add_argument("--quantized-sinks", action="store_true",
                   help="with --cache sinks and a q8_0/q4_0 K or V: store the sink tokens quantized like the "
                        "rest (default: float16)")
    g.add_argument("--no-rotate-k", dest="rotate_k", action="store_const", const=False, default=None,
                   help="store q8_0/q4_0 keys as they are, without the Walsh-Hadamard rotation that cuts "
                        "their quantization error (on by default for a quantized K)")
    g.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk if prefill_chunk is None else prefill_chunk,
                   help="prompt tokens per forward call")
    g.add_argument("--threads", type=int, default=d.threads,
                   help="CPU threads for matmuls and attention, at most (default 1); decode steps run on "
                        "one thread where that measured faster (streamattn/runtime/threads.py ThreadChooser)")
    if chat:
        g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
        g.add_argument("--system", default=None, help="system message for --chat")
