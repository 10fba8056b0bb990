"""A chat completion's text read back in the syntax of the model's chat template: reasoning, content and
tool calls, whole or as it streams.

:func:`template_facts` reads what a GGUF's chat template does, once per template: whether it renders
``tools`` and in which call syntax the model answers, which reasoning markers it declares, and which of the
variables ``enable_thinking`` / ``reasoning_effort`` it reads. The call syntaxes (:data:`SYNTAXES`):

===========  ==============================================================  ===========================
``hermes``   ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``  Qwen2.5/3, Hermes; after
             per call, one a line                                             content or alone
``llama3``   ``{"name": N, "parameters": {...}}`` per call, one a line        Llama-3.1+; the whole reply
``mistral``  ``[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]``          Mistral; the whole reply
``json``     ``{"name": N, "arguments": {...}}``, one call                    templates without tools:
                                                                              ``serve/structured.py``
===========  ==============================================================  ===========================

A template renders tools when a function offered to it shows in its output; its syntax is then named by
the markers in its source (``<tool_call>``, ``[TOOL_CALLS]``, Llama-3's ``<|start_header_id|>`` with
``"parameters"``). Reasoning markers are ``<think>``/``</think>`` or Magistral's ``[THINK]``/``[/THINK]``
where the source holds them. A reply reads (:class:`Reader`): an optional think block (already open when
the prompt ends inside one, as DeepSeek-R1's template leaves it), whitespace, then content and calls.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Syntax:
    """One family's tool-call syntax: ``start`` begins the calls; ``anywhere``: they may follow content
    (else the reply is either text or calls); ``args``: the key of a call's arguments."""

    name: str
    start: str
    anywhere: bool
    args: str

    def parse(self, text: str) -> list | None:
        """The (name, arguments) of each call of ``text`` (which begins with ``start``), or None when it is
        not whole calls of this syntax (cut short by ``max_tokens``)."""
        objs = []
        if self.name == "hermes":
            pos = 0
            for m in _HERMES.finditer(text):
                if text[pos:m.start()].strip():
                    return None
                objs.append(_loads(m.group(1)))
                pos = m.end()
            if text[pos:].strip():
                return None
        elif self.name == "mistral":
            arr = _loads(text[len(self.start):])
            objs = arr if isinstance(arr, list) and arr else [None]
        else:                                        # json, llama3: objects one after another
            dec, pos, text = json.JSONDecoder(), 0, text.strip()
            while pos < len(text):
                try:
                    obj, pos = dec.raw_decode(text, pos)
                except ValueError:
                    return None
                objs.append(obj)
                while pos < len(text) and text[pos] in " \t\r\n;":
                    pos += 1
            if self.name == "json" and len(objs) != 1:
                return None
        calls = []
        for o in objs:
            if not (isinstance(o, dict) and isinstance(o.get("name"), str) and isinstance(o.get(self.args), dict)):
                return None
            calls.append((o["name"], o[self.args]))
        return calls or None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

SYNTAXES = {s.name: s for s in (Syntax("hermes", "<tool_call>", True, "arguments"),
                                Syntax("llama3", "{", False, "parameters"),
                                Syntax("mistral", "[TOOL_CALLS]", False, "arguments"),
                                Syntax("json", "{", False, "arguments"))}

THINK_MARKERS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def openai_calls(calls: list) -> list:
    """(name, arguments) pairs as OpenAI ``tool_calls`` entries, each with a fresh id."""
    return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}} for name, args in calls]


@dataclass(frozen=True)
class TemplateFacts:
    """What a chat template does: ``syntax`` (a :data:`SYNTAXES` entry when it renders ``tools``, else
    None), ``think`` (its reasoning markers (open, close), or None), ``reads`` (which of
    ``enable_thinking`` and ``reasoning_effort`` its source reads)."""

    syntax: Syntax | None = None
    think: tuple | None = None
    reads: frozenset = frozenset()


_FACTS: dict = {}
_FACTS_LOCK = threading.Lock()
_PROBE = {"type": "function", "function": {"name": "zq_probe_fn", "description": "probe",
                                           "parameters": {"type": "object", "properties": {}}}}


