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

``finish_reason`` is the engine's, as on every entry point: ``"stop"`` (end of sequence or a stop string)
or ``"length"`` (``max_tokens`` reached). With ``--on-error skip`` a line that cannot run gets an error
record instead, ``{"id": ..., "line": 3, "error": "line 3: ..."}`` (``id`` null when the line has none).

Resuming: ids already present in the output file (and lines that have an error record) are skipped, and
the writer refuses an id twice, so a line is never written twice even when a worker is retried; delete a
line's error record to run it again. Records are split at ``\\n`` only (a text may hold U+2028 or U+0085),
and the output file is locked (``flock``) while a run writes it: a second run on it is refused.

Input is read in bytes, a line at a time: a line over :data:`MAX_LINE_BYTES`, a line that is not UTF-8,
or one whose strings hold a lone surrogate is a bad line naming its number, like a line that does not
parse; error messages quote at most ~60 characters of a value.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import sys
import time
from dataclasses import dataclass, field, replace

from streamattn.engine.grammar import ResponseFormatError, check_response_format
from streamattn.engine.sampling import SamplingParams
from streamattn.runtime.files import BadFile, kind, open_regular, short

_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
_KEYS = {"id", "prompt", "messages", "max_tokens", "stop", "response_format", *_SAMPLING_KEYS}
ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_LINE_BYTES = 16 << 20            # an input line (a prompt past the context is refused before this)
MAX_RECORD_BYTES = 256 << 20         # an output record read back when resuming
MAX_STOP = 16                        # stop strings a line may give, each of at most MAX_STOP_CHARS
MAX_STOP_CHARS = 256


class BadLine(ValueError):
    """A request line that cannot run; ``line`` is its 1-based number in the input file."""

    def __init__(self, line: int, msg: str, *, id=None):
        super().__init__(f"line {line}: {msg}")
        self.line, self.id = line, id


@dataclass(frozen=True)
class Request:
    """One validated input line.

    line : 1-based line number in the input file; id : the line's id (str or int);
    prompt / messages : exactly one is set; max_tokens, sampling, stop : the run's defaults with the
    line's overrides applied; response_format : the line's OpenAI ``response_format`` as JSON text
    (compiled and enforced by the engine), or None.
    """

    line: int
    id: object
    prompt: str | None
    messages: tuple | None
    max_tokens: int
    sampling: SamplingParams
    stop: tuple = ()
    response_format: str | None = None

    @property
    def key(self) -> str:
        """The id as canonical JSON (1 and "1" are different ids)."""
        return id_key(self.id)

    def to_json(self) -> str:
        d = dict(line=self.line, id=self.id, prompt=self.prompt, max_tokens=self.max_tokens, stop=list(self.stop),
                 messages=None if self.messages is None else [dict(m) for m in self.messages],
                 sampling={k: getattr(self.sampling, k) for k in _SAMPLING_KEYS},
                 response_format=self.response_format)
        return json.dumps(d)

    @classmethod
    def from_json(cls, s: str) -> "Request":
        d = json.loads(s)
        msgs = d["messages"]
        return cls(line=d["line"], id=d["id"], prompt=d["prompt"], max_tokens=d["max_tokens"],
                   stop=tuple(d["stop"]), sampling=SamplingParams(**d["sampling"]),
                   messages=None if msgs is None else tuple(tuple(m.items()) for m in msgs),
                   response_format=d.get("response_format"))


def id_key(i) -> str:
    return json.dumps(i)


