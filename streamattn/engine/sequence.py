"""One request inside the engine: its prompt, sampling state, detokenizer, stop strings and output channel.

The one stop rule of every entry point lives here (:class:`StopFilter`): text that might still begin a
stop string is held back until it cannot, and a stop string itself is never emitted. Finish reasons are
OpenAI's: ``"stop"`` (end-of-sequence token or a stop string) and ``"length"`` (``max_tokens`` reached);
the server adds ``"cancelled"`` and ``"error"`` for requests that never finish on their own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from streamattn.engine.grammar import GrammarError
from streamattn.engine.sampling import SamplingParams, apply_repetition_penalty, sample
from streamattn.engine.speculative import DraftPolicy, SpecParams, StepCosts, make_proposer, verify
from streamattn.text.tokenizer import StreamDecoder, Tokenizer


def check_logit_bias(bias, vocab: int) -> tuple:
    """``{token id: bias}`` (ids as int or decimal strings, biases in [-100, 100]) as sorted
    ``(id, bias)`` pairs; ValueError naming the first bad entry."""
    if not bias:
        return ()
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers (got {type(bias).__name__})")
    out = {}
    for k, v in bias.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias key {str(k)[:40]!r} is not a token id") from None
        if not 0 <= tid < vocab:
            raise ValueError(f"logit_bias token id {tid} is outside the vocabulary 0..{vocab - 1}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise ValueError(f"logit_bias[{tid}] must be a number in [-100, 100] (got {str(v)[:40]})")
        out[tid] = float(v)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class Job:
    """What a request asks the engine for (the server validates it in ``serve.protocol``).

    prompt : token ids; max_tokens : new tokens at most (0: feed the prompt only, keeping its last
    logits in ``Sequence.last_logits``); sampling : its
    own parameters and seed (a seeded completion depends on nothing else); stop : stop strings; logprobs :
    report the chosen token's log-probability; top_logprobs : and that many alternatives; ignore_eos : keep
    going past EOS; cache_prompt : read and write the prompt cache; logits_processors : callables
    ``f(token_ids, logits) -> logits`` applied in order before sampling (``token_ids``: prompt and
    completion so far; ``logits``: float32 [vocab], to be returned changed or replaced);
    targets : teacher forcing: ``targets[t]`` is the token expected after ``prompt[t]``, and the
    sequence records ``-log p(targets[t])`` (nats) in ``Sequence.nll`` as its prompt is fed;
    speculative : draft tokens and verify them in one step (:mod:`streamattn.engine.speculative`):
    greedy output is token for token that of plain decoding; grammar : a compiled
    :class:`~streamattn.engine.grammar.Grammar` enforced on every token (the sequence finishes "stop"
    when it completes); logit_bias : ``(token_id, bias)`` pairs added to the logits before anything else;
    show_special : control-token ids whose strings stay in the emitted text (the others are dropped).
    """

    prompt: tuple
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple = ()
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    cache_prompt: bool = True
    logits_processors: tuple = ()
    targets: tuple | None = None
    speculative: SpecParams | None = None
    grammar: object = None
    logit_bias: tuple = ()
    show_special: frozenset = frozenset()
    fail: bool = False                      # testing aid (ServeConfig.debug_fail_text)

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("prompt is an empty list of token ids")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, (int, np.integer)) \
                or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0 (got {self.max_tokens!r})")
        if self.targets is not None and len(self.targets) != len(self.prompt):
            raise ValueError(f"targets must hold one token per prompt token ({len(self.prompt)}), "
                             f"got {len(self.targets)}")


class StopFilter:
    """Cuts text at the first stop string and holds back any tail that could still become one.

    >>> f = StopFilter(("END",))
    >>> f.push("abcE"), f.push("N"), f.push("D more")
    (('abc', False), ('', False), ('', True))
    """

    def __init__(self, stop: tuple):
        self.stop = tuple(s for s in stop if s)
        self.pending = ""
        self.matched: str | None = None            # the stop string reached, once one is

    def push(self, piece: str) -> tuple:
        """(text safe to emit now, whether a stop string was reached)."""
        text = self.pending + piece
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = ""
            self.matched = next(s for s in self.stop if text.find(s) == cut)
            return text[:cut], True
        hold = 0
        for s in self.stop:              # longest suffix of text that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _prior_cost(k: int) -> float:
    """A step with k more rows than a one-row step, priced by :class:`StepCosts`' prior (nothing timed)."""
    return StepCosts().ratio(1, 1 + k)