def template_facts(tok) -> TemplateFacts:
    """The :class:`TemplateFacts` of ``tok``'s chat template (kept per template source); the built-in
    formats (no template in the file) render no tools and declare no reasoning."""
    source = tok.chat_template
    if not source:
        return TemplateFacts()
    with _FACTS_LOCK:
        hit = _FACTS.get(source)
    if hit is not None:
        return hit
    probe = [{"role": "user", "content": "hi"}]
    try:
        renders_tools = "zq_probe_fn" in tok._render(probe, True, [_PROBE]) and \
            "zq_probe_fn" not in tok._render(probe, True)
    except ValueError:                               # the template refuses tools or this probe
        renders_tools = False
    syntax = None
    if renders_tools:
        if "<tool_call>" in source:
            syntax = SYNTAXES["hermes"]
        elif "[TOOL_CALLS]" in source:
            syntax = SYNTAXES["mistral"]
        elif "<|start_header_id|>" in source and "parameters" in source:
            syntax = SYNTAXES["llama3"]
    think = next((m for m in THINK_MARKERS if m[0] in source and m[1] in source), None)
    facts = TemplateFacts(syntax=syntax, think=think,
                          reads=frozenset(v for v in ("enable_thinking", "reasoning_effort") if v in source))
    with _FACTS_LOCK:
        if len(_FACTS) >= 16:
            _FACTS.pop(next(iter(_FACTS)))
        _FACTS[source] = facts
    return facts


def think_mode(facts: TemplateFacts, prompt: str) -> str:
    """How a reply to ``prompt`` may reason: "none" (the template has no markers, or the prompt closes the
    block itself, as Qwen3's ``enable_thinking: false``), "open" (the prompt ends inside a think block) or
    "optional" (the reply may open one)."""
    if facts.think is None:
        return "none"
    tail = prompt.rstrip()
    if tail.endswith(facts.think[0]):
        return "open"
    return "none" if tail.endswith(facts.think[1]) else "optional"


@dataclass(frozen=True)
class ReadSpec:
    """How to read one request's replies: ``think`` ("none" | "optional" | "open") with ``markers``
    (open, close); ``calls`` ("none" | "auto" | "call") in ``syntax``; ``keep``: the control-token ids of
    those markers, whose strings the engine writes into the reply's text so that they can be read here
    (``Job.show_special``)."""

    think: str = "none"
    markers: tuple | None = None
    calls: str = "none"
    syntax: Syntax = SYNTAXES["json"]
    keep: frozenset = frozenset()

    def marker_texts(self) -> tuple:
        """The marker strings this reading looks for: the think markers, the calls' start (and Hermes'
        ``</tool_call>``)."""
        out = tuple(self.markers) if self.think != "none" and self.markers else ()
        if self.calls != "none":
            out += (self.syntax.start,) + (("</tool_call>",) if self.syntax.name == "hermes" else ())
        return out

    def with_keep(self, tok) -> "ReadSpec":
        """This spec with ``keep`` set for ``tok``: the ids of its markers that are control tokens there
        (user-defined ones, Qwen3's ``<think>``, are text already); unchanged when ``tok`` is None."""
        if tok is None:
            return self
        ids = (marker_token(tok, m) for m in self.marker_texts())
        return replace(self, keep=frozenset(i for i in ids if i is not None and i in tok.special_ids))


def marker_token(tok, text: str) -> int | None:
    """The id of the vocabulary entry of ``tok`` that is exactly the marker ``text``, or None."""
    i = tok.hf.token_to_id(text)
    return None if i is None or not 0 <= i < tok.vocab_size else int(i)


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


_NAME_KEY = re.compile(r'\{\s*"name"\s*:')
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:')


