"""``streamattn serve``: an OpenAI-compatible streaming server with continuous batching on the ring caches.

>>> from streamattn.serve import ServeConfig, build_app                            # doctest: +SKIP
>>> app = build_app(ServeConfig(model="smollm2-135m", parallel=8))

Modules: config (ServeConfig), protocol (OpenAI schemas and bodies), sequence (one request's state),
engine (the batching loop), prompt_cache (token trie of saved states), metrics (Prometheus), app (routes),
embeddings and tokenize (/v1/embeddings, /tokenize, /detokenize), main (the CLI subcommand).
"""

from streamattn.serve.config import ServeConfig


def build_app(config: ServeConfig):
    """See :func:`streamattn.serve.app.build_app` (imported here lazily: FastAPI is an optional extra)."""
    from streamattn.serve.app import build_app as _build
    return _build(config)


__all__ = ["ServeConfig", "build_app"]
