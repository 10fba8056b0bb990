"""Constrained decoding with llguidance: JSON schemas (and Lark grammars) enforced on every token.

:class:`Grammars` belongs to one tokenizer: it builds llguidance's tokenizer once and compiles each
distinct schema once (a cache keyed by the schema's canonical JSON). A compiled :class:`Grammar` goes on a
:class:`~streamattn.engine.sequence.Job`; the sequence then holds a :class:`Constraint`, an llguidance
matcher that masks the logits before every draw (disallowed tokens get -inf, so greedy and sampling can
only pick allowed ones) and is advanced by every token the sequence takes, drafted ones included.

A schema llguidance cannot compile, or that uses a keyword it does not enforce, raises
:class:`GrammarError` naming it: nothing is ever decoded unconstrained in its place.

>>> g = Grammars(tok).json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})  # doctest: +SKIP
>>> gen.generate("Give me JSON", grammar=g)                                                      # doctest: +SKIP
'{"a": 3}'
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import numpy as np


class GrammarError(ValueError):
    """A schema or grammar that cannot be enforced exactly; the message names what and why."""


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
        with self._lock:
            if len(self._cache) >= 256:                      # bounded: drop the oldest
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = g
        return g


class Constraint:
    """One sequence's matcher: masks logits, takes tokens, rolls back drafted ones it tried."""

    def __init__(self, grammar: Grammar, vocab: int):
        from llguidance import LLMatcher
        from llguidance.numpy import allocate_token_bitmask
        self.matcher = LLMatcher(grammar.lltok, grammar.text)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be enforced: {self.matcher.get_error()}")
        self.vocab = vocab
        self.n = grammar.lltok.vocab_size
        self.bits = allocate_token_bitmask(1, self.n)                       # [1, ceil(n / 32)] int32

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next."""
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(self.matcher, self.bits, 0)
        ok = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:self.n].astype(bool)
        if self.vocab > self.n:                                             # ids past the tokenizer's
            ok = np.concatenate([ok, np.zeros(self.vocab - self.n, bool)])
        return ok[:self.vocab]

    def mask(self, logits, extra=()) -> np.ndarray:
        """``logits`` [vocab] with every token the grammar forbids set to -inf, in the state after the
        taken tokens and then ``extra`` (drafted tokens being verified; rolled back afterwards)."""
        extra = list(extra)
        if extra and not self.matcher.consume_tokens(extra):
            self.matcher.rollback(len(extra))
            return np.full(self.vocab, -np.inf, np.float32)                # unreachable state
        ok = self.allowed()
        if extra:
            self.matcher.rollback(len(extra))
        out = np.array(logits, np.float32, copy=True)
        out[~ok] = -np.inf
        return out

    def take(self, token_id: int) -> None:
        """Advance by a taken token; GrammarError if the grammar forbade it (never after :meth:`mask`)."""
        if not self.matcher.consume_token(int(token_id)):
            raise GrammarError(f"token {token_id} is not allowed by the grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar has finished: no token may follow."""
        return self.matcher.is_stopped()
