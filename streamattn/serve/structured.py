"""The server's structured outputs: ``response_format``, ``tools`` / ``tool_choice``, and tool calls.

Every constraint becomes a :class:`~streamattn.engine.grammar.Grammar` that the engine enforces on every
token; one that cannot be enforced is a 400 naming it, never an unconstrained answer.

Tools. The request's functions are offered to the model in a system message (the chat templates of the
models here have no ``tools`` variable; the format is documented in :data:`TOOLS_PREAMBLE`), and a call is
one JSON object ``{"name": ..., "arguments": {...}}``. ``tool_choice``:

=================  ===========================================================================
``"none"``         no functions offered, no call possible (plain text, or ``response_format``)
``"auto"``         text, or a call (a grammar: a call's JSON, or text that does not start with ``{``)
``"required"``     a call of one of the functions (a grammar over every function's ``parameters``)
``{"type": "function", "function": {"name": N}}``  a call of function N
=================  ===========================================================================

A completion that is a call comes back as ``message.tool_calls`` with ``finish_reason: "tool_calls"``
(streamed: one ``delta.tool_calls`` chunk carrying the id, name and arguments).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from streamattn.engine.grammar import GrammarError, ResponseFormatError, check_schema, response_format_grammar

TOOLS_PREAMBLE = ("You can call these functions (each: name, description, parameters as a JSON schema):\n"
                  "{functions}\n"
                  "To call a function, answer with exactly one JSON object and nothing else: "
                  '{{"name": <the function name>, "arguments": <an object matching its parameters>}}.')


StructuredError = ResponseFormatError         # the same error for tools and tool_choice


@dataclass(frozen=True)
class Plan:
    """What a request asks for: the grammar (None: free text), the functions offered (their system
    message), and whether the completion is to be read as a tool call ("call"), maybe ("auto"), or not."""

    grammar: object = None
    tools_message: str | None = None
    calls: str = "none"                              # "none" | "auto" | "call"


def _functions(tools) -> list:
    """The offered functions as dicts, from the request's validated ``tools`` (protocol.Tool models)."""
    out = []
    for i, t in enumerate(tools):
        f = t.function
        params = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
        try:
            check_schema(params)
        except GrammarError as e:
            raise StructuredError(f"tools[{i}].function.parameters: {e}", f"tools.{i}.function.parameters")
        out.append({"name": f.name, "description": (f.description or "")[:2000], "parameters": params})
    if len({f["name"] for f in out}) != len(out):
        raise StructuredError("tools: function names must be unique", "tools")
    return out


def _call_schema(functions: list) -> dict:
    one = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return one[0] if len(one) == 1 else {"anyOf": one}


def plan(req, grammars) -> Plan:
    """The Plan of a chat request's ``response_format``, ``tools`` and ``tool_choice``."""
    fmt = response_format_grammar(getattr(req, "response_format", None), grammars)
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise StructuredError("tool_choice needs tools", "tool_choice")
        return Plan(grammar=fmt)
    functions = _functions(tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return Plan(grammar=fmt)
    if fmt is not None:
        raise StructuredError("response_format with tools: give tool_choice 'none', or drop response_format",
                              "response_format")
    message = TOOLS_PREAMBLE.format(functions="\n".join(json.dumps(f) for f in functions))
    if not isinstance(choice, str):                  # {"type": "function", "function": {"name": N}}
        chosen = [f for f in functions if f["name"] == choice.function.name]
        if not chosen:
            raise StructuredError(f"tool_choice names {choice.function.name!r}, which is no function of tools",
                                  "tool_choice.function.name")
        functions = chosen
    schema = json.dumps(_call_schema(functions))
    try:
        if choice == "auto":
            g = grammars.lark(f"start: call | text\ncall: %json {schema}\ntext: /[^{{](.|\\n)*/\n")
        else:
            g = grammars.json_schema(schema)
    except GrammarError as e:
        raise StructuredError(f"tools: a function's parameters cannot be enforced: {e}", "tools")
    return Plan(grammar=g, tools_message=message, calls="auto" if choice == "auto" else "call")


def tool_calls(text: str, calls: str) -> list | None:
    """The OpenAI ``tool_calls`` list of a finished completion, or None when it is text."""
    if calls == "none" or not text.lstrip().startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None                                      # cut short by max_tokens: returned as text
    if not isinstance(obj, dict) or "name" not in obj or "arguments" not in obj:
        return None
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"])}}]
