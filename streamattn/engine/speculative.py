"""Exact speculative decoding: a proposer drafts the next tokens, one forward checks them all.

A decode step on the CPU reads every weight once for one token; verifying k drafted tokens reads them
once for k + 1. The engine feeds ``[last token] + draft`` as one chunk, takes the logits of every
position, keeps the longest prefix the sampling rule accepts plus the model's own next token, and
rewinds the rest out of every layer's cache (``state.rewind``). Because a query's logits have the same
bits whatever chunk computes them on the CPU (docs/DESIGN.md §5), greedy speculation yields exactly the
tokens of plain decoding. With temperature > 0 the accept/reject rule of Leviathan et al. (2023) and
Chen et al. (2023) keeps the output distribution exactly that of plain sampling (:func:`verify`).

Proposers implement ``propose(tokens, k) -> list``; :class:`NgramProposer` is prompt lookup (the most
recent earlier occurrence of the context's last n tokens, n from ``n_max`` down to ``n_min``, as
llama.cpp's ``ngram-simple`` and vLLM's ``ngram``). :class:`DraftLength` adapts how many tokens are
drafted to how many were accepted, and stops drafting for a while after misses, so that text with
nothing to copy runs as plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamattn.engine.sampling import SamplingParams, filtered_probs, sample

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpecParams:
    """How a sequence speculates.

    Parameters
    ----------
    method : {"ngram"}
        Prompt lookup over the sequence's own prompt and output.
    draft_max : int
        Drafted tokens per step at most (the chunk is ``draft_max + 1`` tokens; it must fit the caches'
        ``max_chunk``, so that every rewind of a window ring is allowed).
    n_min, n_max : int
        Lengths of the context suffix looked up, tried longest first.
    """

    method: str = "ngram"
    draft_max: int = 8
    n_min: int = 2
    n_max: int = 4

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS} (got {self.method!r})")
        for name in ("draft_max", "n_min", "n_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {v!r})")
        if self.n_min > self.n_max:
            raise ValueError(f"n_min must be <= n_max (got {self.n_min} > {self.n_max})")


class NgramProposer:
    """Prompt lookup: draft the tokens that followed the most recent earlier occurrence of the last n
    tokens of the context (n = ``n_max`` .. ``n_min``, longest first)."""

    def __init__(self, params: SpecParams):
        self.n_min, self.n_max = params.n_min, params.n_max

    def propose(self, tokens, k: int) -> list:
        """Up to ``k`` drafted token ids following ``tokens`` (the whole context; [] when nothing matches)."""
        t = np.asarray(tokens, np.int64)
        L = t.shape[0]
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            suffix = t[L - n:]
            # windows [i, i + n) for i in 0 .. L - n - 1 (the suffix itself excluded), most recent first
            win = np.lib.stride_tricks.sliding_window_view(t[:L - 1], n)          # [L - n, n]
            hit = np.nonzero((win == suffix).all(axis=1))[0]
            if hit.size:
                i = int(hit[-1]) + n                                              # first token after it
                return t[i:i + k].tolist()
        return []


class DraftLength:
    """How many tokens to draft next: doubles after a fully accepted draft, drops to one more than was
    accepted after a partial one, and after two drafts in a row with nothing accepted pauses drafting for
    a number of steps that doubles with each such pause (up to 32), so text with nothing to copy costs
    almost nothing."""

    def __init__(self, draft_max: int):
        self.max, self.k, self.misses, self.pause, self.wait = draft_max, draft_max, 0, 1, 0

    def next(self) -> int:
        """Tokens to draft this step (0: decode plainly)."""
        if self.wait > 0:
            self.wait -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.k, self.misses, self.pause = min(self.max, 2 * self.k), 0, 1
        elif accepted > 0:
            self.k, self.misses = max(1, accepted + 1), 0
        else:
            self.k, self.misses = 1, self.misses + 1
            if self.misses >= 2:
                self.wait, self.pause, self.misses = self.pause, min(32, 2 * self.pause), 0


def make_proposer(params: SpecParams):
    """The proposer for ``params.method``."""
    return NgramProposer(params)


def verify(rows, draft: list, params: SamplingParams, rng: np.random.Generator, prepare) -> list:
    """The tokens one verify step yields: the accepted prefix of ``draft`` and one token of the model's.

    Parameters
    ----------
    rows : float32 [len(draft) + 1, vocab]
        Logits after the last token and after each drafted token.
    draft : list of int
    params : SamplingParams
    rng : numpy Generator of the sequence
    prepare : callable(i, logits) -> logits
        Applies the sequence's processors (repetition penalty context, logits processors) to row ``i``
        given that ``draft[:i]`` was accepted.

    Returns
    -------
    list of int, 1 .. len(draft) + 1 tokens: ``draft[:a]`` then the model's own token.

    Greedy: a drafted token is accepted iff it is the argmax, so the result is exactly what plain decoding
    yields. Sampling: the draft is a point mass q = 1 on token x, so x is accepted with probability
    min(1, p(x) / q(x)) = p(x); on rejection the token is drawn from max(0, p - q), i.e. p without x,
    renormalised; after a full acceptance from p itself. Each output token is then distributed exactly
    as p (Leviathan et al. 2023, Theorem 1).
    """
    out = []
    for i, x in enumerate(draft):
        z = prepare(i, rows[i])
        if params.greedy:
            t = int(np.argmax(z))
            if t != x:
                return out + [t]
        else:
            p = filtered_probs(z, params)
            if rng.random() >= p[x]:                             # rejected: draw from p without x
                p = p.copy()
                p[x] = 0.0
                return out + [int(rng.choice(p.shape[0], p=p / p.sum()))]
        out.append(int(x))
    z = prepare(len(draft), rows[len(draft)])
    return out + [sample(z, params, rng)]


def add_arguments(p) -> None:
    """``--speculative ngram`` and ``--draft-max K`` (generate, batch and serve)."""
    p.add_argument("--speculative", choices=METHODS, default=None,
                   help="draft tokens by prompt lookup and verify them in one step (same greedy tokens)")
    p.add_argument("--draft-max", type=int, default=SpecParams.draft_max,
                   help=f"drafted tokens per step at most with --speculative (default {SpecParams.draft_max})")


def from_args(args) -> SpecParams | None:
    """The :class:`SpecParams` of the flags of :func:`add_arguments` (None without ``--speculative``)."""
    if args.draft_max < 1:
        raise ValueError(f"--draft-max must be >= 1 (got {args.draft_max})")
    return SpecParams(method=args.speculative, draft_max=args.draft_max) if args.speculative else None
