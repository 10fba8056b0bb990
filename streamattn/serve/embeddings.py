"""POST /v1/embeddings in OpenAI's shape: each input's final hidden states, pooled and L2-normalized.

Request: ``model``; ``input`` a string, a list of strings, a list of token ids, or a list of such lists
(one embedding each, in order); ``encoding_format`` "float" (default) or "base64" (the little-endian
float32 bytes, as OpenAI sends them); ``dimensions`` only where it is the model's width (an embedding is
not shortened: 400 otherwise); ``user`` accepted and ignored. Response::

    {"object": "list", "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n},
     "data": [{"object": "embedding", "index": i, "embedding": [...] or "base64..."}, ...]}

An embedding is :meth:`Transformer.hidden_states <streamattn.models.transformer.Transformer.hidden_states>`
(after the final norm, before the output head) pooled over the input's tokens, by the server's
``pooling`` (``--pooling``, as llama-server's): "mean" of every row, or the "last" row, then divided by
its L2 norm. Strings are tokenized as llama-server does for embeddings: with the file's BOS/EOS
(``Tokenizer.encode``'s defaults); token-id inputs are used as given.

Bounds, each a 400 naming the field: at most ``MAX_INPUTS`` inputs and ``MAX_TOTAL_TOKENS`` tokens in all
(OpenAI's own limits, its API reference for embeddings), none empty, none longer than the model's context
(``input.<index>``, code ``context_length_exceeded``), ids in the vocabulary. More than ``max_queue``
requests waiting for the embedding thread answer 429.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator

from streamattn.runtime.arrays import to_host
from streamattn.serve.config import POOLINGS
from streamattn.serve.protocol import APIError, load_request
from streamattn.text.tokenizer import TooLong

MAX_INPUTS = 2048               # inputs per request (OpenAI's limit)
MAX_TOTAL_TOKENS = 300_000      # tokens per request over all inputs (OpenAI's limit)
CHUNK = 128                     # tokens per call of the layers (the result: the same but for rounding)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)        # as protocol.py's schemas


class EmbeddingRequest(_Request):
    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None

    @field_validator("input", mode="before")
    @classmethod
    def _count(cls, v):                     # before the union: its members' errors would name an item
        if isinstance(v, list) and not 1 <= len(v) <= MAX_INPUTS:
            raise ValueError(f"a list of 1..{MAX_INPUTS} inputs (strings or token-id lists) or of token ids is "
                             f"expected (got {len(v)} items)")
        return v


def pool(hidden, how: str) -> np.ndarray:
    """One embedding of hidden states [T, d]: their mean ("mean") or last row ("last"), divided by its L2
    norm (a zero vector stays zero); float32 [d]."""
    v = hidden.mean(0, dtype=np.float64) if how == "mean" else hidden[-1].astype(np.float64)      # [d]
    n = np.linalg.norm(v)
    return (v / n if n > 0 else v).astype(np.float32)


class Cancelled(Exception):
    """The request was abandoned (its client left, or the server stops) before its embeddings were done."""


class Embedder:
    """The served model's embeddings, computed on one thread of their own beside the engine's.

    Each input runs on caches made for it (``Transformer.hidden_states``), so the engine's caches and
    slots are never touched; the model's weights are only read. One thread: requests take turns, and at
    most one input's caches exist at a time (docs/DESIGN.md §25).

    Parameters
    ----------
    model : Transformer
    pooling : {"mean", "last"}
    threads : int
        Numba / BLAS threads of the embedding thread (the server's ``threads``).
    backend : str
        Attention backend, as the engine's.
    max_queue : int
        Requests that may wait for the thread while one runs; one more is answered 429 (:meth:`submit`).
    """

    def __init__(self, model, *, pooling: str, threads: int, backend: str, max_queue: int):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS} (got {pooling!r})")
        from streamattn.runtime.threads import set_threads
        self.model, self.pooling, self.backend, self.max_queue = model, pooling, backend, max_queue
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamattn-embed",
                                        initializer=set_threads, initargs=(threads,))
        self._waiting = 0                    # requests submitted and not yet finished
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    def embed(self, inputs: list, cancelled: threading.Event | None = None) -> np.ndarray:
        """Embeddings float32 [n, d_model] of ``inputs`` (n lists of token ids), one after another on the
        calling thread; raises :class:`Cancelled` at the next input once ``cancelled`` (or :meth:`close`)
        is set."""
        out = np.empty((len(inputs), self.model.config.d_model), np.float32)
        for k, ids in enumerate(inputs):
            if self.stopping.is_set() or (cancelled is not None and cancelled.is_set()):
                raise Cancelled(f"stopped before input {k} of {len(inputs)}")
            h = self.model.hidden_states(np.asarray(ids, np.int64), chunk=CHUNK, backend=self.backend)
            out[k] = pool(to_host(h, copy=False), self.pooling)
        return out

    async def submit(self, inputs: list, cancelled: threading.Event) -> np.ndarray:
        """:meth:`embed` on the embedding thread, awaited; APIError 429 when ``max_queue`` requests wait."""
        with self._lock:
            if self.stopping.is_set():
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if self._waiting > self.max_queue:
                raise APIError(429, f"the server is busy: {self._waiting - 1} embedding requests already wait "
                               f"beside the one running (max_queue={self.max_queue}); retry later",
                               type="rate_limit_error", code="rate_limit_exceeded")
            self._waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self.embed, inputs, cancelled)
        finally:
            with self._lock:
                self._waiting -= 1

    def close(self) -> None:
        """Stop at the running request's next input; later requests are not run."""
        self.stopping.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


def parse(body: bytes, *, model_id: str, tok, context: int, width: int):
    """Check an /v1/embeddings body: (lists of token ids, one per input, request); APIError 400/404."""
    req = load_request(body, EmbeddingRequest)
    if req.model != model_id:
        raise APIError(404, f"model {req.model!r} does not exist; this server serves {model_id!r}",
                       param="model", code="model_not_found")
    if req.dimensions is not None and req.dimensions != width:
        raise APIError(400, f"dimensions={req.dimensions}: this model's embeddings have {width} dimensions and "
                       "are not shortened; leave dimensions out", param="dimensions", code="unsupported_value")
    one = isinstance(req.input, str) or isinstance(req.input[0], int)
    items = [req.input] if one else req.input

    def name(k: int) -> str:
        return "input" if one else f"input.{k}"

    seqs, total = [], 0
    for k, item in enumerate(items):
        if not item:
            raise APIError(400, f"{name(k)}: an empty input has no embedding; give some text or token ids",
                           param=name(k), code="invalid_value")
        if isinstance(item, str):
            try:
                ids = tok.encode(item, max_tokens=context)
            except TooLong:
                raise APIError(400, f"{name(k)} (input {k}) is longer than this model's context of {context} "
                               f"tokens ({len(item)} characters); shorten or split it", param=name(k),
                               code="context_length_exceeded") from None
        else:
            ids = item
            if len(ids) > context:
                raise APIError(400, f"{name(k)} (input {k}) is {len(ids)} tokens, more than this model's context "
                               f"of {context}; shorten or split it", param=name(k),
                               code="context_length_exceeded")
            bad = next((j for j, i in enumerate(ids) if not 0 <= i < tok.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"{name(k)}.{bad}: token ids must be in 0..{tok.vocab_size - 1} (got "
                               f"{ids[bad]})", param=f"{name(k)}.{bad}", code="invalid_value")
        total += len(ids)
        if total > MAX_TOTAL_TOKENS:
            raise APIError(400, f"input: more than {MAX_TOTAL_TOKENS} tokens in all (reached at input {k}); send "
                           "fewer inputs per request", param="input", code="invalid_value")
        seqs.append(ids)
    return seqs, req


def body_of(vectors: np.ndarray, req, model_id: str, tokens: int) -> dict:
    """The response body for embeddings float32 [n, d] of request ``req`` that held ``tokens`` tokens."""
    def encoded(v):
        if req.encoding_format == "base64":
            return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        return v.tolist()
    return {"object": "list", "model": model_id,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def embeddings_route(st, request, body: bytes) -> dict:
    """/v1/embeddings for the server state ``st`` (its ``embedder``): parsing and tokenizing off the event
    loop, the model on the embedding thread; a client that disconnects stops its request at the next
    input."""
    st.need_ready()
    seqs, req = await asyncio.to_thread(parse, body, model_id=st.model_id, tok=st.tok, context=st.context,
                                        width=st.embedder.model.config.d_model)
    cancelled = threading.Event()
    watcher = asyncio.create_task(_watch_disconnect(request, cancelled))
    try:
        vectors = await st.embedder.submit(seqs, cancelled)
    except Cancelled as e:
        raise APIError(503, f"the embeddings were not finished: {e}", type="server_error",
                       code="cancelled") from None
    finally:
        cancelled.set()                       # also when this handler is cancelled: the thread stops
        watcher.cancel()
    return body_of(vectors, req, st.model_id, sum(map(len, seqs)))


async def _watch_disconnect(request, cancelled: threading.Event) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            cancelled.set()
            return
