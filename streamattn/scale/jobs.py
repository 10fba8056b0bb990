"""Batch job files: JSON lines in (requests), JSON lines out (completions), resumable.

Input, one JSON object a line (blank lines are ignored)::

    {"id": "q1", "prompt": "The capital of France is", "max_tokens": 16}
    {"id": 7, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.8, "seed": 3}

``id`` (string or integer, unique in the file; default: the line number) and exactly one of ``prompt``
(a non-empty string) or ``messages`` (chat messages, rendered with the model's chat template). Optional
per-line overrides of the run's defaults: ``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
``repetition_penalty``, ``seed``, ``stop`` (a string or a list of strings). Any other key is an error.

Output, one JSON object a line, in completion order (match lines by ``id``)::

    {"id": "q1", "text": " Paris...", "prompt_tokens": 6, "completion_tokens": 16, "finish_reason": "length"}

``finish_reason`` is the engine's, as on every entry point: ``"stop"`` (end of sequence or a stop string), or
``"length"`` (``max_tokens`` reached). Resuming: ids already present in the output file are skipped, and the
writer refuses an id twice, so a line is never written twice even when a worker is retried.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field, replace

from streamattn.engine.sampling import SamplingParams

_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
_KEYS = {"id", "prompt", "messages", "max_tokens", "stop", *_SAMPLING_KEYS}


class BadLine(ValueError):
    """A request line that cannot run; ``line`` is its 1-based number in the input file."""

    def __init__(self, line: int, msg: str):
        super().__init__(f"line {line}: {msg}")
        self.line = line


@dataclass(frozen=True)
class Request:
    """One validated input line.

    line : 1-based line number in the input file; id : the line's id (str or int);
    prompt / messages : exactly one is set; max_tokens, sampling, stop : the run's defaults with the
    line's overrides applied.
    """

    line: int
    id: object
    prompt: str | None
    messages: tuple | None
    max_tokens: int
    sampling: SamplingParams
    stop: tuple = ()

    @property
    def key(self) -> str:
        """The id as canonical JSON (1 and "1" are different ids)."""
        return id_key(self.id)

    def to_json(self) -> str:
        d = dict(line=self.line, id=self.id, prompt=self.prompt, max_tokens=self.max_tokens, stop=list(self.stop),
                 messages=None if self.messages is None else [dict(m) for m in self.messages],
                 sampling={k: getattr(self.sampling, k) for k in _SAMPLING_KEYS})
        return json.dumps(d)

    @classmethod
    def from_json(cls, s: str) -> "Request":
        d = json.loads(s)
        msgs = d["messages"]
        return cls(line=d["line"], id=d["id"], prompt=d["prompt"], max_tokens=d["max_tokens"],
                   stop=tuple(d["stop"]), sampling=SamplingParams(**d["sampling"]),
                   messages=None if msgs is None else tuple(tuple(m.items()) for m in msgs))


def id_key(i) -> str:
    return json.dumps(i)


def parse_line(text: str, line: int, *, max_tokens: int, sampling: SamplingParams, stop: tuple = ()) -> Request:
    """Validate one input line; raises :class:`BadLine` naming the line, the field and what was expected."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadLine(line, f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(d, dict):
        raise BadLine(line, f"expected a JSON object, got {type(d).__name__}")
    extra = sorted(set(d) - _KEYS)
    if extra:
        raise BadLine(line, f"unknown key(s) {extra}; expected some of {sorted(_KEYS)}")
    rid = d.get("id", line)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise BadLine(line, f"id must be a string or an integer (got {rid!r})")
    if ("prompt" in d) == ("messages" in d):
        raise BadLine(line, "give exactly one of 'prompt' (a string) or 'messages' (chat messages)")
    prompt, messages = d.get("prompt"), None
    if "prompt" in d and (not isinstance(prompt, str) or not prompt):
        raise BadLine(line, f"prompt must be a non-empty string (got {prompt!r})")
    if "messages" in d:
        m = d["messages"]
        ok = isinstance(m, list) and m and all(isinstance(x, dict) and isinstance(x.get("role"), str)
                                               and isinstance(x.get("content"), str) for x in m)
        if not ok:
            raise BadLine(line, "messages must be a non-empty list of {\"role\": str, \"content\": str} objects")
        messages = tuple(tuple(sorted(x.items())) for x in m)
    n = d.get("max_tokens", max_tokens)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadLine(line, f"max_tokens must be an integer >= 1 (got {n!r})")
    st = d.get("stop", stop)
    st = (st,) if isinstance(st, str) else st
    if not isinstance(st, (list, tuple)) or not all(isinstance(s, str) and s for s in st):
        raise BadLine(line, f"stop must be a non-empty string or a list of them (got {d.get('stop')!r})")
    try:
        sp = replace(sampling, **{k: d[k] for k in _SAMPLING_KEYS if k in d})
    except (ValueError, TypeError) as e:
        raise BadLine(line, str(e)) from None
    return Request(line=line, id=rid, prompt=prompt, messages=messages, max_tokens=n, sampling=sp,
                   stop=tuple(st))


