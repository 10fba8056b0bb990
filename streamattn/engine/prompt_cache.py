"""Prompt cache: a token trie of saved sequence states, least recently used evicted under a byte budget.

Each entry is one sequence's cache state (one batch-1 ``KVCache`` per layer, copied out of an engine
slot with :func:`streamattn.kv.state.fork`) keyed by the tokens it has seen. A new request takes the entry
sharing the longest prefix with its prompt, forks it into its slot and rewinds it to that prefix, so
only the rest of the prompt is prefilled.

Which prefixes a ring can serve exactly: a causal cache can be rewound anywhere, so any common prefix is
reusable. A window (or sinks) cache that has wrapped no longer holds its oldest keys; rewinding it from
the entry's length M to L is exact only when the keys the query at L needs are still in the ring, which
is :func:`streamattn.kv.state.rewind`'s rule (for a ring filled by appends alone: M <= slots, or
M - L <= max_chunk, or L <= sinks). Entries that fail it are not used. docs/DESIGN.md §25 says why.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from streamattn.kv import state


@dataclass(eq=False)
class _Node:
    children: dict = field(default_factory=dict)     # token id -> _Node
    parent: "_Node | None" = None
    token: int = -1
    entry: "_Entry | None" = None


@dataclass(eq=False)
class _Entry:
    node: _Node
    length: int                                      # tokens the saved state has seen
    caches: list                                     # one batch-1 KVCache per layer
    nbytes: int
    used: int = 0                                    # LRU clock of the last hit or store


@dataclass(frozen=True)
class Hit:
    """A reusable prefix: ``tokens`` of the prompt are already in ``caches`` (after the rewind)."""

    tokens: int
    entry: _Entry


class PromptCache:
    """Token trie of saved sequence states with LRU eviction under ``budget_bytes``.

    Parameters
    ----------
    budget_bytes : int
        Bytes of K/V the entries may hold together (0 = the cache stores nothing).
    new_caches : callable() -> list of KVCache
        Makes empty batch-1 caches with the engine caches' spec (the entries' storage).
    """

    def __init__(self, budget_bytes: int, new_caches):
        self.budget = int(budget_bytes)
        self.new_caches = new_caches
        self.root = _Node()
        self.entries: list = []
        self.nbytes = 0
        self._clock = 0
        self._lock = threading.Lock()

    def __len__(self):
        return len(self.entries)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def lookup(self, tokens: list, *, caches: list, slot: int) -> int:
        """Load the longest reusable prefix of ``tokens`` into ``slot`` of ``caches``; return its length.

        At most ``len(tokens) - 1`` tokens are reused: the last prompt token is always run, since its
        logits give the first new token. 0 means nothing was loaded (the slot is untouched).
        """
        with self._lock:
            hit = self._best(tokens)
            if hit is None:
                return 0
            for src, dst in zip(hit.entry.caches, caches):
                state.fork(src, 0, slot, into=dst)
                state.rewind(dst, slot, hit.entry.length - hit.tokens)
            hit.entry.used = self._tick()
            return hit.tokens

    def _best(self, tokens: list) -> Hit | None:
        limit = len(tokens) - 1
        node, depth = self.root, 0
        path = []                                    # (depth, node) along the prompt
        while depth < limit and tokens[depth] in node.children:
            node = node.children[tokens[depth]]
            depth += 1
            path.append(node)
        best = None
        # entries on the path hold a prefix of the prompt whole (no rewind); entries below the deepest
        # node share ``depth`` tokens and need a rewind by their extra tokens
        for d, n in reversed(list(enumerate(path, 1))):
            if n.entry is not None and (best is None or d > best.tokens):
                best = Hit(d, n.entry)
                break
        if best is not None and best.tokens == depth:
            return best
        for e in _entries_below(node):
            if self._can_rewind(e, e.length - depth):
                return Hit(depth, e)
        return best

    @staticmethod
    def _can_rewind(e: _Entry, k: int) -> bool:
        return all(state.can_rewind(c, 0, k) for c in e.caches)

    def store(self, tokens: list, *, caches: list, slot: int) -> bool:
        """Save ``slot``'s state (which has seen exactly ``tokens``) as an entry; False if it did not fit."""
        if self.budget <= 0 or not tokens:
            return False
        with self._lock:
            node = self.root
            for t in tokens:
                nxt = node.children.get(t)
                if nxt is None:
                    nxt = node.children[t] = _Node(parent=node, token=t)
                node = nxt
            if node.entry is not None:
                node.entry.used = self._tick()
                return True
            saved = self.new_caches()
            for src, dst in zip(caches, saved):
                state.fork(src, slot, 0, into=dst)
            nbytes = sum(c.nbytes for c in saved)
            if nbytes > self.budget:
                self._prune(node)
                return False
            while self.nbytes + nbytes > self.budget:
                self._evict(min(self.entries, key=lambda e: e.used))
            e = _Entry(node=node, length=len(tokens), caches=saved, nbytes=nbytes, used=self._tick())
            node.entry = e
            self.entries.append(e)
            self.nbytes += nbytes
            return True

    def _evict(self, e: _Entry) -> None:
        self.entries.remove(e)
        self.nbytes -= e.nbytes
        e.node.entry = None
        self._prune(e.node)

    @staticmethod
    def _prune(node: _Node) -> None:
        while node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.token]
            node = node.parent


def _entries_below(node: _Node):
    """Entries in the subtree of ``node``, nearest (shortest) first."""
    level = [node]
    while level:
        nxt = []
        for n in level:
            if n.entry is not None:
                yield n.entry
            nxt.extend(n.children.values())
        level = nxt
