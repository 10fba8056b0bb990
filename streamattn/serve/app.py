"""FastAPI app: /v1/chat/completions, /v1/completions, /v1/messages (+ count_tokens), /v1/responses,
/v1/models, /health, /metrics; /v1/embeddings, /tokenize and /detokenize (handled in embeddings.py and
tokenize.py).

HTTP handlers only check requests, queue them on the engine and relay its events (server-sent events for
``stream: true``: ``data: {json}\\n\\n`` ... ``data: [DONE]``). A watcher on each request's ASGI channel
cancels its sequence as soon as the client disconnects.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import traceback
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from streamattn.serve.anthropic import MessagesAPI
from streamattn.serve.config import ServeConfig
from streamattn.serve.embeddings import Embedder, embeddings_route
from streamattn.serve.tokenize import detokenize_route, tokenize_route
from streamattn.engine.core import Engine
from streamattn.serve.metrics import Metrics
from streamattn.serve.protocol import APIError, Reply, parse
from streamattn.serve.relay import parsed, read_body, submit, total_usage
from streamattn.serve.responses import ResponsesAPI


class ServerState:
    """What the routes share: the config, the model once loaded, the engine, the metrics."""

    def __init__(self, config: ServeConfig):
        self.cfg = config
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.embedder: Embedder | None = None     # /v1/embeddings' own thread
        self.tok = None
        self.grammars = None                     # the tokenizer's grammar compiler and cache
        self.model_id = config.model_id
        self.context = 0
        self.load_error: str | None = None
        self.ready = threading.Event()

    def load(self) -> None:
        """Load the model and start the engine (runs in a thread; /health is 503 until it is done)."""
        try:
            from streamattn.gguf.hub import resolve_model
            from streamattn.engine.options import file_weights
            from streamattn.gguf.loader import load_gguf
            from streamattn.text.tokenizer import Tokenizer
            from streamattn.models.transformer import Transformer
            from streamattn.runtime.threads import set_threads

            set_threads(self.cfg.threads)
            path = resolve_model(self.cfg.model, quiet=True)
            t0 = time.perf_counter()
            m = load_gguf(path, weights=file_weights(self.cfg.weights, self.cfg.backend))
            tf = Transformer(m)
            if self.cfg.backend == "gpu":
                import cupy
                tf.to(cupy)
            else:                                 # kernels loaded now, not in the first request's TTFT
                from streamattn.engine.generate import warm_model
                warm_model(tf, self.cfg.cache_dtype)
            self.tok = Tokenizer.from_metadata(m.metadata)
            from streamattn.engine.grammar import Grammars
            self.grammars = Grammars(self.tok)
            self.context = int(m.config.context_length)
            self.model_id = self.model_id or Path(path).stem
            self.engine = Engine(tf, self.tok, self.cfg.engine_config, self.metrics).start()
            self.embedder = Embedder(tf, pooling=self.cfg.pooling, threads=self.cfg.threads,
                                     backend=self.cfg.backend, max_queue=self.cfg.max_queue)
            print(f"streamattn serve: {self.model_id} loaded in {time.perf_counter() - t0:.1f} s; "
                  f"{self.cfg.parallel} slots, cache {self.cfg.cache}", file=sys.stderr, flush=True)
            self.ready.set()
        except Exception as e:                    # reported by /health and every request
            traceback.print_exc()
            self.load_error = f"{type(e).__name__}: {e}"

    def need_ready(self) -> None:
        if not self.ready.is_set():
            msg = (f"the model failed to load: {self.load_error}" if self.load_error
                   else "the model is still loading; retry when GET /health answers 200")
            raise APIError(503, msg, type="server_error", code="model_not_ready")


def build_app(config: ServeConfig) -> FastAPI:
    """The server as an ASGI app; its lifespan loads the model in the background and stops the engine.

    Parameters
    ----------
    config : ServeConfig

    Returns
    -------
    fastapi.FastAPI
        ``app.state.serve`` is the :class:`ServerState` (engine, metrics).

    Examples
    --------
    >>> uvicorn.run(build_app(ServeConfig(parallel=8)), host="127.0.0.1", port=8000)   # doctest: +SKIP
    """
    st = ServerState(config)

    @asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=st.load, name="streamattn-load", daemon=True).start()
        yield
        if st.embedder is not None:
            st.embedder.close()
        if st.engine is not None:
            await asyncio.to_thread(st.engine.stop)

    app = FastAPI(title="streamattn", lifespan=lifespan)
    app.state.serve = st

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        return JSONResponse(APIError(e.status_code, str(e.detail), code=str(e.status_code)).body(),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _bug(request, e):
        traceback.print_exc()
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        if st.ready.is_set():
            return {"status": "ok"}
        return JSONResponse({"status": "error" if st.load_error else "loading", "error": st.load_error},
                            status_code=503)

    @app.get("/v1/models")
    async def models():
        st.need_ready()
        return {"object": "list", "data": [{"id": st.model_id, "object": "model", "created": 0,
                                            "owned_by": "streamattn", "context_length": st.context}]}

    @app.get("/metrics")
    async def metrics():
        return Response(st.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _complete(st, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(st, request, "text")

    messages_api = MessagesAPI(st)                  # Anthropic's Messages API (serve/anthropic.py)
    app.post("/v1/messages")(messages_api.create)
    app.post("/v1/messages/count_tokens")(messages_api.count_tokens)
    responses_api = ResponsesAPI(st)                # OpenAI's Responses API (serve/responses.py)
    app.post("/v1/responses")(responses_api.create)

    def limit() -> int:
        return int(st.cfg.max_body_mb * (1 << 20))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await embeddings_route(st, request, await read_body(request, limit()))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokenize_route(st, await read_body(request, limit()))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await detokenize_route(st, await read_body(request, limit()))

    return app


async def _complete(st: ServerState, request: Request, kind: str):
    job, meta = await parsed(st, request, partial(
        parse, kind=kind, model_id=st.model_id, tok=st.tok, context=st.context, fail_text=st.cfg.debug_fail_text,
        speculative=st.cfg.spec_params, grammars=st.grammars))
    run = submit(st, request, job, meta)
    reply = Reply(meta, st.tok)
    if meta["stream"]:
        return StreamingResponse(_sse(run, reply, meta), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        choices = await run.whole()
        return reply.whole([(c.text, c.logprobs, c.finish, c.calls, c.reasoning) for c in choices],
                           total_usage([c.usage for c in choices]))
    finally:
        run.close()


async def _sse(run, reply: Reply, meta: dict):
    """The event stream of one request's choices (``relay.Run.pieces``): reasoning goes in
    ``delta.reasoning_content``; a tool call in ``delta.tool_calls``, first its id and name, then its
    arguments in fragments as they are generated."""
    def data(obj) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    usages = [None] * meta["n"]
    try:
        if reply.kind == "chat":
            for i in range(meta["n"]):
                yield data(reply.chunk(first=True, index=i))
        async for p in run.pieces():
            if p.kind == "text":
                yield data(reply.chunk(p.text, p.logprobs, index=p.index))
            elif p.kind == "reasoning":
                yield data(reply.chunk(index=p.index, reasoning=p.text))
            elif p.kind == "call":
                c = p.call
                yield data(reply.chunk(index=p.index, tool_call={"index": c["index"], "id": c["id"], "type": "function",
                                                                 "function": {"name": c["name"], "arguments": ""}}))
            elif p.kind == "args":
                yield data(reply.chunk(index=p.index, tool_call={"index": p.call["index"],
                                                                 "function": {"arguments": p.text}}))
            elif p.kind == "calls":                  # every call was streamed by its "call" and "args" pieces
                continue
            elif p.kind == "error":
                yield data(p.error.body())
                return
            else:
                yield data(reply.chunk(finish=p.finish, index=p.index))
                usages[p.index] = p.usage
        if meta["include_usage"]:
            yield data(reply.usage_chunk(total_usage(usages)))
        yield "data: [DONE]\n\n"
    finally:
        run.close()