@dataclass(frozen=True)
class Event:
    """Engine -> HTTP handler. kind "delta": ``text`` (+ ``logprobs`` entries); "done": ``finish``,
    ``usage``, ``stop`` (the stop string that ended it, else None) and ``tokens`` (the completion's token
    ids); "error": ``message`` and ``code`` ("grammar": the request's own grammar could not go on, a
    client error; "engine": anything else)."""

    kind: str
    text: str = ""
    logprobs: tuple = ()
    finish: str | None = None
    usage: dict | None = None
    stop: str | None = None
    message: str = ""
    code: str = "engine"
    tokens: tuple = ()


@dataclass(eq=False)
class Sequence:
    """Engine-side state of one request; ``emit`` carries its events to the handler (thread-safe)."""

    job: Job
    emit: object                                       # callable(Event)
    tok: Tokenizer
    slot: int = -1
    done: int = 0                                      # prompt tokens already in the cache
    cached: int = 0                                    # of which came from the prompt cache
    generated: list = field(default_factory=list)
    next_token: int = -1
    finished: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_step: int = -1                              # engine step count when cancel() was called
    admitted: bool = False
    finish_reason: str | None = None
    last_logits: object = None                         # [vocab] of the last prompt token, max_tokens == 0
    leader: "Sequence | None" = None                   # n > 1: another choice of the same prompt to fork from
    draft: list = field(default_factory=list)          # tokens drafted for this step (fed after next_token)
    drafted: int = 0                                   # drafted tokens verified so far
    accepted: int = 0                                  # of which were accepted

    def __post_init__(self):
        self.rng = np.random.default_rng(self.job.sampling.seed)    # this sequence's own stream
        self.nll = np.empty(len(self.job.prompt) if self.job.targets is not None else 0, np.float64)
        self.decoder = StreamDecoder(self.tok, keep=self.job.show_special) if self.tok is not None else None
        self.stops = StopFilter(self.job.stop)
        spec = self.job.speculative
        self.proposer = make_proposer(spec) if spec is not None else None
        self.policy = DraftPolicy(spec.draft_max) if spec is not None else None
        self.match = 0                                     # the match length this step's draft came from
        self._ctx = None                                   # prompt + generated, for the proposer
        self.constraint = None                             # the grammar's matcher, made at the first draw

    @property
    def prefilling(self) -> bool:
        return self.done < len(self.job.prompt)

    def usage(self) -> dict:
        p, c = len(self.job.prompt), len(self.generated)
        out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
               "prompt_tokens_details": {"cached_tokens": self.cached}}
        if self.proposer is not None:                  # OpenAI's names for predicted tokens
            out["completion_tokens_details"] = {"accepted_prediction_tokens": self.accepted,
                                                "rejected_prediction_tokens": self.drafted - self.accepted}
        return out

    def plan_draft(self, limit: int, cost=None) -> list:
        """Draft this step's tokens (at most ``limit``, and never past ``max_tokens``); [] without a
        proposer, when the context has nothing to copy, or when the policy finds that no draft pays
        (``cost(k)``: a step with k more rows against one without, default
        :meth:`StepCosts.ratio` priced by its prior)."""
        self.draft = []
        if self.proposer is not None:
            k = min(self.job.speculative.draft_max, limit, self.job.max_tokens - len(self.generated) - 1)
            if k > 0:
                found, self.match = self.proposer.lookup(self._context(), k)
                k = self.policy.choose(self.match, len(found), cost or _prior_cost)
                self.draft = found[:k]
        return self.draft

    def _context(self) -> list:
        """The prompt and the tokens generated so far, as one list grown in place (the proposer then
        indexes only what is new)."""
        ctx, p = self._ctx, len(self.job.prompt)
        if ctx is None or len(ctx) > p + len(self.generated):
            ctx = self._ctx = list(self.job.prompt)
        ctx += self.generated[len(ctx) - p:]
        return ctx

    def _prepare(self, logits, extra=()):
        """The logits a token is drawn from, after the taken tokens and then ``extra`` (drafted ones
        being verified): ``logit_bias``, the logits processors, the grammar's mask, the repetition
        penalty; temperature and the filters come in ``sample``."""
        job = self.job
        if job.logit_bias:
            logits = np.array(logits, np.float32, copy=True)
            for tid, bias in job.logit_bias:
                logits[tid] += bias
        if job.logits_processors or job.sampling.repetition_penalty != 1.0:
            ids = list(job.prompt) + self.generated + list(extra)
            for f in job.logits_processors:
                logits = f(ids, logits)
        if job.grammar is not None:
            if self.constraint is None:
                self.constraint = job.grammar.constraint(len(logits))
            logits = self.constraint.mask(logits, extra)
        if job.sampling.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, ids, job.sampling.repetition_penalty)
        return logits

    def verify(self, rows) -> tuple:
        """Check this step's draft against ``rows`` [len(draft) + 1, vocab] (the logits after the last
        token and after each drafted one) and emit the tokens it yields; returns (ended, rejected), the
        drafted tokens the caches must drop."""
        draft = self.draft
        try:
            toks = verify(rows, draft, self.job.sampling, self.rng, lambda i, z: self._prepare(z, draft[:i]))
            a = len(toks) - 1                               # drafted tokens accepted
            self.drafted, self.accepted, self.draft = self.drafted + len(draft), self.accepted + a, []
            self.policy.update(self.match, len(draft), a)
            for i, tid in enumerate(toks):
                if self._take(tid, rows[i]):
                    return True, len(draft) - a
        except GrammarError as e:
            self._grammar_failed(e)
            return True, 0                                  # its slot is cleared: nothing to rewind
        return False, len(draft) - a

    def score(self, logits, start: int) -> None:
        """Record the teacher-forced losses of prompt positions ``start .. start + len(logits) - 1`` from
        their logits [n, vocab] (float32, one row per fed token)."""
        z = np.asarray(logits, np.float64)                                  # [n, vocab]
        top = z.max(axis=-1)
        lse = top + np.log(np.exp(z - top[:, None]).sum(axis=-1))          # [n]
        want = np.asarray(self.job.targets[start:start + z.shape[0]], np.int64)
        self.nll[start:start + z.shape[0]] = lse - z[np.arange(z.shape[0]), want]

    def advance(self, logits) -> bool:
        """Sample the next token from ``logits`` [vocab], emit its text; True when the sequence ended."""
        job = self.job
        if job.fail:
            raise RuntimeError("debug_fail_text matched this request's prompt (testing aid)")
        if job.max_tokens == 0:                                # the prompt was all: keep its logits
            self.last_logits = np.array(logits)
            self.finish("length")
            return True
        try:
            return self._take(sample(self._prepare(logits), job.sampling, self.rng), logits)
        except GrammarError as e:
            self._grammar_failed(e)
            return True

    def _grammar_failed(self, e) -> None:
        """The request's grammar cannot go on (llguidance's parser limits): this sequence alone ends with
        a one-line error; nothing of the grammar or the text is quoted."""
        self.fail(f"the output grammar could not go on after {len(self.generated)} generated tokens: {e}",
                  code="grammar")

    def _take(self, tid: int, logits) -> bool:
        """Append token ``tid`` (drawn from ``logits``), emit what the stop rule releases; True when the
        sequence ended."""
        job = self.job
        if self.constraint is not None:
            self.constraint.take(tid)                       # raises before the token is counted
        self.generated.append(tid)
        self.next_token = tid
        lp = (self._logprobs(logits, tid),) if job.logprobs else ()
        eos = tid in self.tok.stop_ids and not job.ignore_eos
        text, hit = self.stops.push(self.decoder.flush() if eos else self.decoder.push(tid))
        if hit:
            finish = "stop"
        elif eos or (self.constraint is not None and self.constraint.complete):
            finish = "stop"
        elif len(self.generated) >= job.max_tokens:
            finish = "length"
        else:
            finish = None
        if finish and not hit:                   # the stream ends: release what was held back
            more, hit = self.stops.push(self.decoder.flush())
            text += more if hit else more + self.stops.flush()
            finish = "stop" if hit else finish
        if text or lp:
            self.emit(Event("delta", text=text, logprobs=lp))
        if finish:
            self.finish(finish)
        return finish is not None

    def finish(self, reason: str) -> None:
        self.finished, self.finish_reason = True, reason
        self.emit(Event("done", finish=reason, usage=self.usage(), stop=self.stops.matched,
                        tokens=tuple(self.generated)))

    def fail(self, message: str, code: str = "engine") -> None:
        self.finished, self.finish_reason = True, "error"
        self.emit(Event("error", message=message, code=code))

    def _logprobs(self, logits, tid: int) -> dict:
        z = np.asarray(logits, np.float64)
        lse = z.max() + np.log(np.exp(z - z.max()).sum())
        out = {"id": int(tid), "logprob": float(z[tid] - lse), "top": []}
        n = self.job.top_logprobs
        if n:
            ids = np.argpartition(-z, n - 1)[:n]
            ids = ids[np.argsort(-z[ids], kind="stable")]
            out["top"] = [(int(i), float(z[i] - lse)) for i in ids]
        return out
