"""Server settings: one frozen dataclass, validated when it is built."""

from __future__ import annotations

from dataclasses import dataclass

# the choices of the flags every subcommand shares (a light module: no model code is imported);
# tests/test_serve_engine.py checks POSITIONS against models.transformer's, WEIGHTS against the loader's
from streamattn.engine.options import BACKENDS, CACHE_DTYPES, CACHE_MODES, DEFAULTS, POSITIONS, WEIGHTS, EngineConfig

#: How /v1/embeddings pools an input's final hidden states (llama-server's ``--pooling`` names).
POOLINGS = ("mean", "last")


@dataclass(frozen=True)
class ServeConfig:
    """Settings of ``streamattn serve`` (and of :func:`streamattn.serve.build_app`).

    Parameters
    ----------
    model : str or None
        A .gguf path or a model name (``streamattn.gguf.hub``); None = the default model.
    host, port : str, int
        Where uvicorn listens (``build_app`` itself ignores them).
    parallel : int
        Sequence slots: the batch of the engine's caches; at most this many requests decode at once.
    cache : {"full", "window", "sinks"}
    window, sinks : int or None, int
        Window n_c (keys incl. the current one) and sink tokens; None: 256 and 4 where they apply.
    max_queue : int
        Requests that may wait for a slot; one more gets 429.
    prompt_cache_mb : float
        Memory for the prompt cache (0 = off).
    threads : int
        CPU threads for matmuls and attention.
    backend : {"reference", "cpu", "gpu", "auto"}
    prefill_chunk : int
        Prompt tokens per sequence per engine step (and the caches' ``max_chunk``): a long prompt stalls
        the running streams by at most one chunk per step.
    cache_dtype : {"float32", "float16", "bfloat16", "q8_0", "q4_0"}
        K's storage (and V's unless ``cache_dtype_v``).
    cache_dtype_v : str or None
        V's storage where it differs from ``cache_dtype``.
    quantized_sinks : bool
        Store the sink tokens like every other token (default: kept apart where K or V is quantized, in
        float16, or float32 beside a float32 side).
    rotate_k : bool or None
        Keys stored rotated (:class:`~streamattn.kv.spec.CacheSpec`); None: on for a quantized K.
    positions : {"absolute", "cache"}
        RoPE positions: in the text, or within the cache (StreamingLLM; sinks caches only differ,
        docs/DESIGN.md §5).
    weights : {"quant", "f32"}
        Keep the GGUF's packed blocks (default) or dequantize everything to float32 (the reference path).
    model_id : str or None
        Name reported by /v1/models and required in requests (default: the model file's stem).
    speculative : {"ngram"} or None
        Speculative decoding for every request that does not say otherwise (its ``speculative`` field).
    draft_max : int
        Drafted tokens per step at most (capped at ``prefill_chunk - 1``).
    max_body_mb : float
        Largest request body accepted, in MiB (a larger one is answered 413 before it is read whole).
    pooling : {"mean", "last"}
        /v1/embeddings: the mean of an input's final hidden states, or its last token's
        (:mod:`streamattn.serve.embeddings`).
    debug_fail_text : str or None
        Testing aid: a request whose prompt text contains this string raises inside its engine step, to
        show that one request's failure stays its own.
    """

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    parallel: int = 4                  # concurrent clients: one slot each (the engine's default is 1)
    cache: str = DEFAULTS.cache
    window: int | None = DEFAULTS.window
    sinks: int | None = DEFAULTS.sinks
    max_queue: int = DEFAULTS.max_queue
    prompt_cache_mb: float = 256.0     # chat turns resend their history: reuse it (the engine's is off)
    threads: int = 1                   # a server sets its count (the engine's None leaves it be)
    backend: str = DEFAULTS.backend
    # a prompt chunk stalls every running stream for one step: shorter than the engine's, for latency
    prefill_chunk: int = 32
    cache_dtype: str = DEFAULTS.cache_dtype
    cache_dtype_v: str | None = DEFAULTS.cache_dtype_v
    quantized_sinks: bool = DEFAULTS.quantized_sinks
    rotate_k: bool | None = DEFAULTS.rotate_k
    positions: str = DEFAULTS.positions
    weights: str = "quant"
    model_id: str | None = None
    speculative: str | None = DEFAULTS.speculative
    draft_max: int = DEFAULTS.draft_max
    max_body_mb: float = 8.0
    pooling: str = "mean"
    debug_fail_text: str | None = None

    def __post_init__(self):
        def need(ok, name, expected):
            if not ok:
                raise ValueError(f"{name} must be {expected} (got {getattr(self, name)!r})")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        need(is_int(self.port) and 0 <= self.port <= 65535, "port", "an integer in 0..65535")
        need(is_int(self.parallel) and self.parallel >= 1, "parallel", "an integer >= 1 (sequence slots)")
        need(self.cache in CACHE_MODES, "cache", f"one of {CACHE_MODES}")
        if self.cache == "full":
            need(self.window is None, "window", "None with cache='full' (use cache='window' for a window)")
        else:
            need(self.window is None or (is_int(self.window) and self.window >= 1), "window",
                 "an integer >= 1, or None for the default 256")
        need(self.sinks is None or (is_int(self.sinks) and self.sinks >= (1 if self.cache == "sinks" else 0)),
             "sinks", "an integer >= 1 with cache='sinks' (>= 0 otherwise), or None for the default 4")
        need(is_int(self.max_queue) and self.max_queue >= 0, "max_queue", "an integer >= 0")
        need(isinstance(self.prompt_cache_mb, (int, float)) and not isinstance(self.prompt_cache_mb, bool)
             and self.prompt_cache_mb >= 0, "prompt_cache_mb", "a number >= 0 (0 turns the prompt cache off)")
        need(is_int(self.threads) and self.threads >= 1, "threads", "an integer >= 1")
        need(self.backend in BACKENDS, "backend", f"one of {BACKENDS}")
        need(is_int(self.prefill_chunk) and self.prefill_chunk >= 1, "prefill_chunk", "an integer >= 1")
        need(self.cache_dtype in CACHE_DTYPES, "cache_dtype", f"one of {CACHE_DTYPES}")
        need(self.cache_dtype_v is None or self.cache_dtype_v in CACHE_DTYPES, "cache_dtype_v",
             f"None or one of {CACHE_DTYPES}")
        need(isinstance(self.quantized_sinks, bool), "quantized_sinks", "True or False")
        need(self.rotate_k is None or isinstance(self.rotate_k, bool), "rotate_k",
             "True, False or None (on for a quantized K)")
        need(self.positions in POSITIONS, "positions", f"one of {POSITIONS}")
        need(self.weights in WEIGHTS, "weights", f"one of {WEIGHTS}")
        need(self.speculative in (None, "ngram"), "speculative", "None or 'ngram'")
        need(is_int(self.draft_max) and self.draft_max >= 1, "draft_max", "an integer >= 1")
        need(isinstance(self.max_body_mb, (int, float)) and not isinstance(self.max_body_mb, bool)
             and 0 < self.max_body_mb <= 1024, "max_body_mb", "a number in (0, 1024] (MiB)")
        need(self.pooling in POOLINGS, "pooling", f"one of {POOLINGS}")
        need(self.debug_fail_text is None or (isinstance(self.debug_fail_text, str) and self.debug_fail_text),
             "debug_fail_text", "None or a non-empty string")

    @property
    def spec_params(self):
        """The requests' default :class:`~streamattn.engine.speculative.SpecParams` (None: no speculation)."""
        return self.engine_config.spec_params

    @property
    def engine_config(self) -> EngineConfig:
        """The :class:`~streamattn.engine.options.EngineConfig` of the server's engine."""
        return EngineConfig(slots=self.parallel, cache=self.cache, window=self.window, sinks=self.sinks,
                            cache_dtype=self.cache_dtype, cache_dtype_v=self.cache_dtype_v,
                            quantized_sinks=self.quantized_sinks, rotate_k=self.rotate_k, backend=self.backend,
                            prefill_chunk=self.prefill_chunk, positions=self.positions, max_queue=self.max_queue,
                            prompt_cache_mb=self.prompt_cache_mb, threads=self.threads,
                            speculative=self.speculative, draft_max=self.draft_max)

    @property
    def cache_kwargs(self) -> dict:
        """Keyword arguments of ``Transformer.new_caches`` (without ``batch``)."""
        return self.engine_config.cache_kwargs
