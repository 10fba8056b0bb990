"""How much a reply reasons: the budget that closes its think block, and the count of its reasoning tokens.

A reply's think block (``output.ReadSpec``: ``think`` "optional", opened by the reply's first
non-blank text, or "open", opened by the prompt) holds its reasoning tokens: every token up to and
including the closing marker (the opening marker too, when the reply writes it), and all of them when the
reply ends inside the block. ``usage.completion_tokens_details.reasoning_tokens`` counts them
(:func:`reasoning_tokens`).

A budget of N (``thinking_token_budget``, Anthropic's ``thinking.budget_tokens``) lets the block hold N
tokens after its opening marker; then :class:`ReasoningBudget` forces the closing marker's tokens, one a
step, and the reply goes on after the block as the grammar allows (llama.cpp's reasoning budget and
vLLM's ``thinking_token_budget`` end the block the same way, by forcing its end).
"""

from __future__ import annotations

import numpy as np


def _opened(tok, read, ids) -> int | None:
    """The number of tokens of ``ids`` up to the end of the opening marker (0 when the prompt opened the
    block), or None when the reply opens no block (or has not shown yet whether it will)."""
    if read.think == "open":
        return 0
    opening = read.markers[0]
    text = tok.decode(ids, skip_special=False).lstrip()
    if not text.startswith(opening):
        return None
    lo, hi = 1, len(ids)                            # the first prefix that holds the whole marker
    while lo < hi:
        mid = (lo + hi) // 2
        if tok.decode(ids[:mid], skip_special=False).lstrip().startswith(opening):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _closed(tok, read, ids, start: int) -> int | None:
    """The number of tokens of ``ids`` up to the end of the closing marker of the block that begins
    after token ``start``, or None while it is open."""
    closing = read.markers[1]
    head = len(tok.decode(ids[:start], skip_special=False))
    if tok.decode(ids, skip_special=False).find(closing, head) < 0:
        return None
    lo, hi = start + 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if tok.decode(ids[:mid], skip_special=False).find(closing, head) >= 0:
            hi = mid
        else:
            lo = mid + 1
    return lo


def reasoning_tokens(tok, read, ids) -> int:
    """How many of a finished reply's token ids ``ids`` are its think block's (see the module's text),
    read as ``read`` (an ``output.ReadSpec``); 0 when the reply cannot reason or did not."""
    ids = list(ids)
    if read.think == "none" or not read.markers or not ids:
        return 0
    start = _opened(tok, read, ids)
    if start is None:
        return 0
    end = _closed(tok, read, ids, start)
    return len(ids) if end is None else end


class ReasoningBudget:
    """A logits processor (``Job.logits_processors``) that closes the reply's think block once it holds
    ``budget`` tokens after its opening marker: from then on only the next token of the closing marker
    (``tok``'s encoding of ``read.markers[1]``, a control token's id where it is one) keeps a logit, until
    the marker is whole. ``prompt_len``: the prompt's tokens at the head of the ids it is given.

    It looks at the reply only once it is ``budget`` tokens long (a shorter one cannot have spent the
    budget), and remembers a reply prefix that settled the question (the block closed, or never opened).
    """

    def __init__(self, *, tok, read, budget: int, prompt_len: int):
        if read.think == "none" or not read.markers:
            raise ValueError("a reasoning budget needs a reply that may reason (read.think 'optional' or 'open')")
        self.tok, self.read, self.budget, self.prompt_len = tok, read, int(budget), int(prompt_len)
        self.closing = tok.encode(read.markers[1], add_bos=False, add_eos=False)   # a raw prompt's encoding
        self.settled: list | None = None            # a reply prefix after which nothing is forced

    def __call__(self, token_ids, logits):
        reply = list(token_ids[self.prompt_len:])
        if len(reply) < self.budget or (self.settled is not None and reply[:len(self.settled)] == self.settled):
            return logits
        start = _opened(self.tok, self.read, reply)
        if start is None:
            text = self.tok.decode(reply, skip_special=False).lstrip()
            if text and not self.read.markers[0].startswith(text):   # it said something else: no block
                self.settled = reply
            return logits
        if _closed(self.tok, self.read, reply, start) is not None:
            self.settled = reply
            return logits
        spent = len(reply) - start - self.budget      # tokens past the budget: the marker's, so far
        if spent < 0:
            return logits
        k = next((k for k in range(min(spent, len(self.closing) - 1), 0, -1)
                  if reply[len(reply) - k:] == self.closing[:k]), 0)
        out = np.full(len(logits), -np.inf, np.float32)
        out[self.closing[k]] = 0.0
        return out
