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
(streamed: a ``delta.tool_calls`` entry with each call's id and name once it is read, then its
arguments in fragments as they are generated: ``output.CallScanner``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from streamattn.engine.grammar import (GrammarError, ResponseFormatError, check_response_format, check_schema,
                                       response_format_grammar)
from streamattn.serve.output import SYNTAXES, ReadSpec, TemplateFacts, marker_token

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
    may reason, the grammar lets a think block through first and constrains what follows it. A marker
    that is one added token of the vocabulary (a control token such as Mistral's ``[TOOL_CALLS]``, or a
    user-defined one such as Qwen3's ``<think>``) is that token in the grammar, never its spelling."""
    offered = offer(req, facts)
    fmt = getattr(req, "response_format", None)
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None) or "auto"
    atom = _Atoms(grammars)
    lead = None if think == "none" else _think_rules(atom, facts.think, think)
    if offered.tools is None and offered.tools_message is None:          # no functions: text or a format
        read = ReadSpec(think=think, markers=facts.think).with_keep(getattr(grammars, "tok", None))
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
    read = ReadSpec(think=think, markers=facts.think, calls="auto" if choice == "auto" else "call",
                    syntax=syntax).with_keep(getattr(grammars, "tok", None))
    schema = _call_schema(functions, syntax.args)
    try:
        if lead is None and syntax.name == "json":   # the templates without tools: as before reasoning
            g = grammars.lark(f"start: call | text\ncall: %json {json.dumps(schema)}\ntext: /[^{{](.|\\n)*/\n") \
                if choice == "auto" else grammars.json_schema(json.dumps(schema))
        else:
            g = grammars.lark(_lark(lead, think, _calls_rules(atom, syntax, schema, parallel, choice == "auto")))
    except GrammarError as e:
        raise StructuredError(f"tools: a function's parameters cannot be enforced: {e}", "tools")
    return replace(offered, grammar=g, read=read)


class _Atoms:
    """A marker as a grammar symbol for one tokenizer: ``<[id]>`` where the vocabulary holds it as one
    added token (llguidance treats every added token, control or user-defined, as a special token that
    no text lexeme can produce, and names one by id as ``<[id]>``: its docs/syntax.md), else None (the
    marker is text, spelled by ordinary tokens)."""

    def __init__(self, grammars):
        self.grammars = grammars

    def token(self, marker: str) -> str | None:
        if self.grammars is None:
            return None
        i = marker_token(self.grammars.tok, marker)
        return f"<[{i}]>" if i is not None and self.grammars.lltok.is_special_token(i) else None


def _rx(text: str) -> str:
    """``text`` as a literal inside a Lark /regex/."""
    return re.sub(r"([\\^$.|?*+()\[\]{}/])", r"\\\1", text)


_ANY = "(.|\\n)*"
_WS = "[ \\t\\r\\n]"


def _up_to_first(marker: str) -> str:
    """A lexeme: any text that ends with its first ``marker``."""
    m = _rx(marker)
    return f"/{_ANY}{m}/ & ~/{_ANY}{m}{_ANY}{m}{_ANY}/"


def _without(marker: str) -> str:
    """A lexeme: any text that does not contain ``marker``."""
    return f"/{_ANY}/ & ~/{_ANY}{_rx(marker)}{_ANY}/"


def _think_rules(atom: _Atoms, markers: tuple, think: str) -> str:
    """Lark rules of ``think``: the think block a reply may open (``optional``) or is already in
    (``open``), and the whitespace after it. Spelled markers make one lexeme that ends at the first
    closing marker, so that what follows is constrained; a marker that is a token is that token, the
    text before it free of the spelled closing marker (which the reply's reader would take for it)."""
    opening, closing = atom.token(markers[0]), atom.token(markers[1])
    if opening is None and closing is None:
        lead = "" if think == "open" else f"{_WS}*{_rx(markers[0])}"
        return (f"think: THINK\nTHINK: /{lead}{_ANY}{_rx(markers[1])}{_WS}*/ & "
                f"~/{_ANY}{_rx(markers[1])}{_ANY}{_rx(markers[1])}{_ANY}/")
    rules = [f"THINK_WS: /{_WS}+/"]
    head = ""
    if think != "open":
        head = f"THINK_WS? {opening}" if opening is not None else "THINK_OPEN"
        if opening is None:
            rules.append(f"THINK_OPEN: /{_WS}*{_rx(markers[0])}/")
    if closing is not None:
        rules.append(f"THOUGHT: {_without(markers[1])}")
        tail = f"THOUGHT? {closing}"
    else:
        rules.append(f"THOUGHT: {_up_to_first(markers[1])}")
        tail = "THOUGHT"
    return "\n".join([f"think: {head} {tail} THINK_WS?".replace("  ", " ")] + rules)


def _lark(think_rules: str | None, think: str, body: str) -> str:
    head = "start: body" if think_rules is None else f"start: think{'?' if think == 'optional' else ''} body"
    return f"{head}\n{body}\n" + (f"{think_rules}\n" if think_rules else "")


def _calls_rules(atom: _Atoms, syntax, schema: dict, parallel: bool, auto: bool) -> str:
    """Lark rules of ``body``: the calls in ``syntax`` (several when ``parallel``), or (``auto``) text
    with no call in it, or (``hermes``) text and then calls. The spelled start of the calls never begins
    (Hermes: never appears in) the text, also where the start is a token, so that the reply reads one way."""
    obj = f"obj: %json {json.dumps(schema)}"
    more = lambda sep, item: f' ("{sep}" {item})*' if parallel else ""
    if syntax.name == "hermes":
        start, end = atom.token("<tool_call>"), atom.token("</tool_call>")
        opening = start or '"<tool_call>"'
        end = r'"\n" ' + end if end is not None else r'"\n</tool_call>"'
        rules = [f"call: {opening}" + r' "\n" obj ' + end, obj, r'rest: "\n" obj ' + end + more(r"\n", "call")]
        if not auto:
            return "\n".join([f"body: {opening} rest"] + rules)
        if start is not None:
            return "\n".join([f"body: TEXT | TEXT? {start} rest"] + rules + [f"TEXT: {_without('<tool_call>')}"])
        return "\n".join(["body: TEXT | PRE rest"] + rules + [
            f"TEXT: {_without('<tool_call>')}", f"PRE: {_up_to_first('<tool_call>')}"])
    if syntax.name == "mistral":
        arr = {"type": "array", "items": schema, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        rules = [f'calls: {atom.token(syntax.start) or json.dumps(syntax.start)} arr', f"arr: %json {json.dumps(arr)}"]
    else:                                            # llama3, json: one object a line
        rules = ["calls: obj" + more(r"\n", "obj"), obj]
    if not auto:
        return "\n".join(["body: calls"] + rules)
    return "\n".join(["body: TEXT | calls"] + rules + [
        f"TEXT: /{_ANY}/ & ~/{_WS}*{_rx(syntax.start)}{_ANY}/"])
