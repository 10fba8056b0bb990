"""The one decode engine: ``slots`` sequence slots in one batch of caches, continuous batching.

Every entry point drives it: :class:`~streamattn.engine.generate.Generator` (``stream``, ``stream_batch``,
``streamattn generate``), the server (on its own thread, :meth:`Engine.start`), ``streamattn batch``
(locally and in each Ray actor) and ``streamattn perplexity`` (a teacher-forced :class:`Job`).

Each step (:meth:`Engine.step`) is :meth:`~Engine.schedule` (1-2 and the :class:`StepPlan`, from
:func:`plan_step`, which needs no model), :meth:`~Engine.execute` (3) and :meth:`~Engine.update` (4):

1. drop cancelled requests (queued or running) and free their slots (``KVCache.reset(b)`` per layer);
2. admit queued requests into free slots, loading the longest reusable prompt prefix from the prompt cache;
3. run every active slot as one ragged batch through ``Transformer.forward``: a decoding sequence feeds
   its last token (count 1), a prefilling one its next chunk of at most ``prefill_chunk`` prompt tokens,
   an idle slot nothing (count 0). A long prompt therefore delays the running streams by one chunk per
   step, never by its whole prefill;
4. each sequence whose prompt is complete samples its next token (with its own seeded generator) and emits
   its text through the one stop rule of :mod:`streamattn.engine.sequence`.

A sequence's tokens depend only on its own prompt, parameters and seed: the kernels give a row the same
bits whatever shares its batch (docs/DESIGN.md §7), and each sequence draws from its own generator.

With ``isolate_failures`` (the server) an exception while one sequence samples fails that request alone,
and one inside ``forward`` (shared by the batch) fails the requests of that step and resets their slots;
without it (the library) the exception propagates to the caller. A disconnect is noticed at the next
step's start (1.), so a cancelled sequence never runs another step.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import traceback
import weakref
from dataclasses import dataclass

import numpy as np

from streamattn.kv import state
from streamattn.runtime.arrays import to_host
from streamattn.engine.options import EngineConfig
from streamattn.engine.prompt_cache import PromptCache
from streamattn.engine.sequence import Sequence
from streamattn.engine.speculative import StepCosts
from streamattn.models.feed import Feed
from streamattn.runtime.threads import ThreadChooser, thread_count


#: Steps of at most this many real rows run on 1 thread or on the count set, whichever measured faster
#: (``EngineConfig.adapt_threads``); larger ones (prompt chunks) always on the count set: their parallel
#: regions are long, so a worker that misses a time slice costs them little (docs/DESIGN.md §12).
ADAPT_ROWS = 16
#: An output head that takes at least this long on one thread tries the count set even when no CPU looks
#: idle (the thread chooser's gate), its times alone deciding: one region that long loses at most a time
#: slice to a descheduled worker, less than a second thread saves it (Gemma-3 270M's 262k-row head beside
#: a neighbour busy half of one CPU: 13.6 ms on one thread, 11.2 on two; SmolLM2's 1.3 ms head: 1.5 on two).
LONG_HEAD_S = 5e-3
_CHOOSERS = weakref.WeakKeyDictionary()          # model -> its ThreadChooser


def _chooser(model) -> ThreadChooser:
    """The model's :class:`~streamattn.runtime.threads.ThreadChooser`, shared by its engines (a Generator makes one
    per call), so that what a process measured outlives each call; a fresh one for a model that takes no
    weak reference."""
    try:
        return _CHOOSERS.setdefault(model, ThreadChooser())
    except TypeError:
        return ThreadChooser()


class QueueFull(Exception):
    """The wait queue already holds ``max_queue`` requests."""


@dataclass
class StepPlan:
    """What one engine step feeds and which logits it needs (:func:`plan_step`).

    Attributes
    ----------
    active : list of Sequence
        The sequences in the step, by slot.
    counts : int64 [B]
        Real tokens per slot (0: an idle or waiting slot); B is one past the last active slot.
    tokens : int64 [B, T]
        The tokens fed, zero padding past ``counts``: a prompt chunk, or the last token and its draft.
    rows, cols : int64 [N]
        The (slot, token) positions whose logits the step needs: a row's last real token, every fed token
        of a draft being verified or of a prompt being scored.
    first : dict
        slot -> the offset into the logits such that ``logits[first[slot] + t]`` is the slot's token t.
    only_last : bool
        Exactly each slot's last token is needed, every slot active: the forward returns [B, vocab].
    decoding : bool
        No slot prefills: the step's time prices drafts (:class:`StepCosts`).
    """

    active: list
    counts: np.ndarray
    tokens: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    first: dict
    only_last: bool
    decoding: bool

    @property
    def batch(self) -> int:
        return len(self.counts)

    @property
    def real(self) -> int:
        """Real rows fed (prompt tokens, last tokens and drafts)."""
        return int(self.counts.sum())

    @property
    def feed(self) -> Feed:
        """The forward pass's input (:meth:`Transformer.run`): the tokens and counts, and the logits of
        ``rows``/``cols`` (each slot's last token instead, when ``only_last``)."""
        if self.only_last:
            return Feed(self.tokens, self.counts, last_only=True)
        return Feed(self.tokens, self.counts, self.rows, self.cols)


def plan_step(active: list, chunk: int, *, waits, price) -> StepPlan:
    """Plan one step over ``active`` sequences (each with a ``slot``): a prefilling sequence feeds its next
    chunk of at most ``chunk`` prompt tokens (none while ``waits(s)``: a choice whose leader still feeds
    the prompt), a decoding one its last token and the draft it plans (at most ``chunk - 1`` tokens,
    ``price(base, rows)``: a step of ``rows`` rows in steps of ``base`` rows, :meth:`StepCosts.ratio`).
    Touches no cache and no model: only the sequences' drafts."""
    B = max(s.slot for s in active) + 1                                # slots past the last active idle
    counts = np.zeros(B, np.int64)
    rows_fed = len(active)                                             # rows so far, drafts planned included
    for s in active:                                                   # a draft rides after the last token
        if s.prefilling:
            counts[s.slot] = 0 if waits(s) else min(chunk, len(s.job.prompt) - s.done)
        else:
            base = rows_fed
            counts[s.slot] = 1 + len(s.plan_draft(chunk - 1, lambda k: price(base, base + k)))
            rows_fed += counts[s.slot] - 1
    tokens = np.zeros((B, int(counts.max())), np.int64)               # [B, T] ragged, zero padding
    for s in active:
        tokens[s.slot, :counts[s.slot]] = (s.job.prompt[s.done: s.done + counts[s.slot]] if s.prefilling
                                           else [s.next_token, *s.draft])
    rows, cols, first = [], [], {}
    for s in active:
        n = int(counts[s.slot])
        want = (range(n) if s.draft or (s.job.targets is not None and s.prefilling)
                else range(max(n - 1, 0), n))                          # an idle, waiting slot (n = 0): none
        first[s.slot] = len(rows) - want.start
        rows += [s.slot] * len(want)
        cols += list(want)
    return StepPlan(active=active, counts=counts, tokens=tokens, rows=np.array(rows, np.int64),
                    cols=np.array(cols, np.int64), first=first,
                    only_last=len(rows) == len(active) and len(active) == B,
                    decoding=all(not s.prefilling for s in active))


class _Uncounted:
    """Stands in for the server's Prometheus ``Metrics`` when nobody scrapes: every counter, gauge and
    histogram it names is a no-op."""

    def __getattr__(self, name):
        return self

    def labels(self, *values):
        return self

    def inc(self, n=1):
        pass

    def set(self, value):
        pass

    def observe(self, value):
        pass


class Engine:
    """Continuous-batching decode loop over one batch of ring caches.

    Parameters
    ----------
    model : Transformer
    tokenizer : Tokenizer
    config : EngineConfig
    metrics : serve.metrics.Metrics, optional
        Counters to update (default: none).
    isolate_failures : bool
        A failure fails the requests it touches and the engine goes on (the server); False raises it.
    reset_finished : bool
        Zero a finished sequence's rows at once so that its slot can take the next request (the
        server); False keeps them for the caller to read (:class:`Generator`: ``gen.caches``).

    Examples
    --------
    >>> eng = Engine(tf, tok, EngineConfig(slots=2))                          # doctest: +SKIP
    >>> out = []
    >>> eng.submit(Sequence(job=Job(prompt=(1, 2, 3), max_tokens=4), emit=out.append, tok=tok))
    >>> while eng.busy:
    ...     eng.step()
    """

    def __init__(self, model, tokenizer, config: EngineConfig, metrics=None, *, isolate_failures: bool = True,
                 reset_finished: bool = True, step_costs: StepCosts | None = None):
        self.model, self.tok, self.cfg = model, tokenizer, config
        # decode step times by rows fed, which price drafts (speculative.DraftPolicy); a Generator hands
        # its own in, so that what one generation timed serves the next
        self.step_costs = step_costs if step_costs is not None else StepCosts()
        self.metrics = metrics if metrics is not None else _Uncounted()
        self.isolate_failures, self.reset_finished = isolate_failures, reset_finished
        kw = config.cache_kwargs
        self.caches = model.new_caches(batch=config.slots, **kw)          # one KVCache per layer, batch=slots
        self.slots: list = [None] * config.slots                           # Sequence or None per slot
        self.queue: collections.deque = collections.deque()
        self.prompt_cache = PromptCache(int(config.prompt_cache_mb * 2**20),
                                        lambda: model.new_caches(batch=1, **kw))
        self.steps = 0
        self.step_threads = 0                            # threads the last step's forward ran on (0: none yet)
        self.threads = _chooser(model)                  # 1 thread or the count set, per kind of step
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ called from other threads
    def submit(self, seq: Sequence) -> None:
        """Queue ``seq``; raises QueueFull when ``max_queue`` requests already wait beyond the free slots."""
        with self._cv:
            free = sum(s is None for s in self.slots)          # queued requests that get a slot next step
            if len(self.queue) >= self.cfg.max_queue + free:
                self.metrics.rejected.inc()
                raise QueueFull(f"the server is busy: {len(self.queue)} requests already wait for one of "
                                f"{self.cfg.slots} slots (max_queue={self.cfg.max_queue}); retry later")
            self.queue.append(seq)
            self.metrics.queued.set(len(self.queue))
            self._cv.notify()

    def cancel(self, seq: Sequence) -> None:
        """The client left: ``seq`` stops before the engine's next step."""
        if not seq.finished and not seq.cancelled.is_set():
            seq.cancel_step = self.steps
            seq.cancelled.set()
            with self._cv:
                self._cv.notify()

    def start(self) -> "Engine":
        """Run steps on a thread of its own until :meth:`stop` (the server)."""
        self._thread = threading.Thread(target=self._loop, name="streamattn-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        for seq in list(self.queue) + [s for s in self.slots if s is not None]:
            seq.fail("the server is shutting down")

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def busy(self) -> bool:
        """Requests wait or run."""
        return bool(self.queue) or self.running > 0

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        if self.cfg.threads is not None:
            from streamattn.runtime.threads import set_threads
            set_threads(self.cfg.threads)             # numba's thread count is per calling thread
        while True:
            with self._cv:
                while not self._stop and not self.queue and self.running == 0:
                    self._cv.wait(0.5)
                if self._stop:
                    return
            try:
                self.step()
            except Exception:                          # a bug outside any one request: keep serving
                traceback.print_exc()
                time.sleep(0.01)

    def step(self) -> None:
        """One engine step (see the module docstring): :meth:`schedule`, :meth:`execute`, :meth:`update`."""
        t0 = time.perf_counter()
        plan = self.schedule()
        if plan is None:
            return
        logits = self.execute(plan)
        if logits is None:                                  # the forward failed: its requests are failed
            return
        self.update(plan, logits)
        took = time.perf_counter() - t0
        self.metrics.step_seconds.observe(took)
        if plan.decoding:
            self.step_costs.record(plan.real, took)

    def schedule(self) -> StepPlan | None:
        """Drop cancelled requests, admit queued ones, and plan this step over the active slots (None
        when no slot is active); drafts are planned here, priced by :attr:`step_costs`."""
        self._drop_cancelled()
        self._admit()
        active = [s for s in self.slots if s is not None]
        if not active:
            return None
        return plan_step(active, self.cfg.prefill_chunk, waits=self._waits, price=self.step_costs.ratio)

    def execute(self, plan: StepPlan):
        """Run ``plan`` through the model: host logits [len(plan.rows), vocab] (or [B, vocab] when
        ``plan.only_last``). A failure fails the step's requests and returns None (``isolate_failures``),
        else it propagates."""
        caches = self.caches if plan.batch == self.cfg.slots else self._head(plan.batch, plan.counts)
        adapt = self.cfg.adapt_threads and plan.real <= ADAPT_ROWS
        kind, ceiling = 1 << max(plan.real - 1, 0).bit_length(), thread_count()   # real rows, by powers of 2
        head = None                      # the output head: its own count (DESIGN §12)
        if adapt and ceiling > 1:
            alone = self.threads.seconds(("head", kind), ceiling, 1)
            gate = alone is None or alone < LONG_HEAD_S
            head = lambda: self.threads.step(("head", kind), ceiling=ceiling, gate=gate)   # noqa: E731
        try:
            with self.threads.step(kind) if adapt else contextlib.nullcontext() as n:
                self.step_threads = n if adapt else ceiling
                return to_host(self.model.run(plan.feed, caches, backend=self.cfg.backend,
                                              positions=self.cfg.positions, head_threads=head), copy=False)
        except Exception as e:                                             # shared by the batch
            if not self.isolate_failures:
                raise
            traceback.print_exc()
            for s in plan.active:
                s.fail(f"the model step failed: {type(e).__name__}: {e}")
                self._free(s, "error")
            return None

    def update(self, plan: StepPlan, logits) -> None:
        """Hand each active sequence its logits: a prompt chunk advances (scored if it has targets), a
        completed prompt forks its waiting choices and enters the prompt cache, a decoding sequence draws
        its token or verifies its draft; finished sequences give their slots back."""
        for s in plan.active:
            n = int(plan.counts[s.slot])
            at = plan.first[s.slot]                             # logits[at + t]: the slot's token t
            row = logits[s.slot] if plan.only_last else logits[at + n - 1]  # [vocab]: the last real token's
            if s.prefilling:                                    # (a sequence with a draft never is)
                if s.job.targets is not None:
                    s.score(logits[at:at + n], s.done)
                s.done += n
                if s.prefilling:
                    continue
                self._fork_followers(s, plan.active)
                if s.job.cache_prompt and self.cfg.prompt_cache_mb > 0:
                    self.prompt_cache.store(list(s.job.prompt), caches=self.caches, slot=s.slot)
                    self.metrics.cache_bytes.set(self.prompt_cache.nbytes)
            try:
                if s.draft:
                    ended = self._verify(s, logits[at:at + n])
                else:
                    ended = s.advance(row)
                    self.metrics.generation_tokens.inc()
            except Exception as e:
                if not self.isolate_failures:
                    raise
                traceback.print_exc()
                s.fail(f"this request failed in its engine step: {type(e).__name__}: {e}")
                self._free(s, "error")
                continue
            if ended:
                self._free(s, None)
        self.steps += 1
        self.metrics.steps.inc()

    @staticmethod
    def _waits(s: Sequence) -> bool:
        """``s`` is a further choice whose leader, running beside it, is still feeding the same prompt."""
        return s.leader is not None and s.done == 0 and s.leader.slot >= 0 and s.leader.prefilling

    def _fork_followers(self, s: Sequence, active: list) -> None:
        """``s`` has just fed its whole prompt: each choice waiting on it takes a copy of its rows, less
        the last prompt token, which the choice runs itself (the same bits: §7); a rewind of one token is
        always allowed (§4)."""
        for f in active:
            if f.leader is s and f.done == 0 and f.slot >= 0:
                for c in self.caches:
                    state.fork(c, s.slot, f.slot)
                    state.rewind(c, f.slot, 1)
                f.done = f.cached = len(f.job.prompt) - 1

    def _verify(self, s: Sequence, rows) -> bool:
        """Accept what ``s``'s draft earns from ``rows`` [1 + k, vocab] and rewind the rest out of every
        layer (always allowed: a draft is at most ``prefill_chunk - 1`` tokens, docs/DESIGN.md §24)."""
        k, before = len(s.draft), len(s.generated)
        ended, rejected = s.verify(rows)
        self.metrics.spec_drafted.inc(k)
        self.metrics.spec_accepted.inc(k - rejected)
        self.metrics.generation_tokens.inc(len(s.generated) - before)
        if rejected:
            for c in self.caches:
                state.rewind(c, s.slot, rejected)
        return ended

    def _head(self, n: int, counts) -> list:
        """Views of slots 0..n-1 of every layer (KVCache.head), causal caches grown first for this step."""
        for c in self.caches:
            need = int((c.lengths[:n] + counts).max())
            if c.spec.window is None and need > c.slots:
                c.reserve(need)
        return [c.head(n) for c in self.caches]

    def _drop_cancelled(self) -> None:
        with self._cv:
            kept = [s for s in self.queue if not s.cancelled.is_set()]
            if len(kept) != len(self.queue):
                for s in self.queue:
                    if s.cancelled.is_set():
                        s.finish("cancelled")             # ends a handler still waiting, if any
                        self.metrics.requests.labels("cancelled").inc()
                self.queue = collections.deque(kept)
                self.metrics.queued.set(len(self.queue))
        for s in self.slots:
            if s is not None and s.cancelled.is_set():
                self.metrics.cancel_steps.observe(self.steps - s.cancel_step)
                s.finish("cancelled")
                self._free(s, "cancelled")

    def _admit(self) -> None:
        with self._cv:
            for b in range(len(self.slots)):
                if not self.queue:
                    break
                if self.slots[b] is None:
                    s = self.queue.popleft()
                    s.slot = b
                    self.slots[b] = s
            self.metrics.queued.set(len(self.queue))
        for s in self.slots:
            if s is not None and not s.admitted:
                s.admitted = True
                self.metrics.prompt_tokens.inc(len(s.job.prompt))
                if s.job.cache_prompt and self.cfg.prompt_cache_mb > 0 and s.job.targets is None:
                    self.metrics.cache_lookups.inc()
                    try:
                        n = self.prompt_cache.lookup(list(s.job.prompt), caches=self.caches, slot=s.slot)
                    except Exception:                  # never serve a half-loaded slot: prefill it all
                        traceback.print_exc()
                        for c in self.caches:
                            c.reset(s.slot)
                        n = 0
                    if n:
                        s.done = s.cached = n
                        self.metrics.cache_hits.inc()
                        self.metrics.cached_tokens.inc(n)
        self.metrics.running.set(self.running)

    def _free(self, s: Sequence, outcome: str | None) -> None:
        """Give ``s``'s slot back at once: its rows are zeroed in every layer (kept: ``reset_finished``)."""
        if s.slot >= 0 and self.slots[s.slot] is s:
            if self.reset_finished or (outcome or s.finish_reason) == "error":
                for c in self.caches:
                    c.reset(s.slot)
            self.slots[s.slot] = None
        s.slot = -1
        self.metrics.requests.labels(outcome or s.finish_reason or "unknown").inc()
        self.metrics.running.set(self.running)
