"""OpenAI wire format: request schemas and their checks, response and stream-chunk bodies, error bodies.

Requests are parsed by hand from the raw body (so malformed JSON and wrong types both answer 400 with an
OpenAI error body, not FastAPI's 422) and checked with pydantic models that allow unknown fields, as
OpenAI clients send many.

Limits on what a client sends, each answered 400 with the field named (the body size, 413, is checked by
the app before parsing): JSON nested at most ``MAX_DEPTH`` deep; strings must be valid Unicode (no lone
surrogates); at most ``MAX_STOP`` stop strings of at most ``MAX_STOP_CHARS`` characters; sampling values
as :class:`~streamattn.engine.sampling.SamplingParams` checks them (seed in [0, 2**63), temperature 0 or
>= 1e-5, finite); the prompt must leave one token of the context, and a prompt too long for it is refused
before it is fully tokenized (the work is bounded by the context, not by the prompt). Chat message
contents are text: control-token strings typed into them stay text (``Tokenizer.apply_chat``); a raw
``prompt`` of /v1/completions is the opt-in for writing control tokens (``<|im_start|>``) yourself.
"""

from __future__ import annotations

import json
import re
import time
import uuid

import numpy as np
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from streamattn.engine.grammar import one_line
from streamattn.engine.sampling import SamplingParams
from streamattn.engine.sequence import Job, check_logit_bias
from streamattn.engine.speculative import SpecParams
from streamattn.text.tokenizer import TooLong

MAX_DEPTH = 64              # JSON nesting of a request body
MAX_STOP = 16               # stop strings per request
MAX_STOP_CHARS = 256        # characters per stop string


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def renamed(self, names: tuple) -> "APIError":
        """The same error in another API's field names: each (regex, replacement) of ``names`` applied to
        every dotted field path of ``param`` and the message (a request translated onto the chat one)."""
        def sub(text: str) -> str:
            for pattern, repl in names:
                text = re.sub(r"(?<![\w.])" + pattern + r"(?![\w])", repl, text)
            return text
        return APIError(self.status, sub(self.message), type=self.type,
                        param=None if self.param is None else sub(self.param), code=self.code)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"          # OpenAI's function names
MAX_TOOLS = 64                  # functions a request may offer
MAX_CALLS = 64                  # tool calls one history message may hold


