"""FastAPI app: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

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
from dataclasses import replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from streamattn.serve.config import ServeConfig
from streamattn.engine.core import Engine, QueueFull
from streamattn.serve.metrics import Metrics
from streamattn.serve.protocol import APIError, Reply, parse
from streamattn.serve.structured import tool_calls
from streamattn.engine.sequence import Sequence


class ServerState:
    """What the routes share: the config, the model once loaded, the engine, the metrics."""

    def __init__(self, config: ServeConfig):
        self.cfg = config
        self.metrics = Metrics()
        self.engine: Engine | None = None
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
            from streamattn.gguf.loader import load_gguf
            from streamattn.text.tokenizer import Tokenizer
            from streamattn.models.transformer import Transformer
            from streamattn.threads import set_threads

            set_threads(self.cfg.threads)
            path = resolve_model(self.cfg.model, quiet=True)
            t0 = time.perf_counter()
            m = load_gguf(path, weights=self.cfg.weights)
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

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to pass ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; this server accepts at most {limit}",
                       code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over {limit} bytes; this server accepts at most {limit}",
                           code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _complete(st: ServerState, request: Request, kind: str):
    body = await _read_body(request, int(st.cfg.max_body_mb * (1 << 20)))
    st.need_ready()
    # parsing tokenizes the prompt, renders the chat template and compiles grammars: off the event loop,
    # so that other clients (and /health) are answered meanwhile; each step is bounded (protocol.py,
    # chat_template.py)
    job, meta = await asyncio.to_thread(parse, body, kind, model_id=st.model_id, tok=st.tok, context=st.context,
                                        fail_text=st.cfg.debug_fail_text, speculative=st.cfg.spec_params,
                                        grammars=st.grammars)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emitter(i: int):
        def emit(ev):                                # engine thread -> this request's event loop
            try:
                loop.call_soon_threadsafe(events.put_nowait, (i, ev))
            except RuntimeError:                     # the loop is closed: nobody listens any more
                pass
        return emit

    seqs = []
    for i in range(meta["n"]):                       # choice i samples with seed + i; later choices fork
        seed = job.sampling.seed
        j = job if i == 0 or seed is None else replace(job, sampling=replace(job.sampling, seed=seed + i))
        seqs.append(Sequence(job=j, emit=emitter(i), tok=st.tok, leader=seqs[0] if i else None))
    try:
        for s in seqs:
            st.engine.submit(s)
    except QueueFull as e:
        for s in seqs:
            st.engine.cancel(s)
        raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded") from None
    reply = Reply(meta, st.tok)
    watcher = asyncio.create_task(_watch_disconnect(request, st.engine, seqs))
    if meta["stream"]:
        return StreamingResponse(_sse(st, seqs, reply, events, watcher, meta),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        n = len(seqs)
        text, lps, done = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        while None in done:
            i, ev = await events.get()
            if ev.kind == "delta":
                text[i].append(ev.text)
                lps[i].extend(ev.logprobs)
            elif ev.kind == "error":
                raise _engine_error(ev)
            else:
                done[i] = ev
        choices = []
        for i in range(n):
            t = "".join(text[i])
            choices.append((t, tuple(lps[i]), done[i].finish, tool_calls(t, meta["calls"])))
        return reply.whole(choices, _usage([ev.usage for ev in done]))
    finally:
        watcher.cancel()
        for s in seqs:
            st.engine.cancel(s)                       # a no-op once finished


def _engine_error(ev) -> APIError:
    """A sequence's error event as an API error: the request's own grammar that could not go on is the
    client's (400, one line); anything else is the server's (500)."""
    if ev.code == "grammar":
        return APIError(400, ev.message, param="response_format", code="grammar_error")
    return APIError(500, ev.message, type="server_error", code="engine_error")


def _usage(usages: list) -> dict:
    """One request's usage over its choices: the prompt once, every choice's completion tokens."""
    u = dict(usages[0])
    c = sum(x["completion_tokens"] for x in usages)
    u.update(completion_tokens=c, total_tokens=u["prompt_tokens"] + c)
    if "completion_tokens_details" in u:
        u["completion_tokens_details"] = {k: sum(x["completion_tokens_details"][k] for x in usages)
                                          for k in u["completion_tokens_details"]}
    return u


async def _sse(st, seqs, reply: Reply, events, watcher, meta: dict):
    """The event stream of one request's choices. A choice that is (or, with tool_choice "auto", turns
    out to be) a tool call is held until it ends and sent as one ``delta.tool_calls`` chunk."""
    def data(obj) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    n, calls = len(seqs), meta["calls"]
    held = [calls == "call"] * n                      # this choice's text is held back (a call)
    text, usages, left = [""] * n, [None] * n, n
    try:
        if reply.kind == "chat":
            for i in range(n):
                yield data(reply.chunk(first=True, index=i))
        while left:
            i, ev = await events.get()
            if ev.kind == "delta":
                before = text[i]
                text[i] += ev.text
                if calls == "auto" and not before.strip() and text[i].strip():
                    held[i] = text[i].lstrip().startswith("{")     # its first character decides
                    if not held[i]:
                        yield data(reply.chunk(text[i], ev.logprobs, index=i))
                        continue
                if not held[i] and (ev.text or ev.logprobs) and (calls != "auto" or text[i].strip()):
                    yield data(reply.chunk(ev.text, ev.logprobs, index=i))
            elif ev.kind == "error":
                yield data(_engine_error(ev).body())
                return
            else:
                found = tool_calls(text[i], calls)
                if found:
                    yield data(reply.chunk(index=i, tool_calls=found))
                elif held[i] or (calls == "auto" and not text[i].strip()):
                    yield data(reply.chunk(text[i], index=i))      # not a call after all: its text
                yield data(reply.chunk(finish="tool_calls" if found else ev.finish, index=i))
                usages[i], left = ev.usage, left - 1
        if meta["include_usage"]:
            yield data(reply.usage_chunk(_usage(usages)))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        for s in seqs:
            st.engine.cancel(s)


async def _watch_disconnect(request: Request, engine: Engine, seqs: list) -> None:
    """Cancel the request's sequences the moment the client's connection closes."""
    while not all(s.finished for s in seqs):
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            for s in seqs:
                engine.cancel(s)
            return