def _unicode(value, what: str, line: int) -> None:
    """Refuse a string holding a lone surrogate (JSON allows ``"\\ud800"``; UTF-8 cannot encode it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadLine(line, f"{what} holds a lone surrogate (U+{ord(value[e.start]):04X} at character "
                            f"{e.start}); expected valid Unicode text") from None


def parse_line(text: str, line: int, *, max_tokens: int, sampling: SamplingParams, stop: tuple = ()) -> Request:
    """Validate one input line; raises :class:`BadLine` naming the line, the field and what was expected."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadLine(line, f"not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise BadLine(line, "not valid JSON: nested too deeply") from None
    if not isinstance(d, dict):
        raise BadLine(line, f"expected a JSON object, got {type(d).__name__}")
    extra = sorted(set(d) - _KEYS)
    if extra:
        raise BadLine(line, f"unknown key(s) {short(extra)}; expected some of {sorted(_KEYS)}")
    rid = d.get("id", line)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise BadLine(line, f"id must be a string or an integer (got {short(rid)})")
    if isinstance(rid, str):
        _unicode(rid, "id", line)
    if ("prompt" in d) == ("messages" in d):
        raise BadLine(line, "give exactly one of 'prompt' (a string) or 'messages' (chat messages)")
    prompt, messages = d.get("prompt"), None
    if "prompt" in d:
        if not isinstance(prompt, str) or not prompt:
            raise BadLine(line, f"prompt must be a non-empty string (got {short(prompt)})")
        _unicode(prompt, "prompt", line)
    if "messages" in d:
        m = d["messages"]
        ok = isinstance(m, list) and m and all(isinstance(x, dict) and x.get("role") in ROLES
                                               and isinstance(x.get("content"), str) for x in m)
        if not ok:
            raise BadLine(line, f"messages must be a non-empty list of {{\"role\": one of {list(ROLES)}, "
                                f"\"content\": str}} objects (got {short(m)})")
        for i, x in enumerate(m):
            _unicode(x["content"], f"messages[{i}].content", line)
            for k, v in x.items():
                _unicode(k, f"messages[{i}] key", line)
                if isinstance(v, str):
                    _unicode(v, f"messages[{i}].{short(k, 20)}", line)
        messages = tuple(tuple(sorted(x.items())) for x in m)
    n = d.get("max_tokens", max_tokens)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadLine(line, f"max_tokens must be an integer >= 1 (got {short(n)})")
    st = d.get("stop", stop)
    st = (st,) if isinstance(st, str) else st
    if not isinstance(st, (list, tuple)) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS
                                                    for s in st) or len(st) > MAX_STOP:
        raise BadLine(line, f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, each of "
                            f"at most {MAX_STOP_CHARS} characters (got {short(d.get('stop'))})")
    for s in st:
        _unicode(s, "stop", line)
    try:
        sp = replace(sampling, **{k: d[k] for k in _SAMPLING_KEYS if k in d})
    except (ValueError, TypeError) as e:
        raise BadLine(line, short(str(e), 200).strip("'\"")) from None
    fmt = d.get("response_format")
    try:
        constrained = check_response_format(fmt)[0] != "text"      # compiled by ``measure``, before decoding
    except ResponseFormatError as e:
        raise BadLine(line, str(e)) from None
    if constrained and st:
        raise BadLine(line, "stop cannot be used with a JSON response_format: the output ends where the JSON "
                            "does; drop stop (or the run's --stop)")
    return Request(line=line, id=rid, prompt=prompt, messages=messages, max_tokens=n, sampling=sp,
                   stop=tuple(st), response_format=None if fmt is None else json.dumps(fmt))


@dataclass
class ReadResult:
    """Requests to run, bad lines found (with their errors), and how many were already in the output."""

    requests: list = field(default_factory=list)
    bad: list = field(default_factory=list)                 # [BadLine]
    already_done: int = 0


def read_requests(path, *, done: set = frozenset(), done_lines: set = frozenset(), measure=None,
                  max_line_bytes: int = MAX_LINE_BYTES, **defaults) -> ReadResult:
    """Parse an input file: every line is checked before anything runs; ids in ``done`` (and line numbers
    in ``done_lines``: lines with an error record) are skipped.

    A repeated id is a bad line (the later one), since output lines are matched and resumed by id.
    ``measure(request)``, when given, checks what needs the model (the prompt's tokens against the
    context, the chat template) and raises ValueError for a line that cannot run; it sees only lines
    still to run. ``defaults`` go to :func:`parse_line` (max_tokens, sampling, stop).

    Raises :class:`~streamattn.runtime.files.BadFile` if ``path`` is not a regular file (a FIFO, a device).
    """
    res, seen = ReadResult(), set()
    with open_regular(path) as f:
        n = 0
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                break
            n += 1
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                size = len(raw)
                while raw and not raw.endswith(b"\n"):      # skip the rest of the line, a piece at a time
                    raw = f.readline(1 << 20)
                    size += len(raw)
                if n not in done_lines:
                    res.bad.append(BadLine(n, f"{size} bytes, longer than the {max_line_bytes} bytes a line "
                                              "may hold"))
                continue
            if n in done_lines:
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                res.bad.append(BadLine(n, f"not UTF-8 (byte {e.start} of the line: {raw[e.start:e.start + 4]!r}); "
                                          "expected UTF-8 JSON"))
                continue
            if n == 1:
                text = text.removeprefix("\ufeff")          # a byte-order mark some editors write
            if not text.strip():
                continue
            try:
                r = parse_line(text, n, **defaults)
                if r.key in seen:
                    raise BadLine(n, f"id {short(r.id)} repeats an earlier line's id; ids must be unique")
                if r.key not in done and measure is not None:
                    try:
                        measure(r)
                    except Exception as e:  # noqa: BLE001 - whatever the tokenizer or template raises
                        msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                        raise BadLine(n, short(msg, 300).strip("'\"")) from None
            except BadLine as e:
                e.id = line_id(text)
                res.bad.append(e)
                continue
            seen.add(r.key)
            if r.key in done:
                res.already_done += 1
            else:
                res.requests.append(r)
    return res