class CallScanner:
    """Finds the calls in the calls' text as it grows: each call object's name, and the text of its
    arguments as far as it has come, so that both can be streamed before the call is whole.

    A call object ``{"name": N, "arguments": {...}}`` (``"parameters"`` for Llama-3) opens at the list's
    nesting depth (1 inside Mistral's array, else 0); the grammar writes ``name`` first, as the call
    schema lists it (llguidance keeps a schema's property order), so the name is known once the
    arguments' key is read. An object that begins otherwise is left to be read whole at the end.
    """

    def __init__(self, syntax: Syntax):
        self.base = 1 if syntax.name == "mistral" else 0
        self.pos = self.depth = 0
        self.in_string = self.escape = False
        self.calls: list = []                        # per call: index, start, phase, sent; id, name, args, end
        self.open: dict | None = None                # the call object being read

    def feed(self, text: str) -> list:
        """New pieces of ``text`` (all the calls' text so far, which only grows): ("call", entry) when a
        call's name is known, ("args", (index, fragment)) for each new stretch of its arguments."""
        out = []
        for i in range(self.pos, len(text)):
            self._char(text, i, out)
        self.pos = len(text)
        c = self.open
        if c is not None and c["phase"] == "args" and c["sent"] < self.pos:
            out.append(("args", (c["index"], text[c["sent"]:self.pos])))
            c["sent"] = self.pos
        return out

    def _char(self, text: str, i: int, out: list) -> None:
        ch = text[i]
        if self.in_string:
            self.escape, self.in_string = (False, True) if self.escape else (ch == "\\", ch != '"')
            return
        c = self.open
        if c is not None and c["phase"] == "await" and not ch.isspace():
            c.update(phase="args", args=i, sent=i)   # the arguments' first character
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            if ch == "{" and self.depth == self.base and c is None:
                self.open = c = {"index": len(self.calls), "start": i, "phase": "head", "sent": 0}
                self.calls.append(c)
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if c is not None and c["phase"] == "args" and self.depth == self.base + 1:
                self._close_args(text, c, i + 1, out)
            if c is not None and self.depth == self.base:
                self.open = None
        elif ch == ":" and c is not None and c["phase"] == "head" and self.depth == self.base + 1:
            c["colons"] = c.get("colons", 0) + 1     # the first ends "name", the second the arguments' key
            m = (_NAME_KEY if c["colons"] == 1 else _CALL_HEAD).fullmatch(text, c["start"], i + 1)
            if m is None:
                c["phase"] = "whole"                 # not name-first: read whole at the end
            elif c["colons"] == 2:
                c.update(phase="await", name=m.group(1), id="call_" + uuid.uuid4().hex[:24])
                out.append(("call", {"index": c["index"], "id": c["id"], "name": c["name"]}))
        elif ch == "," and c is not None and c["phase"] == "args" and self.depth == self.base + 1:
            self._close_args(text, c, i, out)       # an argument that is no object (never, with the grammar)

    @staticmethod
    def _close_args(text: str, c: dict, end: int, out: list) -> None:
        c.update(phase="done", end=end)
        if c["sent"] < end:
            out.append(("args", (c["index"], text[c["sent"]:end])))
            c["sent"] = end

    def arguments(self, k: int, text: str) -> str | None:
        """The text of call k's arguments once read to their end, else None."""
        c = self.calls[k] if k < len(self.calls) else {}
        return text[c["args"]:c["end"]] if c.get("phase") == "done" else None


