"""Between the routes and the engine: read a request body, queue a parsed request's choices on the engine,
and turn the engine's events into output pieces that each API (chat and text completions, Anthropic
messages, responses) writes in its own shape.

Every API runs this one path: its module translates a request into the chat request's form
(``protocol.parse_request``), :func:`submit` queues it, and :meth:`Run.pieces` (streamed) or
:meth:`Run.whole` give what the model produced:

===============  ==========================================================================
``"reasoning"``  the reply's reasoning (its think block's text) the client may see now: ``text``
``"text"``       content the client may see now (``text``, ``logprobs``)
``"call"``       a tool call begins: ``call`` {"index", "id", "name"} (its index among the reply's calls)
``"args"``       the next stretch of a call's arguments (JSON text): ``text``, ``call`` {"index"}
``"calls"``      the choice made tool calls: ``calls``, OpenAI ``tool_calls`` entries, when it ends (each
                 announced by "call", its arguments the join of its "args" pieces)
``"done"``       the choice ended: ``finish`` ("stop", "length", "tool_calls"), ``stop``, ``usage``
``"error"``      the request failed: ``error``, an APIError; nothing follows
===============  ==========================================================================

Each choice's text goes through an ``output.Reader`` of ``meta["read"]``: reasoning is never content, and a
call is streamed once its name is known, its arguments as they are generated (the grammar,
``serve/structured.py``, makes their syntax certain, so no fragment is ever taken back).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from streamattn.engine.core import QueueFull
from streamattn.engine.sequence import Sequence
from streamattn.serve.protocol import APIError, parse_request
from streamattn.serve.output import Reader, read_whole
from streamattn.serve.think_block import reasoning_tokens


@dataclass(frozen=True)
class Piece:
    """One output event of choice ``index`` (the kinds are in the module's table)."""

    kind: str                                        # "reasoning" | "text" | "call" | "args" | "calls" | ...
    index: int = 0
    text: str = ""
    logprobs: tuple = ()
    calls: list | None = None
    call: dict | None = None
    finish: str | None = None
    stop: str | None = None
    usage: dict | None = None
    error: APIError | None = None


@dataclass(frozen=True)
class Choice:
    """One finished choice of a request answered whole; ``finish`` is the engine's ("stop", "length"),
    ``text`` its content, ``calls`` the tool calls it made (None: none), ``reasoning`` its think block's
    text."""

    text: str
    logprobs: tuple
    finish: str
    calls: list | None
    stop: str | None
    usage: dict
    reasoning: str = ""


async def read_body(request, limit: int) -> bytes:
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


async def parsed(st, request, parse_body) -> tuple:
    """(Job, meta) of the request: its body read within the server's limit, then ``parse_body(body)``
    run off the event loop (it tokenizes the prompt, renders the chat template and compiles grammars,
    each step bounded), so that other clients and /health are answered meanwhile."""
    body = await read_body(request, int(st.cfg.max_body_mb * (1 << 20)))
    st.need_ready()
    return await asyncio.to_thread(parse_body, body)


def parse_chat(st, obj: dict) -> tuple:
    """(Job, meta) of a chat request object (``protocol.parse_request``) for the server ``st``: the form
    every API's request is translated into."""
    return parse_request(obj, "chat", model_id=st.model_id, tok=st.tok, context=st.context,
                         fail_text=st.cfg.debug_fail_text, speculative=st.cfg.spec_params, grammars=st.grammars)


def submit(st, request, job, meta: dict) -> "Run":
    """Queue ``meta["n"]`` choices of ``job`` on the server's engine (choice i samples with seed + i and
    forks the first one's prompt); APIError 429 when the queue is full. Close the Run when done."""
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
    for i in range(meta["n"]):
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
    watcher = asyncio.create_task(_watch_disconnect(request, st.engine, seqs))
    return Run(engine=st.engine, seqs=seqs, events=events, watcher=watcher, read=meta["read"], tok=st.tok)


@dataclass
class Run:
    """One request's sequences on the engine, the queue of their events, and the task that cancels them
    when the client disconnects."""

    engine: object
    seqs: list
    events: asyncio.Queue
    watcher: asyncio.Task
    read: object                                     # output.ReadSpec: how to read each reply
    tok: object = None                               # the tokenizer: reasoning tokens are counted with it

    def usage(self, ev) -> dict:
        """A done event's usage; where the reply may reason, with ``completion_tokens_details.
        reasoning_tokens`` (``think_block.reasoning_tokens``)."""
        if self.read.think == "none" or self.tok is None:
            return ev.usage
        details = {**(ev.usage.get("completion_tokens_details") or {}),
                   "reasoning_tokens": reasoning_tokens(self.tok, self.read, ev.tokens)}
        return {**ev.usage, "completion_tokens_details": details}

    async def pieces(self):
        """The request's output as :class:`Piece` s, until every choice is done or one fails."""
        n = len(self.seqs)
        readers = [Reader(self.read) for _ in range(n)]
        lps, left = [()] * n, n                      # logprobs not yet sent with content
        while left:
            i, ev = await self.events.get()
            if ev.kind == "delta":
                lps[i] += ev.logprobs
                for p in self._pieces(i, readers[i].push(ev.text), lps):
                    yield p
            elif ev.kind == "error":
                yield Piece("error", i, error=engine_error(ev))
                return
            else:
                more, calls = readers[i].end()
                for p in self._pieces(i, more, lps):
                    yield p
                if lps[i]:
                    yield Piece("text", i, "", lps[i])
                if calls:
                    yield Piece("calls", i, calls=calls)
                yield Piece("done", i, finish="tool_calls" if calls else ev.finish, stop=ev.stop, usage=self.usage(ev))
                left -= 1

    @staticmethod
    def _pieces(i: int, parts: list, lps: list) -> list:
        out = []
        for kind, value in parts:
            if kind == "text":
                out.append(Piece("text", i, value, lps[i]))
                lps[i] = ()
            elif kind == "call":
                out.append(Piece("call", i, call=value))
            elif kind == "args":
                out.append(Piece("args", i, value[1], call={"index": value[0]}))
            else:
                out.append(Piece("reasoning", i, value))
        return out

    async def whole(self) -> list:
        """Every choice's :class:`Choice`, once all are done; an engine error raises its APIError."""
        n = len(self.seqs)
        text, lps, done = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
        while None in done:
            i, ev = await self.events.get()
            if ev.kind == "delta":
                text[i].append(ev.text)
                lps[i].extend(ev.logprobs)
            elif ev.kind == "error":
                raise engine_error(ev)
            else:
                done[i] = ev
        out = []
        for i, ev in enumerate(done):
            reasoning, content, calls = read_whole("".join(text[i]), self.read)
            out.append(Choice(text=content, logprobs=tuple(lps[i]), finish=ev.finish, calls=calls, stop=ev.stop,
                              usage=self.usage(ev), reasoning=reasoning))
        return out

    def close(self) -> None:
        """Stop watching the connection and cancel every sequence (a no-op for finished ones)."""
        self.watcher.cancel()
        for s in self.seqs:
            self.engine.cancel(s)


def engine_error(ev) -> APIError:
    """A sequence's error event as an API error: the request's own grammar that could not go on is the
    client's (400, one line); anything else is the server's (500)."""
    if ev.code == "grammar":
        return APIError(400, ev.message, param="response_format", code="grammar_error")
    return APIError(500, ev.message, type="server_error", code="engine_error")


def total_usage(usages: list) -> dict:
    """One request's usage over its choices: the prompt once, every choice's completion tokens."""
    u = dict(usages[0])
    c = sum(x["completion_tokens"] for x in usages)
    u.update(completion_tokens=c, total_tokens=u["prompt_tokens"] + c)
    if "completion_tokens_details" in u:
        u["completion_tokens_details"] = {k: sum(x["completion_tokens_details"][k] for x in usages)
                                          for k in u["completion_tokens_details"]}
    return u


async def _watch_disconnect(request, engine, seqs: list) -> None:
    """Cancel the request's sequences the moment the client's connection closes."""
    while not all(s.finished for s in seqs):
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            for s in seqs:
                engine.cancel(s)
            return
