"""The server's structured outputs: ``response_format``, ``tools`` / ``tool_choice``, and tool calls.

Every constraint becomes a :class:`~streamattn.engine.grammar.Grammar` that the engine enforces on every
token; one that cannot be enforced is a 400 naming it, never an unconstrained answer.

Tools. Where the model's chat template renders ``tools`` (``output.template_facts``), the functions go to
the template and a call is written in the template's own syntax (``output.SYNTAXES``: Hermes
``<tool_call>``, Llama-3.1 JSON, Mistral ``[TOOL_CALLS]``), several in one reply unless
``parallel_tool_calls`` is false. Otherwise they are offered in a system message (the format is
documented in :data:`TOOLS_PREAMBLE`), and a call is one JSON object ``{"name": ..., "arguments": {...}}``.
``tool_choice``:

=================  ===========================================================================
``"none"``         no functions offered, no call possible (plain text, or ``response_format``)
``"auto"``         text, or calls (a grammar: calls, or text that does not begin them; Hermes:
                   text without ``<tool_call>``, then maybe calls)
``"required"``     calls of the functions (a grammar over every function's ``parameters``)
``{"type": "function", "function": {"name": N}}``  calls of function N
=================  ===========================================================================

Where the reply may reason (a template with think markers), every grammar lets one think block through
first (a lexeme that ends at the first closing marker) and constrains what follows it.

A completion with calls comes back as ``message.tool_calls`` with ``finish_reason: "tool_calls"``
(streamed: one ``delta.tool_calls`` chunk carrying each call's id, name and arguments).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from streamattn.engine.grammar import (GrammarError, ResponseFormatError, check_response_format, check_schema,
                                       response_format_grammar)
from streamattn.serve.output import SYNTAXES, ReadSpec, TemplateFacts

TOOLS_PREAMBLE = ("You can call these functions (each: name, description, parameters as a JSON schema):\n"
                  "{functions}\n"
                  "To call a function, answer with exactly one JSON object and nothing else: "
                  '{{"name": <the function name>, "arguments": <an object matching its parameters>}}.')


StructuredError = ResponseFormatError         # the same error for tools and tool_choice


@dataclass(frozen=True)
class Plan:
    """What a request asks for: the grammar (None: free text), the functions offered (``tools``: the
    template's own ``tools`` variable where it renders them (``native``), else the system message
    ``tools_message``), and how the reply is read (``read``: reasoning, calls and their syntax)."""

    grammar: object = None
    tools_message: str | None = None
    read: ReadSpec = ReadSpec()
    tools: list | None = None                        # function definitions for the template
    native: bool = False

    @property
    def calls(self) -> str:
        return self.read.calls


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


def _call_schema(functions: list, args: str = "arguments") -> dict:
    one = [{"type": "object", "properties": {"name": {"const": f["name"]}, args: f["parameters"]},
            "required": ["name", args], "additionalProperties": False} for f in functions]
    return one[0] if len(one) == 1 else {"anyOf": one}


def offer(req, facts: TemplateFacts) -> Plan:
    """The functions a chat request offers and how: a Plan without its grammar (see :func:`plan`)."""
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise StructuredError("tool_choice needs tools", "tool_choice")
        return Plan()
    functions = _functions(tools)
    if choice == "none":
        return Plan()
    if getattr(req, "response_format", None) is not None:
        raise StructuredError("response_format with tools: give tool_choice 'none', or drop response_format",
                              "response_format")
    if not isinstance(choice, (str, type(None))) and choice.function.name not in {f["name"] for f in functions}:
        raise StructuredError(f"tool_choice names {choice.function.name!r}, which is no function of tools",
                              "tool_choice.function.name")
    if facts.syntax is not None:
        return Plan(tools=[{"type": "function", "function": f} for f in functions], native=True)
    return Plan(tools_message=TOOLS_PREAMBLE.format(functions="\n".join(json.dumps(f) for f in functions)))


def plan(req, grammars, facts: TemplateFacts = TemplateFacts(), think: str = "none") -> Plan:
    """The Plan of a chat request's ``response_format``, ``tools`` and ``tool_choice``, for a template
    of ``facts`` and a prompt whose reply reasons as ``think`` (``output.think_mode``): where the reply
    may reason, the grammar lets a think block through first and constrains what follows it."""
    offered = offer(req, facts)
    fmt = getattr(req, "response_format", None)
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None) or "auto"
    lead = None if think == "none" else _think_lexeme(facts.think, think)
    if offered.tools is None and offered.tools_message is None:          # no functions: text or a format
        read = ReadSpec(think=think, markers=facts.think)
        if lead is None:
            return Plan(grammar=response_format_grammar(fmt, grammars), read=read)
        kind, schema = check_response_format(fmt)
        if kind == "text":
            return Plan(read=read)
        body = json.dumps({"type": "object"} if kind == "json_object" else schema)
        try:
            check_schema(json.loads(body))
            return Plan(grammar=grammars.lark(_lark(lead, think, "body: %json " + body)), read=read)
        except GrammarError as e:
            raise StructuredError(f"response_format.json_schema.schema: {e}", "response_format.json_schema.schema")
    functions = _functions(tools)
    if not isinstance(choice, str):                  # {"type": "function", "function": {"name": N}}
        functions = [f for f in functions if f["name"] == choice.function.name]
    syntax = facts.syntax if offered.native else SYNTAXES["json"]
    parallel = offered.native and getattr(req, "parallel_tool_calls", None) is not False
    read = ReadSpec(think=think, markers=facts.think, calls="auto" if choice == "auto" else "call", syntax=syntax)
    schema = _call_schema(functions, syntax.args)
    try:
        if lead is None and syntax.name == "json":   # the templates without tools: as before reasoning
            g = grammars.lark(f"start: call | text\ncall: %json {json.dumps(schema)}\ntext: /[^{{](.|\\n)*/\n") \
                if choice == "auto" else grammars.json_schema(json.dumps(schema))
        else:
            g = grammars.lark(_lark(lead, think, _calls_rules(syntax, schema, parallel, choice == "auto")))
    except GrammarError as e:
        raise StructuredError(f"tools: a function's parameters cannot be enforced: {e}", "tools")
    return replace(offered, grammar=g, read=read)


def _rx(text: str) -> str:
    """``text`` as a literal inside a Lark /regex/."""
    return re.sub(r"([\\^$.|?*+()\[\]{}/])", r"\\\1", text)


_ANY = "(.|\\n)*"


def _up_to_first(marker: str) -> str:
    """A lexeme: any text that ends with its first ``marker``."""
    m = _rx(marker)
    return f"/{_ANY}{m}/ & ~/{_ANY}{m}{_ANY}{m}{_ANY}/"


def _think_lexeme(markers: tuple, think: str) -> str:
    """The think block a reply may open (``optional``) or is already in (``open``), and the whitespace
    after it, as one lexeme: it ends at the first closing marker, so that what follows is constrained."""
    lead = "" if think == "open" else f"[ \\t\\r\\n]*{_rx(markers[0])}"
    return f"/{lead}{_ANY}{_rx(markers[1])}[ \\t\\r\\n]*/ & ~/{_ANY}{_rx(markers[1])}{_ANY}{_rx(markers[1])}{_ANY}/"


def _lark(lead: str | None, think: str, body: str) -> str:
    head = "start: body" if lead is None else f"start: THINK{'?' if think == 'optional' else ''} body"
    return f"{head}\n{body}\n" + (f"THINK: {lead}\n" if lead else "")


def _calls_rules(syntax, schema: dict, parallel: bool, auto: bool) -> str:
    """Lark rules of ``body``: the calls in ``syntax`` (several when ``parallel``), or (``auto``) text
    with no call in it, or (``hermes``) text and then calls."""
    obj = f"obj: %json {json.dumps(schema)}"
    more = lambda sep, item: f' ("{sep}" {item})*' if parallel else ""
    if syntax.name == "hermes":
        rules = [r'call: "<tool_call>\n" obj "\n</tool_call>"', obj,
                 r'rest: "\n" obj "\n</tool_call>"' + more(r"\n", "call")]
        if not auto:
            return "\n".join([r'body: "<tool_call>" rest'] + rules)
        return "\n".join(["body: TEXT | PRE rest"] + rules + [
            f"TEXT: /{_ANY}/ & ~/{_ANY}<tool_call>{_ANY}/", f"PRE: {_up_to_first('<tool_call>')}"])
    if syntax.name == "mistral":
        arr = {"type": "array", "items": schema, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        rules = ['calls: "[TOOL_CALLS]" arr', f"arr: %json {json.dumps(arr)}"]
    else:                                            # llama3, json: one object a line
        rules = ["calls: obj" + more(r"\n", "obj"), obj]
    if not auto:
        return "\n".join(["body: calls"] + rules)
    return "\n".join(["body: TEXT | calls"] + rules + [
        f"TEXT: /{_ANY}/ & ~/[ \\t\\r\\n]*{_rx(syntax.start)}{_ANY}/"])