def line_id(text: str):
    """The id an input line gives itself, if it parses that far (for its error record), else None."""
    try:
        d = json.loads(text)
        rid = d.get("id") if isinstance(d, dict) else None
        return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None
    except (ValueError, RecursionError):
        return None


class OutputFile:
    """Append-only JSON-lines output that knows which ids it holds and writes each id at most once.

    Opening an existing file reads its ids (for resuming) and takes an exclusive ``flock`` on it for as
    long as it is open: a second run writing the same file is refused (ValueError naming the file). A
    last line without its newline is the remains of a killed run: it is cut off (and reported) and its
    id runs again. Only regular files are accepted (``/dev/full``, a FIFO: :class:`BadFile`).
    """

    def __init__(self, path, *, log=None, max_record_bytes: int = MAX_RECORD_BYTES):
        self.path = os.fspath(path)
        self.done: set = set()
        self.done_lines: set = set()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise BadFile(f"{self.path}: is {kind(mode)}; the output must be a regular file")
            os.set_blocking(fd, True)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ValueError(f"output file {self.path} is being written by another run (it is locked); "
                                 "wait for that run to end or give another -o") from None
            self._f = os.fdopen(fd, "r+b")
        except BaseException:
            os.close(fd)
            raise
        try:
            self._read(max_record_bytes, log)
        except BaseException:
            self._f.close()
            raise

    def _read(self, max_record_bytes: int, log) -> None:
        f, n, keep = self._f, 0, 0
        while True:
            raw = f.readline(max_record_bytes + 1)
            if not raw:
                break
            n += 1
            if not raw.endswith(b"\n"):
                if len(raw) > max_record_bytes:
                    raise ValueError(f"output file {self.path} line {n} is longer than {max_record_bytes} bytes: "
                                     "not a completion record; give another -o or repair the file")
                print(f"streamattn batch: {self.path}: dropping an unfinished last line ({len(raw)} bytes); "
                      "its id runs again", file=log or sys.stderr)
                f.truncate(keep)
                break
            keep += len(raw)
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
                if "error" in rec and isinstance(rec.get("line"), int):
                    self.done_lines.add(rec["line"])
                else:
                    self.done.add(id_key(rec["id"]))
            except (ValueError, KeyError, TypeError, RecursionError):
                raise ValueError(f"output file {self.path} line {n} is not a completion record "
                                 f"({short(raw.decode('utf-8', 'replace'))}); give another -o or repair the "
                                 "file") from None
        f.seek(0, os.SEEK_END)

    def _append(self, record: dict) -> None:
        self._f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self._f.flush()

    def write(self, record: dict) -> bool:
        """Append one completion record and flush; False (nothing written) if its id is already there."""
        k = id_key(record["id"])
        if k in self.done:
            return False
        self._append(record)
        self.done.add(k)
        return True

    def write_error(self, line: int, rid, error: str) -> bool:
        """Append the error record of input line ``line``; False if that line already has one."""
        if line in self.done_lines:
            return False
        self._append({"id": rid, "line": line, "error": error})
        self.done_lines.add(line)
        return True

    def close(self):
        self._f.close()                           # releases the lock

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
