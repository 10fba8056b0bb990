"""One request inside the engine: its prompt, sampling state, detokenizer, stop strings and output channel."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from streamattn.models.sampling import SamplingParams, sample
from streamattn.text.tokenizer import StreamDecoder, Tokenizer


@dataclass(frozen=True)
class Job:
    """What a request asks the engine for (validated by ``protocol``).

    prompt : token ids; max_tokens >= 1; stop : stop strings; logprobs : report the chosen token's
    log-probability; top_logprobs : and that many alternatives; ignore_eos : keep going past EOS;
    cache_prompt : read and write the prompt cache.
    """

    prompt: tuple
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple = ()
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    cache_prompt: bool = True
    fail: bool = False                      # testing aid (ServeConfig.debug_fail_text)


class StopFilter:
    """Cuts text at the first stop string and holds back any tail that could still become one.

    >>> f = StopFilter(("END",))
    >>> f.push("abcE"), f.push("N"), f.push("D more")
    (('abc', False), ('', False), ('', True))
    """

    def __init__(self, stop: tuple):
        self.stop = tuple(s for s in stop if s)
        self.pending = ""

    def push(self, piece: str) -> tuple:
        """(text safe to emit now, whether a stop string was reached)."""
        text = self.pending + piece
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = ""
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


@dataclass(frozen=True)
class Event:
    """Engine -> HTTP handler. kind "delta": ``text`` (+ ``logprobs`` entries); "done": ``finish`` and
    ``usage``; "error": ``message``."""

    kind: str
    text: str = ""
    logprobs: tuple = ()
    finish: str | None = None
    usage: dict | None = None
    message: str = ""


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

    def __post_init__(self):
        self.rng = np.random.default_rng(self.job.sampling.seed)
        self.decoder = StreamDecoder(self.tok)
        self.stops = StopFilter(self.job.stop)

    @property
    def prefilling(self) -> bool:
        return self.done < len(self.job.prompt)

    def usage(self) -> dict:
        p, c = len(self.job.prompt), len(self.generated)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": self.cached}}

    def advance(self, logits) -> bool:
        """Sample the next token from ``logits`` [vocab], emit its text; True when the sequence ended."""
        job = self.job
        if job.fail:
            raise RuntimeError("debug_fail_text matched this request's prompt (testing aid)")
        seen = (list(job.prompt) + self.generated) if job.sampling.repetition_penalty != 1.0 else ()
        tid = sample(logits, job.sampling, self.rng, seen)
        self.generated.append(tid)
        self.next_token = tid
        lp = (self._logprobs(logits, tid),) if job.logprobs else ()
        finish = None
        if tid in self.tok.stop_ids and not job.ignore_eos:
            text, hit = self.stops.push(self.decoder.flush())
            text, finish = text + ("" if hit else self.stops.flush()), "stop"
        else:
            text, hit = self.stops.push(self.decoder.push(tid))
            if hit:
                finish = "stop"
            elif len(self.generated) >= job.max_tokens:
                more, hit = self.stops.push(self.decoder.flush())
                text, finish = text + more + ("" if hit else self.stops.flush()), "stop" if hit else "length"
        if text or lp:
            self.emit(Event("delta", text=text, logprobs=lp))
        if finish:
            self.finish(finish)
        return finish is not None

    def finish(self, reason: str) -> None:
        self.finished, self.finish_reason = True, reason
        self.emit(Event("done", finish=reason, usage=self.usage()))

    def fail(self, message: str) -> None:
        self.finished, self.finish_reason = True, "error"
        self.emit(Event("error", message=message))

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
