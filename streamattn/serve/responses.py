"""OpenAI's Responses API: ``POST /v1/responses``.

A request is checked against the API's own shapes (unknown fields and item types are 400s naming them),
translated into the chat request's form and run by the one engine path (``serve/relay.py``); its output
is written back as a Response object, or as the Responses event stream. Errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}`` in this API's field names.

==============================  ====================================================================
Responses                       chat request
==============================  ====================================================================
``instructions``                a first system message (not carried over by ``previous_response_id``)
``input`` (a string)            one user message
``message`` items               messages (``input_text`` / ``output_text`` parts as text parts)
``function_call`` items         the assistant message's ``tool_calls`` (consecutive calls: one message)
``function_call_output`` items  ``tool`` messages
``reasoning`` items             dropped (the templates drop earlier reasoning too)
``reasoning.effort``            ``reasoning_effort``, where the template reads it (else 400)
``tools`` (function tools)      function tools; ``tool_choice`` the same choices
``text.format``                 ``response_format`` (``json_schema``, ``json_object``, ``text``)
``max_output_tokens``           ``max_tokens``
``previous_response_id``        that response's conversation, input and output, before ``input``
==============================  ====================================================================

The reply's think block comes back as a ``reasoning`` output item (its text in ``content``, as
``reasoning_text``; no summary), streamed as ``response.reasoning_text.delta`` events, before the message
and the function calls.

``previous_response_id`` is served from :class:`ResponseStore`, in this process's memory: the last
``MAX_STORED`` responses (stored unless ``store`` is false), least recently used first out, and fewer when
their conversations pass ``MAX_STORED_CHARS`` characters in all; an id it does not hold is a 404 naming
the field.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Literal, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from streamattn.serve.protocol import APIError, check, load_body, loads_bounded
from streamattn.serve.relay import parse_chat, parsed, submit

MAX_STORED = 256                    # responses kept for previous_response_id
MAX_STORED_CHARS = 32 << 20         # characters of their conversations, in all


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InputText(_Shape):
    type: Literal["input_text"]
    text: str


class OutputText(_Shape):
    type: Literal["output_text"]
    text: str
    annotations: Optional[list] = None
    logprobs: Optional[list] = None


Part = Annotated[Union[InputText, OutputText], Field(discriminator="type")]


class MessageItem(_Shape):
    type: Literal["message"]
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[Part]] = Field(union_mode="left_to_right")
    id: Optional[str] = None
    status: Optional[str] = None
    phase: Optional[str] = None


class FunctionCallItem(_Shape):
    type: Literal["function_call"]
    call_id: str = Field(max_length=256)
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(_Shape):
    type: Literal["function_call_output"]
    call_id: str = Field(max_length=256)
    output: Union[str, list[InputText]] = Field(union_mode="left_to_right")
    id: Optional[str] = None
    status: Optional[str] = None


class ReasoningItem(_Shape):
    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: Optional[list] = None
    content: Optional[list] = None
    encrypted_content: Optional[str] = None
    status: Optional[str] = None


Item = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem],
                 Field(discriminator="type")]


class FunctionTool(_Shape):
    type: Literal["function"]
    name: str
    parameters: Optional[dict] = None
    description: Optional[str] = None
    strict: Optional[bool] = None                      # the grammar enforces the parameters always


class NamedFunction(_Shape):
    type: Literal["function"]
    name: str


class TextFormat(_Shape):
    type: Literal["text", "json_schema", "json_object"]
    name: Optional[str] = None
    json_schema: Optional[dict] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(_Shape):
    format: Optional[TextFormat] = None


class ResponsesRequest(_Shape):
    model: str
    input: Union[str, list[Item]] = Field(union_mode="left_to_right")
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = \
        Field(None, union_mode="left_to_right")
    parallel_tool_calls: Optional[bool] = None         # several calls per response (native templates)
    text: Optional[TextConfig] = None
    stream: Optional[bool] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    truncation: Optional[Literal["disabled"]] = None
    reasoning: Optional[dict] = None                   # effort only (checked below)
    include: Optional[list[str]] = None                # checked below
    metadata: Optional[dict] = None                    # the rest: accepted, ignored (none changes the output)
    user: Optional[str] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    stream_options: Optional[dict] = None


#: Fields of the API that would change the output and are not honoured: refused by name.
_REFUSED = {
    "background": "background is not supported: answer the request on its connection (stream it if long)",
    "conversation": "conversation is not supported by this server; send previous_response_id or the input",
    "prompt": "prompt (a stored prompt template) is not supported by this server; send instructions and input",
    "context_management": "context_management is not supported: the whole conversation is the prompt",
    "top_logprobs": "top_logprobs is not supported on /v1/responses; use /v1/chat/completions with logprobs",
    "max_tool_calls": "max_tool_calls is not supported: send parallel_tool_calls false for one call at most",
}

#: ``include`` values that change nothing here (reasoning is never encrypted: its text is in the item).
_INCLUDABLE = ("reasoning.encrypted_content",)

#: The chat request's field names in errors, as this API names them.
_NAMES = (
    (r"tools\[(\d+)\]\.function\.parameters", r"tools.\1.parameters"),
    (r"tools\.(\d+)\.function\.(\w+)", r"tools.\1.\2"),
    (r"tool_choice\.function\.name", "tool_choice.name"),
    (r"response_format\.json_schema\.schema", "text.format.schema"),
    (r"response_format\.json_schema\.(\w+)", r"text.format.\1"),
    (r"response_format", "text.format"),
    (r"max_tokens", "max_output_tokens"),
    (r"messages", "input"),
    (r"reasoning_effort", "reasoning.effort"),
)


class ResponseStore:
    """The conversations of recent responses (chat messages: input and output, without instructions),
    by response id: at most ``max_items``, and at most ``max_chars`` characters of JSON in all; the least
    recently used (stored or read) leave first. Thread-safe."""

    def __init__(self, max_items: int = MAX_STORED, max_chars: int = MAX_STORED_CHARS):
        self.max_items, self.max_chars = max_items, max_chars
        self._items: OrderedDict = OrderedDict()         # id -> (messages, chars)
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, rid: str, messages: list) -> None:
        chars = len(json.dumps(messages))
        with self._lock:
            if chars > self.max_chars:
                return
            self._items[rid] = (messages, chars)
            self._chars += chars
            while len(self._items) > self.max_items or self._chars > self.max_chars:
                _, (_, c) = self._items.popitem(last=False)
                self._chars -= c

    def get(self, rid: str) -> list | None:
        with self._lock:
            if rid not in self._items:
                return None
            self._items.move_to_end(rid)
            return self._items[rid][0]

    def __len__(self) -> int:
        return len(self._items)


def _check(obj: dict) -> ResponsesRequest:
    for name, why in _REFUSED.items():
        if obj.get(name) is not None:
            raise APIError(400, why, param=name, code="unsupported_value")
    items = obj.get("input")
    if isinstance(items, list):                        # a message item may leave out its type
        for it in items:
            if isinstance(it, dict) and "type" not in it and "role" in it:
                it["type"] = "message"
    if obj.get("truncation") == "auto":
        raise APIError(400, "truncation 'auto' is not supported: an input too long for the context is a 400 "
                       "here, never cut; send 'disabled' or leave it out", param="truncation",
                       code="unsupported_value")
    req = check(ResponsesRequest, obj)
    for k, v in (req.reasoning or {}).items():
        if k == "effort" and (v is None or isinstance(v, str)):
            continue
        if v is not None:
            raise APIError(400, f"reasoning.{k[:40]}: {json.dumps(v)[:80]} is not supported (no reasoning summaries "
                           "here; only reasoning.effort, for templates that read it)", param=f"reasoning.{k[:40]}",
                           code="unsupported_value")
    for i, name in enumerate(req.include or ()):
        if name not in _INCLUDABLE:
            raise APIError(400, f"include.{i}: {name!r} is not supported (only {', '.join(_INCLUDABLE)})",
                           param=f"include.{i}", code="unsupported_value")
    return req


def _text(content) -> list:
    """A string or text parts as chat content parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": p.text} for p in content]


