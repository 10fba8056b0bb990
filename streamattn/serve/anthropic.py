"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request is checked against the API's own shapes (unknown fields and block types are 400s naming
them), translated into the chat request's form and run by the one engine path (``serve/relay.py``);
its output is written back as a Message, or as Anthropic's event stream. Errors are
``{"type": "error", "error": {"type", "message"}}``, the message naming the field.

=======================  ========================================================================
Anthropic                chat request
=======================  ========================================================================
``system``               a first system message (text blocks joined as the chat's content parts)
``text`` blocks          message content
``tool_use`` blocks      the assistant message's ``tool_calls`` (``input`` as the arguments)
``tool_result`` blocks   ``tool`` messages, before the user message's text
``thinking`` blocks      the assistant message's ``reasoning_content`` (templates that show it)
``tools``                function tools, ``input_schema`` as the parameters
``tool_choice``          ``auto``, ``any`` -> ``required``, ``tool`` -> a named function, ``none``
``stop_sequences``       ``stop``
``output_config.format`` ``response_format`` json_schema
``thinking``             ``chat_template_kwargs.enable_thinking`` where the template reads it;
                         ``enabled`` needs a template with reasoning markers, ``disabled`` one
                         that reads ``enable_thinking`` or has none (else 400); ``budget_tokens``
                         (with ``enabled``) ``thinking_token_budget``: the think block is closed
                         after that many tokens (``serve/think_block.py``)
``output_config.effort`` ``reasoning_effort``, where the template reads it (else 400)
``max_tokens``,          the same (``max_tokens`` required; temperature at most 1)
``temperature``,
``top_p``, ``top_k``
=======================  ========================================================================

The reply's think block comes back as a ``thinking`` block (signature empty) before its text and
``tool_use`` blocks. ``stop_reason``: ``tool_use`` (the output has calls), ``max_tokens``, ``stop_sequence`` (with
``stop_sequence`` the string), else ``end_turn``. ``usage.input_tokens`` counts the prompt tokens that
were not read from the prompt cache, ``cache_read_input_tokens`` those that were.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from streamattn.serve.output import TemplateFacts, template_facts
from streamattn.serve.protocol import MAX_STOP, NAME_PATTERN, APIError, check, load_body
from streamattn.serve.relay import parse_chat, parsed, submit


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextBlock(_Shape):
    type: Literal["text"]
    text: str
    cache_control: Optional[dict] = None               # ignored: the prompt cache is automatic
    citations: Optional[list] = None                   # ignored: no documents to cite


class ToolUseBlock(_Shape):
    type: Literal["tool_use"]
    id: str = Field(max_length=256)
    name: str = Field(pattern=NAME_PATTERN)
    input: dict
    cache_control: Optional[dict] = None


class ToolResultBlock(_Shape):
    type: Literal["tool_result"]
    tool_use_id: str = Field(max_length=256)
    content: Union[str, list[TextBlock], None] = None
    is_error: Optional[bool] = None
    cache_control: Optional[dict] = None


class ThinkingBlock(_Shape):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(_Shape):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]


class InputMessage(_Shape):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[Block]] = Field(union_mode="left_to_right")


class ToolDef(_Shape):
    type: Optional[Literal["custom"]] = None           # Anthropic's server tools (web search, bash) are not run here
    name: str
    input_schema: dict
    description: Optional[str] = None
    strict: Optional[bool] = None                      # the grammar enforces input_schema always
    cache_control: Optional[dict] = None
    eager_input_streaming: Optional[bool] = None       # ignored: a call's input is always streamed as generated


class ToolChoice(_Shape):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None   # parallel_tool_calls false

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is given with type 'tool', and only then")
        return self


class ThinkingConfig(_Shape):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[int] = Field(None, ge=0)    # enforced with "enabled" (serve/think_block.py)
    display: Optional[str] = None


class OutputFormat(_Shape):
    type: Literal["json_schema"]
    json_schema: dict = Field(alias="schema")


class OutputConfig(_Shape):
    format: Optional[OutputFormat] = None
    effort: Optional[str] = None


class CountTokensRequest(_Shape):
    """The body of /v1/messages/count_tokens (and the prompt part of /v1/messages)."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = Field(None, union_mode="left_to_right")
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[OutputConfig] = None
    cache_control: Optional[dict] = None               # ignored


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: Optional[list[str]] = Field(None, max_length=MAX_STOP)
    stream: Optional[bool] = None
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    metadata: Optional[dict] = None                    # the rest: accepted, ignored (none changes the output)
    service_tier: Optional[str] = None
    inference_geo: Optional[str] = None
    speed: Optional[str] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None


#: Fields of the API that would change the output and are not honoured: refused by name.
_REFUSED = {
    "container": "container (code execution) is not supported by this server",
    "mcp_servers": "mcp_servers is not supported by this server (no server-side tools run here)",
    "context_management": "context_management is not supported: the whole history is the prompt",
    "diagnostics": "diagnostics is not supported by this server",
}

#: The chat request's field names in errors, as this API names them.
_NAMES = (
    (r"tools\[(\d+)\]\.function\.parameters", r"tools.\1.input_schema"),
    (r"tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"),
    (r"tools\.(\d+)\.function\.(name|description)", r"tools.\1.\2"),
    (r"tool_choice\.function\.name", "tool_choice.name"),
    (r"response_format\.json_schema\.schema", "output_config.format.schema"),
    (r"response_format", "output_config.format"),
    (r"stop", "stop_sequences"),
    (r"reasoning_effort", "output_config.effort"),
    (r"thinking_token_budget", "thinking.budget_tokens"),
)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def error_body(e: APIError) -> dict:
    """Anthropic's error object for ``e``; its message starts with the field when it names one."""
    msg = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": msg}}