class FunctionCall(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    arguments: str                                  # JSON text: parsed with the body's bounds (loads_bounded)


class ToolCall(_Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    """One chat message; ``tool_calls`` only on assistant messages, ``tool_call_id`` only on tool ones (a
    field the rendering would drop is refused, never ignored)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list, None] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, max_length=MAX_CALLS)
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None         # an earlier reply's reasoning, for templates that show it

    @model_validator(mode="after")
    def _fields_of_its_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belongs to assistant messages (this one's role is {self.role!r})")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to tool messages (this one's role is {self.role!r})")
        return self


class FunctionDef(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: Optional[str] = Field(None, max_length=8192)
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class _Common(_Strict):
    model: str
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0, lt=1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = None
    ignore_eos: bool = False                   # extension (vLLM): keep going past end-of-sequence tokens
    cache_prompt: bool = True                  # extension (llama.cpp): use the prompt cache
    logit_bias: Optional[dict] = None
    response_format: Optional[dict] = None
    speculative: Optional[Literal["ngram", "none"]] = None   # extension: speculate ("none": not even by default)
    draft_max: Optional[int] = Field(None, ge=1, le=64)      # extension: drafted tokens per step at most


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Tool]] = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None      # several calls in one reply (native templates; default true)
    chat_template_kwargs: Optional[dict] = None     # extension (vLLM, llama.cpp): variables of the template
    reasoning_effort: Optional[str] = Field(None, max_length=64)   # for a template that reads it
    thinking_token_budget: Optional[int] = Field(None, ge=0)       # extension (vLLM): think block tokens at most

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, v):
        if v is None or v in ("none", "auto", "required") or (
                isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict)):
            return v
        raise ValueError("must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                         "{\"name\": <a function of tools>}}")


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: Optional[bool] = False


def _validation_error(e: ValidationError, obj) -> APIError:
    """The most specific error as a 400 naming the field: its path in the request (pydantic's
    union-member tags, such as ``str`` or a model's name, dropped; of a union's errors, the one reaching
    deepest into the value) and at most 80 characters of the value."""
    def path_of(err) -> list:
        path, node = [], obj
        for part in err["loc"]:
            if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int) \
                    and 0 <= part < len(node):
                path.append(str(part))
                node = node[part]
            elif err["type"] == "missing" and part == err["loc"][-1]:
                path.append(str(part))
        return path
    errors = e.errors(include_url=False)
    paths = [path_of(x) for x in errors]
    k = max(range(len(errors)), key=lambda i: (len(paths[i]), -i))
    err, param = errors[k], ".".join(paths[k]) or None
    got = err.get("input")
    try:
        got = "" if isinstance(got, dict) and err["type"] in ("missing", "value_error") else \
            f" (got {json.dumps(got)[:80]})"
    except (TypeError, ValueError, RecursionError):
        got = ""
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field: not part of this API, or not supported by this server"
    return APIError(400, one_line(f"{param}: {msg}{got}"), param=param, code=err["type"])


def json_depth(text: str) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (strings skipped), in linear time and no
    recursion, so that a nesting bound is checked before ``json.loads`` recurses."""
    bare = _STRINGS.sub("", text).encode("utf-8", "surrogatepass")
    b = np.frombuffer(bare, np.uint8)
    step = np.isin(b, _OPEN).astype(np.int64) - np.isin(b, _CLOSE)
    return int(np.cumsum(step).max(initial=0))


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def loads_bounded(text: str, param: str):
    """JSON text inside a request's strings (tool-call arguments), with the body's own bounds: at most
    MAX_DEPTH levels; APIError 400 naming ``param`` otherwise."""
    if json_depth(text) > MAX_DEPTH:
        raise APIError(400, f"{param}: JSON nested more than {MAX_DEPTH} levels deep", param=param,
                       code="invalid_value")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise APIError(400, f"{param} must be JSON text (got {len(text)} characters that do not parse)",
                       param=param, code="invalid_value") from None


MAX_N = 8


def parse(body: bytes, kind: str, **kw):
    """Check a request body; return (Job, meta) or raise APIError (400/404): :func:`load_body`, then
    :func:`parse_request` with the keywords ``kw``."""
    return parse_request(load_body(body), kind, **kw)


def load_body(body: bytes) -> dict:
    """The JSON object of a request body, nested at most MAX_DEPTH deep, with valid Unicode strings;
    APIError 400 otherwise."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body nests too deeply (at most {MAX_DEPTH} levels)",
                       code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object (got {type(obj).__name__})",
                       code="invalid_type")
    _check_tree(obj)
    return obj


def check(model: type[BaseModel], obj: dict):
    """``obj`` validated as ``model``; the most specific error as an APIError 400 naming the field."""
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e, obj) from None


def parse_request(obj: dict, kind: str, *, model_id: str, tok, context: int, fail_text: str | None = None,
                  speculative=None, grammars=None):
    """Check a request (a :func:`load_body` object); return (Job, meta) or raise APIError (400/404).

    ``kind`` is "chat" or "text"; ``meta`` holds model, stream, include_usage, kind and logprob settings,
    and ``read`` (an ``output.ReadSpec``: how to split the reply into reasoning, content and tool calls).
    ``speculative`` (a SpecParams or None) is the server's default; a request's ``speculative`` /
    ``draft_max`` fields override it. ``grammars`` (an engine Grammars) compiles ``response_format`` and
    tool-call grammars; meta["n"] is the number of choices.
    """
    req = check(ChatRequest if kind == "chat" else CompletionRequest, obj)
    _refuse_fields(obj, kind)
    if req.model != model_id:
        raise APIError(404, f"model {req.model!r} does not exist; this server serves {model_id!r}",
                       param="model", code="model_not_found")
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in 1..{MAX_N} (got {req.n})", param="n", code="invalid_value")
    from streamattn.serve.output import template_facts, think_mode
    from streamattn.serve.structured import Plan, StructuredError, offer, plan
    try:
        if kind == "chat":
            facts = template_facts(tok)
            offered = offer(req, facts)
            variables = _template_context(req, facts)
        else:
            from streamattn.serve.structured import response_format_grammar
            structured = Plan(grammar=response_format_grammar(req.response_format, grammars))
            offered, variables = structured, None
        bias = check_logit_bias(req.logit_bias, tok.vocab_size)
    except StructuredError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    except ValueError as e:
        raise APIError(400, str(e), param="logit_bias", code="invalid_value") from None
    text = _prompt_text(req, kind, tok, offered, variables)
    if kind == "chat":
        try:
            structured = plan(req, grammars, facts, think_mode(facts, text))
        except StructuredError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise APIError(400, f"{name} is not supported (got {getattr(req, name)}); use repetition_penalty",
                           param=name, code="unsupported_value")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"stop: at most {MAX_STOP} strings of 1..{MAX_STOP_CHARS} characters each (got "
                       f"{len(stop)}, the longest {max(map(len, stop), default=0)} characters)", param="stop",
                       code="invalid_value")
    if stop and structured.grammar is not None:
        raise APIError(400, "stop cannot be used with response_format json_object / json_schema or with tools: "
                       "the grammar decides where the output ends, and a stop string would cut it short of a "
                       "valid document; drop stop", param="stop", code="unsupported_value")
    if req.speculative == "none" and req.draft_max is not None:
        raise APIError(400, f"draft_max={req.draft_max} with speculative 'none': nothing is drafted; drop "
                       "draft_max or ask for speculative 'ngram'", param="draft_max", code="invalid_value")
    if kind == "text" and isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
        ids = list(req.prompt)
        bad = [i for i in ids if not 0 <= i < tok.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in 0..{tok.vocab_size - 1} (got {bad[0]})",
                           param="prompt", code="invalid_value")
    else:
        try:
            ids = tok.encode(text, max_tokens=context - 1)
        except TooLong:
            param = "messages" if kind == "chat" else "prompt"
            raise APIError(400, f"the prompt does not fit this model's context of {context} tokens with one "
                           f"left to generate ({len(text)} characters); shorten the {param}", param=param,
                           code="context_length_exceeded") from None
    param = "messages" if kind == "chat" else "prompt"
    if not ids:
        raise APIError(400, f"{param} encodes to no tokens; give some text", param=param, code="invalid_value")
    if len(ids) >= context:
        raise APIError(400, f"the prompt is {len(ids)} tokens; this model's context is {context} tokens and "
                       f"at least one must be left to generate; shorten the {param}", param=param,
                       code="context_length_exceeded")
    room = context - len(ids)
    max_tokens, mt_name = ((req.max_completion_tokens, "max_completion_tokens")
                           if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens"))
    if max_tokens is None:
        max_tokens = room
    elif max_tokens < 1:
        raise APIError(400, f"{mt_name} must be >= 1 (got {max_tokens})", param=mt_name, code="invalid_value")
    elif max_tokens > room:
        raise APIError(400, f"{mt_name}={max_tokens} plus the prompt's {len(ids)} tokens exceed the context of "
                       f"{context} tokens; ask for at most {room}", param=mt_name, code="context_length_exceeded")
    if kind == "text" and req.echo:
        raise APIError(400, "echo is not supported", param="echo", code="unsupported_value")
    if kind == "chat":
        want_lp, top = bool(req.logprobs), int(req.top_logprobs or 0)
        if top and not want_lp:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
    else:
        want_lp, top = req.logprobs is not None, int(req.logprobs or 0)
    try:
        sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                  top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p,
                                  min_p=req.min_p or 0.0,
                                  repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                                  seed=req.seed)
    except (ValueError, TypeError) as e:
        name = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=name, code="invalid_value") from None
    spec = None if req.speculative == "none" else speculative
    if req.speculative == "ngram" or (req.draft_max is not None and req.speculative != "none"):
        spec = SpecParams(draft_max=req.draft_max or (speculative or SpecParams()).draft_max)
    processors = ()
    if kind == "chat" and req.thinking_token_budget is not None:
        if structured.read.think == "none":
            raise APIError(400, f"thinking_token_budget={req.thinking_token_budget}: this reply cannot reason (the "
                           "chat template has no think block, or the prompt closes it); omit it",
                           param="thinking_token_budget", code="unsupported_value")
        from streamattn.serve.think_block import ReasoningBudget
        processors = (ReasoningBudget(tok=tok, read=structured.read, budget=req.thinking_token_budget,
                                      prompt_len=len(ids)),)
    job = Job(prompt=tuple(ids), max_tokens=max_tokens, sampling=sampling, stop=stop, logprobs=want_lp,
              top_logprobs=top, ignore_eos=req.ignore_eos, cache_prompt=req.cache_prompt, logits_processors=processors,
              speculative=spec, grammar=structured.grammar, logit_bias=bias, show_special=structured.read.keep,
              fail=bool(fail_text) and fail_text in text)
    meta = dict(kind=kind, model=model_id, stream=bool(req.stream), n=req.n or 1, read=structured.read,
                include_usage=bool(req.stream_options and req.stream_options.include_usage))
    return job, meta


#: Fields of the other endpoint, or of OpenAI's older API, that would change the output: refused by name
#: (accepting them would drop them silently).
_REFUSED = {
    "chat": {"prompt": "prompt belongs to /v1/completions; send messages",
             "suffix": "suffix is not supported",
             "functions": "functions (the legacy API) is not supported; send tools",
             "function_call": "function_call (the legacy API) is not supported; send tool_choice"},
    "text": {"messages": "messages belongs to /v1/chat/completions; send prompt",
             "tools": "tools belongs to /v1/chat/completions (a completion has no tool calls)",
             "tool_choice": "tool_choice belongs to /v1/chat/completions",
             "parallel_tool_calls": "parallel_tool_calls belongs to /v1/chat/completions",
             "functions": "functions belongs to /v1/chat/completions' legacy API; send tools there",
             "function_call": "function_call belongs to /v1/chat/completions' legacy API",
             "suffix": "suffix is not supported",
             "thinking_token_budget": "thinking_token_budget belongs to /v1/chat/completions (a completion has no "
                                      "think block)"},
}


def _refuse_fields(obj: dict, kind: str) -> None:
    for name, why in _REFUSED[kind].items():
        if obj.get(name) is not None:
            raise APIError(400, why, param=name, code="unsupported_value")
    if kind == "text" and obj.get("best_of") not in (None, 1):
        raise APIError(400, "best_of is not supported (only 1); use n for several completions", param="best_of",
                       code="unsupported_value")


def _check_tree(obj) -> None:
    """Nesting at most MAX_DEPTH deep and no lone surrogate in any string or key (iterative: any depth)."""
    todo = [(obj, 1, "")]
    while todo:
        x, depth, where = todo.pop()
        if depth > MAX_DEPTH and isinstance(x, (dict, list)):
            raise APIError(400, f"{where or 'the body'}: nested more than {MAX_DEPTH} levels deep", param=where
                           or None, code="invalid_value")
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
        for k, v in items:
            path = f"{where}.{k}" if where else str(k)
            for s in (k, v):
                if isinstance(s, str):
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError as e:
                        raise APIError(400, f"{path[:80]}: a lone surrogate (U+{ord(s[e.start]):04X}) at character "
                                       f"{e.start}; strings must be valid Unicode", param=path[:80],
                                       code="invalid_value") from None
            if isinstance(v, (dict, list)):
                todo.append((v, depth + 1, path))


def load_request(body: bytes, schema: type[BaseModel]):
    """A request body as :func:`parse` reads one, for the endpoints beside the completions: JSON text of an
    object, nested at most ``MAX_DEPTH`` deep, valid Unicode, then validated by the pydantic ``schema``.

    Returns
    -------
    schema
        The validated request.

    Raises
    ------
    APIError
        400 naming the field (its path in the body) and showing the value.
    """
    obj = load_body(body)
    try:
        return schema.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e, obj) from None


#: Variables the server sets itself: a ``chat_template_kwargs`` key among them is refused.
_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def _template_context(req, facts) -> dict:
    """The extra variables of the chat template: ``chat_template_kwargs``, and ``reasoning_effort`` where
    the template reads it (a 400 naming it otherwise: it would change nothing)."""
    context = dict(req.chat_template_kwargs or {})
    for k in context:
        if k in _TEMPLATE_OWN:
            raise APIError(400, f"chat_template_kwargs.{k[:40]}: the server sets {k} itself; drop it",
                           param=f"chat_template_kwargs.{k[:40]}", code="invalid_value")
    if req.reasoning_effort is not None:
        if "reasoning_effort" not in facts.reads:
            raise APIError(400, f"reasoning_effort={req.reasoning_effort[:40]!r}: this model's chat template has "
                           "no reasoning effort to set; omit it", param="reasoning_effort",
                           code="unsupported_value")
        context["reasoning_effort"] = req.reasoning_effort
    return context


def _prompt_text(req, kind: str, tok, offered=None, variables: dict | None = None) -> str:
    """The prompt's text; for chat, the messages rendered by the template with the Plan ``offered``'s
    functions (the template's ``tools`` where it renders them, else a system message), each earlier tool
    call in the form the model was asked for, and the template variables ``variables``."""
    if kind == "text":
        p = req.prompt
        if isinstance(p, list):
            if len(p) == 1 and isinstance(p[0], str):
                return p[0]
            if p and isinstance(p[0], str):
                raise APIError(400, f"prompt: one prompt per request (got a list of {len(p)})", param="prompt",
                               code="unsupported_value")
            return ""
        return p
    from streamattn.serve.output import template_facts
    facts = template_facts(tok)
    native = facts.syntax is not None
    msgs = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(400, f"messages.{i}.content.{j}: only text parts are supported (got "
                                   f"{json.dumps(part)[:80]})", param=f"messages.{i}.content", code="invalid_type")
                parts.append(part["text"])
            content = "".join(parts)
        msg = {"role": "system" if m.role == "developer" else m.role}
        calls = [(c, loads_bounded(c.function.arguments, f"messages.{i}.tool_calls.{k}.function.arguments"))
                 for k, c in enumerate(m.tool_calls or ())]
        if calls and native:                     # the template writes them in the model's own syntax
            msg["tool_calls"] = [{"id": c.id or f"call_{i}_{k}", "type": "function",
                                  "function": {"name": c.function.name, "arguments": args}}
                                 for k, (c, args) in enumerate(calls)]
        elif calls:                              # every earlier call, in the form the model was asked for
            content = "\n".join(([content] if content else []) + [
                json.dumps({"name": c.function.name, "arguments": args}) for c, args in calls])
        if m.tool_call_id is not None and native:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None and facts.think is not None:
            msg["reasoning_content"] = m.reasoning_content
        msgs.append({**msg, "content": content or ""})
    tools_message = offered.tools_message if offered is not None else None
    if tools_message:
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + tools_message}
        else:
            msgs.insert(0, {"role": "system", "content": tools_message})
    try:
        return tok.apply_chat(msgs, tools=offered.tools if offered is not None else None, context=variables or None)
    except ValueError as e:
        raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from None


# ---------------------------------------------------------------------------------------- responses
class Reply:
    """Builds the response bodies of one request (shared id, creation time and model)."""

    def __init__(self, meta: dict, tok):
        self.kind, self.model, self.tok = meta["kind"], meta["model"], tok
        self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._offset = 0

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str = "", logprobs: tuple = (), finish: str | None = None, *, first=False,
              index: int = 0, tool_call: dict | None = None, reasoning: str = "") -> dict:
        """One stream event's payload for choice ``index`` (``first``: the chat stream's opening role
        delta; ``tool_call``: one entry of OpenAI's ``delta.tool_calls``, a call's ``index`` with its
        ``id``, ``type`` and ``function.name`` when it begins, then ``function.arguments`` fragments;
        ``reasoning``: a ``delta.reasoning_content``)."""
        if self.kind == "chat":
            if first:
                delta = {"role": "assistant", "content": ""}
            elif reasoning:
                delta = {"reasoning_content": reasoning}
            elif tool_call:
                delta = {"tool_calls": [tool_call]}
            else:
                delta = {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice], "usage": None}
        choice = {"index": index, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": None}

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}

    def whole(self, choices: list, usage: dict) -> dict:
        """The non-streaming response; ``choices``: (text, logprobs, finish, tool_calls or None, reasoning)
        each (chat: ``message.reasoning_content`` when the reply reasoned; content None when it is only
        calls)."""
        out = []
        for i, (text, logprobs, finish, calls, reasoning) in enumerate(choices):
            if self.kind == "chat":
                msg = {"role": "assistant", "content": None if calls and not text else text}
                if reasoning:
                    msg["reasoning_content"] = reasoning
                if calls:
                    msg["tool_calls"] = calls
                out.append({"index": i, "message": msg, "logprobs": self.logprobs(logprobs),
                            "finish_reason": "tool_calls" if calls else finish})
            else:
                out.append({"index": i, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish})
        return {**self._head("chat.completion" if self.kind == "chat" else "text_completion"), "choices": out,
                "usage": usage}

    def _token(self, i: int) -> tuple:
        b = self.tok.token_bytes[i] or (self.tok.hf.id_to_token(i) or "").encode()
        return b.decode("utf-8", errors="replace"), list(b)

    def logprobs(self, entries: tuple):
        """Chat: {"content": [...]}; completions: the legacy tokens / token_logprobs / top_logprobs lists."""
        if not entries:
            return None
        if self.kind == "chat":
            content = []
            for e in entries:
                s, b = self._token(e["id"])
                tops = [dict(zip(("token", "bytes"), self._token(i)), logprob=lp) for i, lp in e["top"]]
                content.append({"token": s, "logprob": e["logprob"], "bytes": b, "top_logprobs": tops})
            return {"content": content}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            s = self._token(e["id"])[0]
            out["tokens"].append(s)
            out["token_logprobs"].append(e["logprob"])
            out["top_logprobs"].append({self._token(i)[0]: lp for i, lp in e["top"]})
            out["text_offset"].append(self._offset)
            self._offset += len(s)
        return out
