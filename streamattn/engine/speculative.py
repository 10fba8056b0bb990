"""Exact speculative decoding: a proposer drafts the next tokens, one forward checks them all.

A decode step on the CPU reads every weight once for one token; verifying k drafted tokens reads them
once for k + 1. The engine feeds ``[last token] + draft`` as one chunk, takes the logits of every
position, keeps the longest prefix the sampling rule accepts plus the model's own next token, and
rewinds the rest out of every layer's cache (``state.rewind``). Because a query's logits have the same
bits whatever chunk computes them on the CPU (docs/DESIGN.md §7), greedy speculation yields exactly the
tokens of plain decoding. With temperature > 0 the accept/reject rule of Leviathan et al. (2023) and
Chen et al. (2023) would keep the output distribution that of plain sampling; :func:`verify` does more:
it draws each position's token exactly as plain decoding would (the sequence's generator, in order) and
accepts a drafted token when it is that draw, so a seeded completion has the same tokens with and without
speculation, whatever was drafted (the acceptance probability is the same, p(x)).

Proposers implement ``lookup(tokens, k) -> (draft, match)``; :class:`NgramProposer` is prompt lookup (an
earlier occurrence of the context's last n tokens, n from ``n_max`` down to ``n_min``, as llama.cpp's
``ngram-simple`` and vLLM's ``ngram``; of several, the one whose match reaches furthest back).

Whether a draft is worth its cost is :class:`DraftPolicy`'s call, made every step from what it has seen:
the engine's measured cost of a step of k + 1 rows against a step of one (:class:`StepCosts`: it differs
by model, thread count and host), the match length (longer matches are accepted more often) and the
sequence's recent acceptance at that match length. It drafts the k that maximises the expected tokens per
unit of step cost, and nothing where no k beats plain decoding by :data:`DraftPolicy.MARGIN`: after a
streak of misses the estimates fall below that within a few drafts, and the evidence fades back to the
prior over :data:`DraftPolicy.HALF_LIFE` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamattn.engine.sampling import SamplingParams, sample

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
    """Prompt lookup: draft the tokens that followed an earlier occurrence of the last n tokens of the
    context (n = ``n_max`` .. ``n_min``, longest first); of that n-gram's :data:`RECENT` latest
    occurrences, the one whose match with the context extends furthest back (up to :data:`MAX_MATCH`
    tokens), the most recent on a tie.

    When the occurrence's continuation runs into the end of the context and the match reaches back over
    it (the context's tail repeats with period p = context length - occurrence), the draft goes on round
    that period: text caught in a loop of p < ``k`` tokens still gets a ``k``-token draft.

    One proposer serves one growing context (a sequence's prompt and output): it indexes each n-gram
    once, as the context grows, so a step's lookup costs a few dictionary reads however long the context
    is. Passing the same list object each time, grown by appends only, costs nothing per token already
    indexed; any other context is compared with the one indexed, and indexed afresh when it does not
    extend it."""

    MAX_MATCH = 32
    RECENT = 8

    def __init__(self, params: SpecParams):
        self.n_min, self.n_max = params.n_min, params.n_max
        self._tokens: list = []                                 # the context indexed (the caller's list)
        self._done = 0                                          # of which its first _done tokens
        self._after: dict = {}                                  # n-gram tuple -> indices of the token after it

    def propose(self, tokens, k: int) -> list:
        """Up to ``k`` drafted token ids following ``tokens`` (the whole context; [] when nothing matches)."""
        return self.lookup(tokens, k)[0]

    def _index(self, t: list) -> None:
        done = self._done
        if t is not self._tokens or len(t) < done:              # another list: is it an extension?
            if len(t) < done or t[:done] != self._tokens[:done]:
                self._after, done = {}, 0                       # no: start over
            self._tokens = t if isinstance(t, list) else list(t)
        for i in range(max(done, self.n_min), len(t)):          # n-grams t[i - n: i], followed by t[i]
            for n in range(self.n_min, min(self.n_max, i) + 1):
                seen = self._after.setdefault(tuple(t[i - n:i]), [])
                seen.append(i)
                del seen[:-self.RECENT]
        self._done = len(t)

    def lookup(self, tokens, k: int) -> tuple:
        """(draft, match): up to ``k`` drafted ids and how many context tokens the occurrence matches
        (0 when nothing does)."""
        t = tokens if isinstance(tokens, list) else list(tokens)
        L = len(t)
        self._index(t)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            seen = self._after.get(tuple(t[L - n:]))
            if not seen:
                continue
            best, best_at = -1, -1
            for at in reversed(seen):                           # most recent first: a tie keeps it
                m = n
                while m < self.MAX_MATCH and at - 1 - m >= 0 and t[at - 1 - m] == t[L - 1 - m]:
                    m += 1
                if m > best:
                    best, best_at = m, at
            period = L - best_at
            if period < k and best >= period:                   # the tail repeats: go round it
                return [t[best_at + j % period] for j in range(k)], best
            return t[best_at:best_at + k], best
        return [], 0


class StepCosts:
    """What the engine's decode steps cost by the rows they feed, measured as they run: the median of
    the last :data:`KEEP` step times of each row count. Owned by an engine (one model, one thread
    setting); :class:`DraftPolicy` reads :meth:`ratio`. Row counts never timed are interpolated between
    timed ones, or priced at :data:`PRIOR_SLOPE` of a one-row step per extra row past the last one timed;
    a count is never priced below a smaller count timed (noise on a busy host must not make a longer
    draft look cheaper than a shorter one).
    Medians are kept up to date as times come in, so pricing a draft is a few additions."""

    KEEP = 16
    PRIOR_SLOPE = 0.2

    def __init__(self):
        self._times: dict = {}                                  # rows -> recent step seconds
        self._median: dict = {}                                 # rows -> their median
        self._timed: list = []                                  # the row counts timed, ascending

    def record(self, rows: int, seconds: float) -> None:
        """One decode step that fed ``rows`` tokens took ``seconds``."""
        rows = int(rows)
        times = self._times.setdefault(rows, [])
        times.append(float(seconds))
        del times[:-self.KEEP]
        ordered = sorted(times)
        h = len(ordered) // 2
        self._median[rows] = ordered[h] if len(ordered) % 2 else (ordered[h - 1] + ordered[h]) / 2
        if rows not in self._timed:
            self._timed = sorted(self._timed + [rows])

    def seconds(self, rows: int):
        """The median step time of ``rows`` rows (None if never timed)."""
        return self._median.get(int(rows))

    def ratio(self, base: int, rows: int) -> float:
        """How many ``base``-row steps one step of ``rows`` rows costs (>= 1 for rows >= base)."""
        t0 = self._median.get(base)
        if not t0:
            return 1.0 + self.PRIOR_SLOPE * (rows - base)
        t = self._median.get(rows)
        if t is None:
            below, above = base, None
            for r in self._timed:
                if base <= r <= rows:
                    below = r
                elif r > rows:
                    above = r
                    break
            tb = self._median[below]
            if above is None:
                t = tb + self.PRIOR_SLOPE * t0 * (rows - below)
            else:
                t = tb + (self._median[above] - tb) * (rows - below) / (above - below)
        for r in self._timed:                                   # never cheaper than fewer rows timed
            if r > rows:
                break
            if r > base:
                t = max(t, self._median[r])
        return max(t / t0, 1.0)


class DraftPolicy:
    """How many tokens one sequence drafts each step (0: decode plainly), from what it has seen.

    The acceptance of a drafted token is estimated per match-length band (:data:`BANDS`: 2-3, 4-7,
    8-15, 16+ tokens matched) as a beta estimate: the band's accepted and rejected drafted tokens, each
    weighed down by half every :data:`HALF_LIFE` steps, over a prior of :data:`STRENGTH` pseudo-counts
    centred on the band's :data:`PRIOR` shifted by how the sequence's drafts fared in every band. With
    acceptance a, a draft of k tokens yields 1 + a + ... + a^k tokens for one step of k + 1 rows; the
    policy drafts the k (<= what the proposer found, <= ``draft_max``) with the most tokens per unit of
    step cost (``cost(k)``: that step against a one-row one, :class:`StepCosts`), if that beats plain
    decoding by :data:`MARGIN`, else nothing. The tokens of a completion never depend on it
    (:func:`verify`): it decides only how fast they come.
    """

    BANDS = (2, 4, 8, 16)
    PRIOR = (0.2, 0.45, 0.7, 0.85)
    STRENGTH = 3.0
    HALF_LIFE = 64
    MARGIN = 1.1

    def __init__(self, draft_max: int):
        self.max = draft_max
        self.hits = [0.0] * len(self.BANDS)                     # [bands] accepted drafted tokens, decayed
        self.misses = [0.0] * len(self.BANDS)                   # [bands] rejected ones
        self._fade = 0.5 ** (1.0 / self.HALF_LIFE)

    def band(self, match: int) -> int:
        b = 0
        while b + 1 < len(self.BANDS) and match >= self.BANDS[b + 1]:
            b += 1
        return b

    def acceptance(self, match: int) -> float:
        """The estimated chance that a drafted token of a ``match``-token match is accepted."""
        b = self.band(match)
        hits, seen = sum(self.hits), sum(self.hits) + sum(self.misses)
        shift = 0.0 if seen == 0 else (hits + 1.5) / (seen + 3.0) - 0.5          # the sequence's lean
        prior = min(max(self.PRIOR[b] + shift, 0.02), 0.98)
        return (self.hits[b] + self.STRENGTH * prior) / (self.hits[b] + self.misses[b] + self.STRENGTH)

    def choose(self, match: int, available: int, cost) -> int:
        """Tokens to draft this step out of ``available`` found by a ``match``-token match; ``cost(k)``:
        a step of k + 1 rows in one-row steps. Counts a step of the sequence."""
        f = self._fade
        self.hits = [h * f for h in self.hits]
        self.misses = [m * f for m in self.misses]
        if available <= 0 or match <= 0:
            return 0
        a = self.acceptance(match)
        best, best_k, tokens, term = self.MARGIN, 0, 1.0, 1.0
        for k in range(1, min(available, self.max) + 1):
            term *= a
            tokens += term                                     # expected tokens of a k-token draft
            gain = tokens / cost(k)
            if gain > best:
                best, best_k = gain, k
        return best_k

    def update(self, match: int, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens from a ``match``-token match had ``accepted`` accepted."""
        if drafted <= 0:
            return
        b = self.band(match)
        self.hits[b] += accepted
        self.misses[b] += accepted < drafted


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

    Each position's token is drawn as plain decoding draws it (:func:`~streamattn.engine.sampling.sample`
    on that position's logits with the sequence's generator, in order: one draw per emitted token, as
    plain decoding makes); a drafted token is accepted when it is that draw, and the first draw that
    differs is the model's token. So the output is plain decoding's, token for token, for greedy and for
    seeded sampling alike, whatever was drafted; a drafted token x is accepted with probability p(x),
    as under the rule of Leviathan et al. (2023) with a one-token draft.
    """
    out = []
    for i, x in enumerate(draft):
        t = sample(prepare(i, rows[i]), params, rng)
        if t != x:
            return out + [t]
        out.append(int(x))
    return out + [sample(prepare(len(draft), rows[len(draft)]), params, rng)]


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