class Reader:
    """Splits one reply into reasoning, content and tool calls as its text arrives.

    :meth:`push` returns the pieces that are certain so far: ("reasoning" | "text", text), and, once the
    calls began, ("call", {"index", "id", "name"}) when a call's name is known and ("args", (index,
    fragment)) as its arguments come (:class:`CallScanner`; ``streamed`` false: none before the end); a
    possible marker's beginning is held until it is known. :meth:`end` returns the last pieces and the
    calls (OpenAI ``tool_calls`` entries whose ids are those announced and whose ``arguments`` are the
    reply's own text of them, so that the streamed fragments join to them; or None: text that was no
    whole call goes out as text, unless some of it was already streamed as a call, cut short). Pushing
    a reply in any cut gives the same pieces joined.
    """

    def __init__(self, spec: ReadSpec, streamed: bool = True):
        self.spec, self.streamed = spec, streamed
        self.state = {"none": "content", "optional": "lead", "open": "think"}[spec.think]
        self.buf = ""
        self.free = spec.calls == "none"             # content goes out as it comes: no call can follow
        self.held = "" if spec.calls == "call" else None   # the calls' text, once they began
        self.scanner = CallScanner(spec.syntax)

    def push(self, text: str) -> list:
        self.buf += text
        out = []
        while True:
            before = (self.state, len(self.buf))
            self._step(out)
            if (self.state, len(self.buf)) == before:
                if self.held is not None and self.streamed:
                    out += self.scanner.feed(self.held)
                return [p for p in out if p[1]]

    def _step(self, out: list) -> None:
        opening, closing = self.spec.markers or ("", "")
        if self.state == "lead":                     # undecided: may open a think block
            s = self.buf.lstrip()
            if s.startswith(opening):
                self.buf, self.state = s[len(opening):], "think"
            elif s and not opening.startswith(s):
                self.state = "content"
        elif self.state == "think":
            i = self.buf.find(closing)
            if i >= 0:
                out.append(("reasoning", self.buf[:i]))
                self.buf, self.state = self.buf[i + len(closing):], "after"
            else:
                k = _partial(self.buf, closing)
                out.append(("reasoning", self.buf[:len(self.buf) - k]))
                self.buf = self.buf[len(self.buf) - k:]
        elif self.state == "after":                  # the whitespace after the block is no content
            self.buf = self.buf.lstrip()
            if self.buf:
                self.state = "content"
        elif self.held is not None:
            self.held += self.buf
            self.buf = ""
        elif self.free:
            out.append(("text", self.buf))
            self.buf = ""
        else:
            self._content(out)

    def _content(self, out: list) -> None:
        start = self.spec.syntax.start
        if self.spec.syntax.anywhere:                # content, then maybe calls
            i = self.buf.find(start)
            if i >= 0:
                out.append(("text", self.buf[:i]))
                self.held, self.buf = self.buf[i:], ""
            else:
                k = _partial(self.buf, start)
                out.append(("text", self.buf[:len(self.buf) - k]))
                self.buf = self.buf[len(self.buf) - k:]
            return
        s = self.buf.lstrip()                        # the reply is calls or text: its start decides
        if s.startswith(start):
            self.held, self.buf = self.buf, ""
        elif s and not start.startswith(s):
            self.free = True

    def end(self) -> tuple:
        """(the last pieces, the calls or None)."""
        out = []
        if self.state == "think":
            out.append(("reasoning", self.buf))
        elif self.buf:
            out.append(("text", self.buf))
        self.buf = ""
        if self.held is None:
            return [p for p in out if p[1]], None
        out += self.scanner.feed(self.held)
        calls = self.spec.syntax.parse(self.held.strip()) if self.held.strip().startswith(
            self.spec.syntax.start) else None
        if calls is None:
            if not (self.streamed and any(c.get("id") for c in self.scanner.calls)):   # none streamed
                out.append(("text", self.held))
            return [p for p in out if p[1]], None
        entries = []
        for k, (name, args) in enumerate(calls):
            c = self.scanner.calls[k] if k < len(self.scanner.calls) else {}
            raw = self.scanner.arguments(k, self.held)
            if c.get("id") is None or c.get("name") != name or raw is None or _loads(raw) != args:
                c = {"id": "call_" + uuid.uuid4().hex[:24]}    # not streamed: announced and sent whole now
                raw = json.dumps(args)
                out += [("call", {"index": k, "id": c["id"], "name": name}), ("args", (k, raw))]
            entries.append({"id": c["id"], "type": "function", "function": {"name": name, "arguments": raw}})
        return [p for p in out if p[1]], entries


def read_whole(text: str, spec: ReadSpec) -> tuple:
    """(reasoning, content, calls or None) of a finished reply."""
    r = Reader(spec, streamed=False)
    pieces = r.push(text)
    more, calls = r.end()
    pieces += more
    return ("".join(t for k, t in pieces if k == "reasoning"), "".join(t for k, t in pieces if k == "text"),
            calls)
