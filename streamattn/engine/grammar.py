"""Constrained decoding with llguidance: JSON schemas (and Lark grammars) enforced on every token.

:class:`Grammars` belongs to one tokenizer: it builds llguidance's tokenizer once and compiles each
distinct schema once (a cache keyed by the schema's canonical JSON). A compiled :class:`Grammar` goes on a
:class:`~streamattn.engine.sequence.Job`; the sequence then holds a :class:`Constraint`, an llguidance
matcher that masks the logits before every draw (disallowed tokens get -inf, so greedy and sampling can
only pick allowed ones) and is advanced by every token the sequence takes, drafted ones included.

A schema llguidance cannot compile, that uses a keyword it does not enforce, or that admits no finite
document (:func:`streamattn.engine.schema_finite.finite_documents`), raises :class:`GrammarError` naming it:
nothing is ever decoded unconstrained in its place. Every compiled grammar is probed once (a matcher's first
mask must allow some token). A grammar that still cannot go on while decoding (llguidance's parser limits)
ends that one sequence with a one-line error. Error messages are one line of at most :data:`MAX_MESSAGE`
characters and never quote the schema or the generated text.

>>> g = Grammars(tok).json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})  # doctest: +SKIP
>>> gen.generate("Give me JSON", grammar=g)                                                      # doctest: +SKIP
'{"a": 3}'
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

import numpy as np
from numba import njit

from streamattn.runtime import kernel_cache

kernel_cache.register(__name__)    # (its mask kernel calls only its own code)

MAX_MESSAGE = 300              # characters of a grammar error, on one line


class GrammarError(ValueError):
    """A schema or grammar that cannot be enforced exactly; the message (one line, bounded) names what
    and why."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


def one_line(message: str, limit: int = MAX_MESSAGE) -> str:
    """The first line of ``message`` (llguidance appends its parser state and the grammar on later lines),
    cut to ``limit`` characters."""
    first = str(message).strip().split("\n", 1)[0].strip()
    return first if len(first) <= limit else first[:limit - 3] + "..."


def check_schema(schema) -> None:
    """Refuse (GrammarError) a JSON schema that admits no finite document."""
    from streamattn.engine.schema_finite import finite_documents
    try:
        finite = finite_documents(schema)
    except RecursionError:
        raise GrammarError("the JSON schema is nested too deeply to check") from None
    if not finite:
        raise GrammarError("the JSON schema admits no finite document: every value it allows must contain "
                           "another (a required property or minItems >= 1 whose schema refers back to it, or "
                           "a $ref cycle with no content); give the recursion a way out, e.g. make the "
                           "property optional")


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled constraint: llguidance grammar text for one tokenizer.

    kind : "json_schema" | "json_object" | "lark"; text : the llguidance grammar; lltok : its tokenizer.
    """

    kind: str
    text: str
    lltok: object

    def constraint(self, vocab: int) -> "Constraint":
        """A fresh matcher over logits of ``vocab`` entries."""
        return Constraint(self, vocab)


class Grammars:
    """Compiles and caches grammars for one :class:`~streamattn.text.tokenizer.Tokenizer` (thread-safe)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._lltok = None
        self._cache: dict = {}
        self._lock = threading.Lock()

    @property
    def lltok(self):
        """llguidance's tokenizer of these token ids (built on first use: ~1 s for a 49k vocabulary)."""
        with self._lock:
            if self._lltok is None:
                from llguidance import LLTokenizer
                self._lltok = LLTokenizer(self.tok.hf.to_str(), n_vocab=self.tok.vocab_size,
                                          eos_token=sorted(self.tok.stop_ids))
            return self._lltok

    def json_schema(self, schema) -> Grammar:
        """The grammar of JSON documents valid against ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object (got {type(schema).__name__})")
        check_schema(schema)
        return self._compile("json_schema", json.dumps(schema))          # property order is meaningful

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return self._compile("json_schema", json.dumps({"type": "object"}), kind="json_object")

    def lark(self, grammar: str) -> Grammar:
        """A Lark grammar in llguidance's dialect."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("a Lark grammar must be a non-empty string")
        return self._compile("lark", grammar)

    def _compile(self, how: str, source: str, kind: str | None = None) -> Grammar:
        from llguidance import LLMatcher
        key = (how, source)
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        try:
            text = (LLMatcher.grammar_from_json_schema(source, defaults={"whitespace_flexible": False})
                    if how == "json_schema" else LLMatcher.grammar_from_lark(source))
        except (ValueError, TypeError) as e:
            raise GrammarError(f"cannot compile the {how.replace('_', ' ')}: {e}") from None
        bad, msgs = LLMatcher.validate_grammar_with_warnings(text, self.lltok)
        if bad:
            raise GrammarError(f"the {how.replace('_', ' ')} cannot be enforced: {msgs[0]}")
        g = Grammar(kind=kind or how, text=text, lltok=self.lltok)
        try:                                                 # the probe: its first token must exist
            if not g.constraint(self.lltok.vocab_size).allowed().any():
                raise GrammarError("no first token is allowed")
        except GrammarError as e:
            raise GrammarError(f"the {how.replace('_', ' ')} matches no text: {e}") from None
        with self._lock:
            if len(self._cache) >= 256:                      # bounded: drop the oldest
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = g
        return g