@dataclass
class ReadResult:
    """Requests to run, bad lines found (with their errors), and how many were already in the output."""

    requests: list = field(default_factory=list)
    bad: list = field(default_factory=list)                 # [BadLine]
    already_done: int = 0


def read_requests(path, *, done: set = frozenset(), **defaults) -> ReadResult:
    """Parse an input file: every line is checked before anything runs; ids in ``done`` are skipped.

    A repeated id is a bad line (the later one), since output lines are matched and resumed by id.
    ``defaults`` go to :func:`parse_line` (max_tokens, sampling, stop).
    """
    res, seen = ReadResult(), set()
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                r = parse_line(text, n, **defaults)
                if r.key in seen:
                    raise BadLine(n, f"id {r.id!r} repeats an earlier line's id; ids must be unique")
            except BadLine as e:
                res.bad.append(e)
                continue
            seen.add(r.key)
            if r.key in done:
                res.already_done += 1
            else:
                res.requests.append(r)
    return res


class OutputFile:
    """Append-only JSON-lines output that knows which ids it holds and writes each id at most once.

    Opening an existing file reads its ids (for resuming). A last line without its newline is the
    remains of a killed run: it is cut off (and reported) and its id runs again.
    """

    def __init__(self, path, *, log=None):
        self.path = os.fspath(path)
        self.done: set = set()
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                data = f.read()
            keep = data.rfind(b"\n") + 1
            if keep < len(data):
                print(f"streamattn batch: {self.path}: dropping an unfinished last line "
                      f"({len(data) - keep} bytes); its id runs again", file=log or sys.stderr)
                with open(self.path, "r+b") as f:
                    f.truncate(keep)
            for n, text in enumerate(data[:keep].decode("utf-8").splitlines(), start=1):
                if not text.strip():
                    continue
                try:
                    self.done.add(id_key(json.loads(text)["id"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"output file {self.path} line {n} is not a completion record "
                                     f"({text[:60]!r}); give another -o or repair the file") from None
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> bool:
        """Append one completion record and flush; False (nothing written) if its id is already there."""
        k = id_key(record["id"])
        if k in self.done:
            return False
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        self.done.add(k)
        return True

    def close(self):
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Progress:
    """One status line on stderr: prompts done of total, prompts/s, generated tok/s."""

    def __init__(self, total: int, *, quiet: bool = False, stream=None):
        self.total, self.done, self.tokens, self.quiet = total, 0, 0, quiet
        self.stream = stream or sys.stderr
        self.t0 = self._last = time.perf_counter()

    def start(self):
        """Restart the clock (after the model is loaded)."""
        self.t0 = self._last = time.perf_counter()

    def update(self, completion_tokens: int):
        self.done += 1
        self.tokens += completion_tokens
        now = time.perf_counter()
        tty = self.stream.isatty()
        if not self.quiet and (self.done == self.total or now - self._last > (0.2 if tty else 10)):
            self._last = now
            end = "\n" if self.done == self.total or not tty else ""
            print(f"\r{self.line()}" if tty else self.line(), end=end, file=self.stream, flush=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def line(self) -> str:
        s = max(self.elapsed, 1e-9)
        return (f"batch: {self.done}/{self.total} prompts, {self.done / s:.2f} prompts/s, "
                f"{self.tokens / s:.1f} generated tok/s")