def input_messages(req: ResponsesRequest) -> list:
    """The request's ``input`` as chat messages (the module's table)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    msgs = []
    for i, it in enumerate(req.input):
        if it.type == "message":
            msgs.append({"role": it.role, "content": _text(it.content)})
        elif it.type == "function_call":
            loads_bounded(it.arguments, f"input.{i}.arguments")        # JSON text, within the body's bounds
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif it.type == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": it.call_id, "content": _text(it.output)})
    return msgs


def to_chat(req: ResponsesRequest, history: list) -> dict:
    """The chat request that asks the model what ``req`` asks, after the conversation ``history``."""
    msgs = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    chat = {"model": req.model, "messages": msgs}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in (
            ("name", t.name), ("description", t.description), ("parameters", t.parameters)) if v is not None}}
            for t in req.tools]
    if req.tool_choice is not None:
        c = req.tool_choice
        chat["tool_choice"] = c if isinstance(c, str) else {"type": "function", "function": {"name": c.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        if fmt.type == "json_schema":
            spec = {k: v for k, v in (("name", fmt.name), ("schema", fmt.json_schema), ("strict", fmt.strict),
                                      ("description", fmt.description)) if v is not None}
            chat["response_format"] = {"type": "json_schema", "json_schema": spec}
        else:
            chat["response_format"] = {"type": fmt.type}
    if (req.reasoning or {}).get("effort") is not None:
        chat["reasoning_effort"] = req.reasoning["effort"]
    if req.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = req.parallel_tool_calls
    chat.update({k: v for k, v in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                                   ("top_p", req.top_p), ("stream", req.stream)) if v is not None})
    return chat


class ResponsesAPI:
    """The route of the Responses API on the server state ``st`` (``app.ServerState``), with the store of
    its recent responses."""

    def __init__(self, st):
        self.st = st
        self.store = ResponseStore()

    def parse(self, body: bytes) -> tuple:
        """(Job, meta, request, conversation so far) of a body; APIError in this API's field names."""
        req = _check(load_body(body))
        history = []
        if req.previous_response_id is not None:
            history = self.store.get(req.previous_response_id)
            if history is None:
                raise APIError(404, f"previous_response_id {req.previous_response_id[:80]!r}: no such response in "
                               f"this server's store (it keeps the last {self.store.max_items} stored responses, "
                               "in memory; store: false ones never)", param="previous_response_id",
                               code="previous_response_not_found")
        history = list(history) + input_messages(req)
        try:
            job, meta = parse_chat(self.st, to_chat(req, history))
        except APIError as e:
            raise e.renamed(_NAMES) from None
        return job, meta, req, history

    async def create(self, request: Request):
        """A Response object, or its event stream with ``"stream": true``."""
        try:
            job, meta, req, history = await parsed(self.st, request, self.parse)
            run = submit(self.st, request, job, meta)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        out = _Reply(req, self, history)
        if meta["stream"]:
            return StreamingResponse(out.events(run), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            choice = (await run.whole())[0]
        except APIError as e:
            e = e.renamed(_NAMES)
            return JSONResponse(e.body(), status_code=e.status)
        finally:
            run.close()
        status = "incomplete" if choice.finish == "length" else "completed"
        thought = status if not (choice.text or choice.calls) else "completed"    # cut short while reasoning?
        items = ([out.reasoning_item(choice.reasoning, thought)] if choice.reasoning else []) + \
            ([out.message_item(choice.text, status)] if choice.text or not choice.calls else []) + \
            [out.call_item(c) for c in choice.calls or ()]
        return out.finished(items, choice.finish, choice.usage)


class _Reply:
    """The bodies of one response: the Response object at each stage, its output items, its events."""

    def __init__(self, req: ResponsesRequest, api: ResponsesAPI, history: list):
        self.req, self.api, self.history = req, api, history
        self.id, self.created = "resp_" + uuid.uuid4().hex[:24], int(time.time())
        self.msg_id = "msg_" + uuid.uuid4().hex[:24]
        self.rs_id = "rs_" + uuid.uuid4().hex[:24]

    def response(self, status: str, output: list, usage: dict | None = None) -> dict:
        r = self.req
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else \
            {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "model": r.model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": (r.reasoning or {}).get("effort"), "summary": None},
            "store": r.store is not False, "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": fmt},
            "tool_choice": r.tool_choice.model_dump() if isinstance(r.tool_choice, NamedFunction) else
            r.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
            "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled", "usage": usage,
            "user": r.user, "metadata": r.metadata or {}}

    def message_item(self, text: str, status: str) -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] \
            if status != "in_progress" else []
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    def reasoning_item(self, text: str, status: str) -> dict:
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {"type": "reasoning", "id": self.rs_id, "summary": [], "content": content, "status": status}

    @staticmethod
    def call_item(call: dict, status: str = "completed") -> dict:
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}

    def finished(self, items: list, finish: str, usage: dict) -> dict:
        """The final Response object; the conversation is stored unless ``store`` is false."""
        if self.req.store is not False:
            calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"],
                                                                          "arguments": it["arguments"]}}
                     for it in items if it["type"] == "function_call" and it["status"] == "completed"]
            said = {"role": "assistant", "content": "".join(p["text"] for it in items if it["type"] == "message"
                                                             for p in it["content"])}
            thought = "".join(p["text"] for it in items if it["type"] == "reasoning" for p in it["content"])
            if thought:
                said["reasoning_content"] = thought
            self.api.store.put(self.id, self.history + [{**said, "tool_calls": calls} if calls else said])
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        thought = usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
        u = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
             "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": thought},
             "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}
        return self.response("incomplete" if finish == "length" else "completed", items, u)

    async def events(self, run):
        """response.created, response.in_progress, then each output item (added, its content or arguments
        deltas and done events, done), then response.completed (response.incomplete when it ran out of
        max_output_tokens); a failure mid-way is an ``error`` event."""
        seq = 0

        def event(kind: str, **fields) -> str:
            nonlocal seq
            obj = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n"

        items, text = [], None                         # text: the open message's text so far, or None
        thought = None                                 # the open reasoning item's text so far, or None
        call = None                                    # the open function call: [entry, arguments so far]

        def close_call(status="completed"):
            entry, args = call
            k, item = len(items), self.call_item({"id": entry["id"], "function": {"name": entry["name"],
                                                                                 "arguments": args}}, status)
            items.append(item)
            return [event("response.function_call_arguments.done", output_index=k, item_id=item["id"],
                          name=item["name"], arguments=args),
                    event("response.output_item.done", output_index=k, item=item)]

        def close_thought(status):
            item = self.reasoning_item(thought, status)
            k = len(items)
            items.append(item)
            return [event("response.reasoning_text.done", output_index=k, item_id=self.rs_id, content_index=0,
                          text=thought),
                    event("response.output_item.done", output_index=k, item=item)]
        ids = dict(item_id=self.msg_id, content_index=0)

        def close_text(status="completed"):
            item = self.message_item(text, status)
            part = item["content"][0]
            k = len(items)
            items.append(item)
            return [event("response.output_text.done", output_index=k, **ids, text=text, logprobs=[]),
                    event("response.content_part.done", output_index=k, **ids, part=part),
                    event("response.output_item.done", output_index=k, item=item)]

        def open_text():
            k = len(items)
            return [event("response.output_item.added", output_index=k, item=self.message_item("", "in_progress")),
                    event("response.content_part.added", output_index=k, **ids,
                          part={"type": "output_text", "text": "", "annotations": []})]

        try:
            yield event("response.created", response=self.response("in_progress", []))
            yield event("response.in_progress", response=self.response("in_progress", []))
            async for p in run.pieces():
                if p.kind == "reasoning" and p.text:
                    if thought is None:
                        thought = ""
                        yield event("response.output_item.added", output_index=len(items),
                                    item=self.reasoning_item("", "in_progress"))
                    thought += p.text
                    yield event("response.reasoning_text.delta", output_index=len(items), item_id=self.rs_id,
                                content_index=0, delta=p.text)
                    continue
                if thought is not None and p.kind in ("text", "call", "calls", "done"):
                    for e in close_thought("incomplete" if p.kind == "done" and p.finish == "length" else
                                           "completed"):
                        yield e
                    thought = None
                if p.kind == "text" and p.text:
                    if text is None:
                        for e in open_text():
                            yield e
                        text = ""
                    text += p.text
                    yield event("response.output_text.delta", output_index=len(items), **ids, delta=p.text,
                                logprobs=[])
                elif p.kind == "call":
                    if text is not None:
                        for e in close_text():
                            yield e
                        text = None
                    if call is not None:
                        for e in close_call():
                            yield e
                    call = [p.call, ""]
                    c = {"id": p.call["id"], "function": {"name": p.call["name"], "arguments": ""}}
                    yield event("response.output_item.added", output_index=len(items),
                                item=self.call_item(c, "in_progress"))
                elif p.kind == "args" and p.text:
                    call[1] += p.text
                    yield event("response.function_call_arguments.delta", output_index=len(items),
                                item_id="fc_" + call[0]["id"].removeprefix("call_"), delta=p.text)
                elif p.kind == "calls":
                    if call is not None:
                        for e in close_call():
                            yield e
                    call = None
                elif p.kind == "error":
                    e = p.error.renamed(_NAMES)
                    yield event("error", code=e.code, message=e.message, param=e.param)
                    return
                elif p.kind == "done":
                    if call is not None:                 # a call cut short by max_output_tokens
                        for e in close_call("incomplete"):
                            yield e
                        call = None
                    if text is None and not any(it["type"] != "reasoning" for it in items):   # nothing said
                        for e in open_text():
                            yield e
                        text = ""
                    if text is not None:
                        for e in close_text("incomplete" if p.finish == "length" else "completed"):
                            yield e
                    final = self.finished(items, p.finish, p.usage)
                    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                                response=final)
        finally:
            run.close()