@njit(cache=True)
def _masked(logits, bits, n):
    """A copy of ``logits`` [vocab] with -inf where bit i of ``bits`` (int32 words, llguidance's layout:
    token i is bit i % 32 of word i // 32) is clear, and for ids >= n (past the tokenizer's vocabulary)."""
    out = np.empty_like(logits)
    for i in range(logits.shape[0]):
        if i < n and (bits[i >> 5] >> (i & 31)) & 1:
            out[i] = logits[i]
        else:
            out[i] = -np.inf
    return out


class ResponseFormatError(GrammarError):
    """A ``response_format`` (or tool definition) that is malformed or cannot be enforced; ``param``
    names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def check_response_format(fmt):
    """The shape of an OpenAI ``response_format``, checked without compiling: ("text", None),
    ("json_object", None) or ("json_schema", schema); ResponseFormatError naming the field otherwise."""
    if fmt is None:
        return "text", None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ResponseFormatError("response_format must be an object with a 'type'", "response_format")
    kind = fmt["type"]
    if kind in ("text", "json_object"):
        return kind, None
    if kind != "json_schema":
        raise ResponseFormatError(f"response_format.type must be 'text', 'json_object' or 'json_schema' (got "
                                  f"{kind[:40]!r})", "response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ResponseFormatError("response_format.json_schema must be an object with 'name' and 'schema'",
                                  "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ResponseFormatError("response_format.json_schema.name must be 1..64 characters of a-z, A-Z, 0-9, "
                                  f"_ and - (got {str(name)[:40]!r})", "response_format.json_schema.name")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ResponseFormatError("response_format.json_schema.schema must be a JSON schema object",
                                  "response_format.json_schema.schema")
    return kind, schema


def response_format_grammar(fmt, grammars):
    """The Grammar of ``response_format`` (None for ``{"type": "text"}`` or absent)."""
    kind, schema = check_response_format(fmt)
    if kind == "text":
        return None
    if kind == "json_object":
        return grammars.json_object()
    try:
        return grammars.json_schema(schema)
    except GrammarError as e:
        raise ResponseFormatError(f"response_format.json_schema.schema: {e}", "response_format.json_schema.schema")


class Constraint:
    """One sequence's matcher: masks logits, takes tokens, rolls back drafted ones it tried."""

    def __init__(self, grammar: Grammar, vocab: int):
        from llguidance import LLMatcher
        from llguidance.numpy import allocate_token_bitmask
        self.matcher = LLMatcher(grammar.lltok, grammar.text, log_level=0)     # errors come back here
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be enforced: {self.matcher.get_error()}")
        self.vocab = vocab
        self.n = grammar.lltok.vocab_size
        self.bits = allocate_token_bitmask(1, self.n)                       # [1, ceil(n / 32)] int32

    def _fill(self) -> None:
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(self.matcher, self.bits, 0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot go on: {self.matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next."""
        self._fill()
        return np.isfinite(_masked(np.zeros(self.vocab, np.float32), self.bits[0], self.n))

    def mask(self, logits, extra=()) -> np.ndarray:
        """``logits`` [vocab] with every token the grammar forbids set to -inf (a new array), in the state
        after the taken tokens and then ``extra`` (drafted tokens being verified; rolled back afterwards)."""
        extra = list(extra)
        if extra and not self.matcher.consume_tokens(extra):
            self.matcher.rollback(len(extra))
            return np.full(self.vocab, -np.inf, np.float32)                # unreachable state
        self._fill()
        if extra:
            self.matcher.rollback(len(extra))
        out = _masked(np.asarray(logits, np.float32), self.bits[0], self.n)
        if not extra and not np.isfinite(out).any():
            raise GrammarError("the grammar allows no next token here")
        return out

    def take(self, token_id: int) -> None:
        """Advance by a taken token; GrammarError if the grammar forbade it (never after :meth:`mask`)."""
        if not self.matcher.consume_token(int(token_id)):
            raise GrammarError(f"token {token_id} is not allowed by the grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar has finished: no token may follow."""
        return self.matcher.is_stopped()