def to_chat(req: CountTokensRequest, facts: TemplateFacts = TemplateFacts()) -> dict:
    """The chat request (protocol.ChatRequest's form) that asks the model what ``req`` asks, for a chat
    template of ``facts`` (``output.template_facts``)."""
    kwargs = {}
    mode = req.thinking.type if req.thinking is not None else None
    switch = "enable_thinking" in facts.reads
    if mode in ("enabled", "adaptive", "between_tools") and facts.think is None:
        raise APIError(400, f"thinking {{'type': {mode!r}}}: this model's chat template has no "
                       "reasoning mode this server can run; omit thinking or send {'type': 'disabled'}",
                       param="thinking", code="unsupported_value")
    if mode == "disabled" and facts.think is not None and not switch:
        raise APIError(400, "thinking {'type': 'disabled'}: this model's chat template always reasons and has "
                       "no switch (enable_thinking) to turn it off; omit thinking", param="thinking",
                       code="unsupported_value")
    if mode is not None and switch:
        kwargs["enable_thinking"] = mode != "disabled"
    effort = req.output_config.effort if req.output_config is not None else None
    msgs = []
    if req.system:
        msgs.append({"role": "system", "content": _parts(req.system)})
    last = len(req.messages) - 1
    for i, m in enumerate(req.messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        where = f"messages.{i}"
        for j, b in enumerate(blocks):
            allowed = {"user": ("text", "tool_result"), "system": ("text",),
                       "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}[m.role]
            if b.type not in allowed:
                raise APIError(400, f"{where}.content.{j}: a {b.type} block cannot be in a {m.role} message "
                               f"(allowed: {', '.join(allowed)})", param=f"{where}.content.{j}.type",
                               code="invalid_value")
        text = _parts([b for b in blocks if b.type == "text"])
        if m.role == "assistant":
            if i == last:
                raise APIError(400, f"{where}: a final assistant message (a prefill) is not supported: the reply "
                               "would not continue it; end with a user message", param=where,
                               code="unsupported_value")
            msg = {"role": "assistant", "content": text}
            thought = "".join(b.thinking for b in blocks if b.type == "thinking")
            if thought:
                msg["reasoning_content"] = thought
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if b.type == "tool_use"]
            msgs.append({**msg, "tool_calls": calls} if calls else msg)
            continue
        for b in blocks:
            if b.type == "tool_result":
                content = _parts(b.content if isinstance(b.content, list) else [TextBlock(type="text",
                                                                                          text=b.content or "")])
                if b.is_error:
                    content = [{"type": "text", "text": "error: "}] + content
                msgs.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        if text or not any(b.type == "tool_result" for b in blocks):
            msgs.append({"role": m.role, "content": text})
    chat = {"model": req.model, "messages": msgs}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in (
            ("name", t.name), ("description", t.description), ("parameters", t.input_schema)) if v is not None}}
            for t in req.tools]
    if req.tool_choice is not None:
        c = req.tool_choice
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) or \
            {"type": "function", "function": {"name": c.name}}
    if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    if mode == "enabled" and req.thinking.budget_tokens is not None:
        chat["thinking_token_budget"] = req.thinking.budget_tokens
    if effort is not None:
        chat["reasoning_effort"] = effort
    if req.output_config is not None and req.output_config.format is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_config.format.json_schema}}
    if isinstance(req, MessagesRequest):
        chat.update({k: v for k, v in (("max_tokens", req.max_tokens), ("temperature", req.temperature),
                                       ("top_p", req.top_p), ("top_k", req.top_k), ("stop", req.stop_sequences),
                                       ("stream", req.stream))
                     if v is not None})
    return chat


def _parts(content) -> list:
    """Text blocks (or a string) as chat content parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": b.text} for b in content]


def parse(st, body: bytes, model: type[CountTokensRequest]) -> tuple:
    """(Job, meta, request) of a body; APIError (in this API's field names) when it is refused."""
    obj = load_body(body)
    for name, why in _REFUSED.items():
        if obj.get(name) is not None:
            raise APIError(400, why, param=name, code="unsupported_value")
    req = check(model, obj)
    try:
        job, meta = parse_chat(st, to_chat(req, template_facts(st.tok)))
    except APIError as e:
        raise e.renamed(_NAMES) from None
    return job, meta, req


class MessagesAPI:
    """The routes of the Messages API on the server state ``st`` (``app.ServerState``)."""

    def __init__(self, st):
        self.st = st

    async def count_tokens(self, request: Request):
        """``{"input_tokens": n}``: the tokens of the prompt the request would run (tools included)."""
        try:
            job, _, _ = await parsed(self.st, request, lambda body: parse(self.st, body, CountTokensRequest))
            return {"input_tokens": len(job.prompt)}
        except APIError as e:
            return JSONResponse(error_body(e), status_code=e.status)

    async def create(self, request: Request):
        """A Message, or its event stream with ``"stream": true``."""
        try:
            job, meta, req = await parsed(self.st, request, lambda body: parse(self.st, body, MessagesRequest))
            run = submit(self.st, request, job, meta)
        except APIError as e:
            return JSONResponse(error_body(e), status_code=e.status)
        out = _Reply(model=req.model, prompt_tokens=len(job.prompt))
        if meta["stream"]:
            return StreamingResponse(out.events(run), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            choice = (await run.whole())[0]
        except APIError as e:
            return JSONResponse(error_body(e.renamed(_NAMES)), status_code=e.status)
        finally:
            run.close()
        blocks = ([{"type": "thinking", "thinking": choice.reasoning, "signature": ""}] if choice.reasoning else []) \
            + ([{"type": "text", "text": choice.text}] if choice.text else []) + _tool_uses(choice.calls or [])
        finish = "tool_calls" if choice.calls else choice.finish
        return {**out.head(), "content": blocks, **out.stopped(finish, choice.stop), "usage": out.usage(choice.usage)}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_uses(calls: list) -> list:
    return [{"type": "tool_use", "id": _tool_use_id(c["id"]), "name": c["function"]["name"],
             "input": json.loads(c["function"]["arguments"])} for c in calls]


class _Reply:
    """The bodies of one Message: its head, how it stopped, its usage, and its event stream."""

    def __init__(self, *, model: str, prompt_tokens: int):
        self.id, self.model, self.prompt_tokens = "msg_" + uuid.uuid4().hex[:24], model, prompt_tokens

    def head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    @staticmethod
    def stopped(finish: str, stop: str | None) -> dict:
        reason = {"tool_calls": "tool_use", "length": "max_tokens"}.get(finish) or \
            ("stop_sequence" if stop is not None else "end_turn")
        return {"stop_reason": reason, "stop_sequence": stop}

    @staticmethod
    def usage(u: dict) -> dict:
        cached = u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    @staticmethod
    def _close(block: int, kind: str | None) -> list:
        """The events that end the open block (a thinking block's empty signature first)."""
        if kind is None:
            return []
        sig = [{"type": "content_block_delta", "index": block, "delta": {"type": "signature_delta", "signature": ""}}]
        return (sig if kind == "thinking" else []) + [{"type": "content_block_stop", "index": block}]

    async def events(self, run):
        """message_start, ping, then per content block content_block_start / _delta (thinking_delta and
        signature_delta, text_delta, or a tool_use's input_json_delta fragments as its arguments are
        generated) / _stop, then message_delta (stop_reason, usage) and message_stop; a failure mid-way is
        an ``error`` event."""
        def event(obj: dict) -> str:
            return f"event: {obj['type']}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n"

        block, open_kind = -1, None                  # the last block started, and its kind while open
        delta_of = {"text": "text_delta", "thinking": "thinking_delta"}
        try:
            yield event({"type": "message_start", "message": {
                **self.head(), "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}})
            yield event({"type": "ping"})
            async for p in run.pieces():
                kind = {"text": "text", "reasoning": "thinking"}.get(p.kind)
                if kind is not None and p.text:
                    if open_kind != kind:
                        for e in self._close(block, open_kind):
                            yield event(e)
                        block, open_kind = block + 1, kind
                        start = {"type": "text", "text": ""} if kind == "text" else \
                            {"type": "thinking", "thinking": "", "signature": ""}
                        yield event({"type": "content_block_start", "index": block, "content_block": start})
                    yield event({"type": "content_block_delta", "index": block,
                                 "delta": {"type": delta_of[kind], kind: p.text}})
                elif p.kind == "call":
                    for e in self._close(block, open_kind):
                        yield event(e)
                    block, open_kind = block + 1, "tool_use"
                    yield event({"type": "content_block_start", "index": block, "content_block": {
                        "type": "tool_use", "id": _tool_use_id(p.call["id"]), "name": p.call["name"], "input": {}}})
                elif p.kind == "args" and p.text:
                    yield event({"type": "content_block_delta", "index": block,
                                 "delta": {"type": "input_json_delta", "partial_json": p.text}})
                elif p.kind == "calls":
                    for e in self._close(block, open_kind):
                        yield event(e)
                    open_kind = None
                elif p.kind == "error":
                    yield event(error_body(p.error.renamed(_NAMES)))
                    return
                elif p.kind == "done":
                    for e in self._close(block, open_kind):
                        yield event(e)
                    u = self.usage(p.usage)
                    yield event({"type": "message_delta", "delta": self.stopped(p.finish, p.stop), "usage": u})
                    yield event({"type": "message_stop"})
        finally:
            run.close()
